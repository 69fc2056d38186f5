"""Prioritized replay, one DQN training step's buffer work: draw 32 with weights, then update their 32 priorities.

Conduit (``Replay(PrioritizedSampler())``, host tier) against cpprb's
``PrioritizedReplayBuffer``, alpha 0.6, beta 0.4, a full buffer of 4-float observations, at capacity 5000 and 50000
(RLlib's DQN default). Conduit's sum tree is the one this install has (``conduit.semantics.sumtree.sum_tree``: the
compiled tree, or without compiled kernels NumPy's, which keeps leaves only at 5000 and two levels at 50000). Each
call is ``draw`` + ``update`` (priorities from the draw's indices), so the measure includes what a deferred update
leaves for the next draw. TorchRL is left out: the TorchRL 0.10.1 wheel that
fits this environment ships without its compiled segment trees ("SumSegmentTreeFp32 is not
available"), so its prioritized buffer cannot be built here.

Run with statistics: ``.venv/bin/python -m pytest benchmarks/test_bench_prioritized.py``; the
table is written to ``benchmarks/results/prioritized_step.md``.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conduit import ExperienceDataPlane, ExperienceSchema, Field, PrioritizedSampler, Replay

CAPACITIES = (5000, 50000)
LIBS = ("conduit", "cpprb")
BATCH = 32


def build(lib: str, cap: int) -> tuple[np.ndarray, Callable[[], Any]]:
    """A full prioritized buffer of ``lib``: the observations it holds, and one step (draw BATCH, update their
    priorities) that returns the draw's observations, its importance weights and how many updates applied (cpprb:
    None, it does not say)."""
    obs = np.random.default_rng(0).random((cap, 4), dtype=np.float32)
    prios = np.random.default_rng(1)
    if lib == "conduit":
        edp = ExperienceDataPlane(ExperienceSchema(obs=Field((4,))), capacity=cap,
                                  semantics=Replay(PrioritizedSampler(alpha=0.6, beta=0.4), seed=0))
        edp.ingest({"obs": torch.from_numpy(obs)})

        def step() -> Any:
            batch, info = edp.deliver(BATCH)
            applied = edp.update_priorities(info.handles.numpy(), prios.random(BATCH) + 0.01)
            return batch["obs"], info.weights, applied
        return obs, step
    if lib == "cpprb":
        import cpprb

        rb = cpprb.PrioritizedReplayBuffer(cap, {"obs": {"shape": 4}}, alpha=0.6)
        rb.add(obs=obs)

        def step() -> Any:
            s = rb.sample(BATCH, beta=0.4)
            rb.update_priorities(s["indexes"], prios.random(BATCH) + 0.01)
            return s["obs"], s["weights"], None
        return obs, step
    raise ValueError(lib)


def check_step(lib: str, out: Any, obs: np.ndarray) -> None:
    """One step drew BATCH of the buffer's rows with importance weights in (0, 1] and (Conduit) updated all their
    priorities: a fast wrong answer must not be timed as a step."""
    rows, weights, applied = out
    rows, weights = np.asarray(rows), np.asarray(weights).reshape(-1)
    assert rows.shape == (BATCH, 4) and rows.dtype == np.float32, (lib, rows.shape, rows.dtype)
    for row in rows:  # candidates by the first value, then the whole row
        assert any(np.array_equal(obs[i], row) for i in np.flatnonzero(obs[:, 0] == row[0])), \
            f"{lib}: a drawn row {row} was never stored"
    assert weights.shape == (BATCH,) and np.all((weights > 0) & (weights <= 1)), f"{lib}: importance weights {weights}"
    if lib == "conduit":
        assert applied == BATCH, f"{applied} of {BATCH} priority updates reached live items"


@pytest.mark.parametrize("cap", CAPACITIES)
@pytest.mark.parametrize("lib", LIBS)
def test_prioritized_step(benchmark: Any, lib: str, cap: int, ratios: Any) -> None:
    torch.set_num_threads(1)
    obs, step = build(lib, cap)
    check_step(lib, step(), obs)
    benchmark.group = f"prioritized-{cap}"
    check_step(lib, benchmark(step), obs)
    ratios.add("prioritized_step", f"capacity {cap}", lib, benchmark, baseline="cpprb",
               note=f"One training step's prioritized-replay work: draw {BATCH} with importance weights, then update "
                    f"their {BATCH} priorities (alpha 0.6, beta 0.4, full buffer, 1 thread).")


def test_prioritized_trees_script_writes_its_figures_with_the_machine_and_command(tmp_path: Path) -> None:
    """``scripts/prioritized_trees.py --out FILE`` (the paired figures ``benchmarks/README.md`` quotes) writes, after
    a line naming the machine, the command and the date, one row per capacity whose times and ratios parse (run here
    at a tiny size: the figures themselves are not asserted)."""
    path = Path(__file__).parent / "scripts" / "prioritized_trees.py"
    spec = importlib.util.spec_from_file_location("prioritized_trees_under_test", path)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    if not script.COMPILED:
        pytest.skip("this install has no compiled sum tree, which the script measures")
    out = tmp_path / "trees.md"
    script.main(["--capacities", "64", "300", "--rounds", "3", "--calls", "5", "--out", str(out)])
    text = out.read_text()
    header = re.search(r"^Machine: (\d+) CPUs \(nproc\), (.+); command: `(.+)`; date: (\d{4}-\d{2}-\d{2})\.$", text,
                       re.M)
    assert header is not None, text
    assert int(header.group(1)) >= 1 and header.group(2)
    assert header.group(3).startswith("python benchmarks/scripts/prioritized_trees.py --capacities 64 300")
    rows = re.findall(r"^\| (\d+) \| (.+) \|$", text, re.M)
    assert [int(cap) for cap, _ in rows] == [64, 300], text
    ratio = re.compile(r"(\d+\.\d+)x \((\d+\.\d+)-(\d+\.\d+)\)")
    for _, cells in rows:
        *times, general, numpy_ = cells.split(" | ")
        assert len(times) == 3 and all(float(t) > 0 for t in times), cells
        for figure in (general, numpy_):
            m = ratio.fullmatch(figure)
            assert m is not None, figure
            med, lo, hi = map(float, m.groups())
            assert 0 < lo <= med <= hi, figure
