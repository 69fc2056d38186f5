"""``conduit demo``'s (RLlib DQN) argument refusals: each bad count is named alone, before Ray or RLlib start.

One message covered three options ("--iterations and --steps must be >= 1 and --obs-dim >= 4"), whichever of
them was wrong, and so named options the user had not typed.
"""

from __future__ import annotations

import pytest
from conduit_rllib.demo import run

ALL = ("--obs-dim", "--iterations", "--steps", "--batch", "--capacity", "--hidden")


@pytest.mark.parametrize(("flag", "value", "least"), [("--iterations", "0", 1), ("--steps", "-3", 1),
                                                      ("--obs-dim", "3", 4), ("--batch", "0", 1),
                                                      ("--capacity", "-1", 1), ("--hidden", "0", 1)])
def test_each_bad_count_is_refused_by_its_own_name(flag: str, value: str, least: int,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        run([flag, value, "--no-progress"])
    assert done.value.code == 2
    out, err = capsys.readouterr()
    line = err.strip().splitlines()[-1]
    assert line.startswith("conduit demo: error: ") and "Traceback" not in err, err
    assert f"{flag} must be >= {least}, got {value}" in line, line
    assert f"give {flag} {least} or more" in line, line
    assert [f for f in ALL if f in line] == [flag], f"names options that were not wrong: {line}"
    assert "RLlib DQN on LargeObsCartPole" not in out, "the run started before the refusal"
