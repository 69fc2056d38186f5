"""What ``conduit demo`` (conduit-rllib's DQN demo) says about its first iteration is true for the sizes given.

Iteration 1 collects ``--steps`` transitions before learning starts (``num_steps_sampled_before_learning_starts``
= ``--steps``): with the defaults (200 steps, capacity 5000) that is 4% of the buffer, not "fills the buffer",
as the --iterations help and the line above the medians said.
"""

from __future__ import annotations

import pytest

demo = pytest.importorskip("conduit_rllib.demo")


def _help(capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as e:
        demo.run(["--help"])
    assert e.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def test_iterations_help_does_not_claim_the_first_iteration_fills_the_buffer(
        capsys: pytest.CaptureFixture[str]) -> None:
    text = _help(capsys)
    assert "(default: 200)" in text and "(default: 5000;" in text, text  # the defaults: 200 steps, 5000 capacity
    assert "fills the buffer" not in text, text


@pytest.mark.parametrize(("steps", "capacity", "said"), [
    (200, 5000, "stores the first 200 of the buffer's 5000 transitions"),
    (30, 300, "stores the first 30 of the buffer's 300 transitions"),
    (500, 300, "fills the buffer"),
    (300, 300, "fills the buffer"),
])
def test_median_heading_says_what_the_first_iteration_stored(steps: int, capacity: int, said: str) -> None:
    line = demo.median_heading(iterations=5, steps=steps, capacity=capacity)
    assert "median over iterations 2..5" in line and said in line, line
    if capacity > steps:
        assert "fills the buffer" not in line, line
