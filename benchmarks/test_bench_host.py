"""Host tier: sample-512 and ingestion, Conduit vs cpprb vs TorchRL vs a pure gather floor.

All four hold the same float32 observations of dimension d. The floor is
``torch.index_select(storage, 0, randint(...), out=reused)``: drawing indices plus the
gather itself, nothing else. Run: ``.venv/bin/python -m pytest benchmarks/test_bench_host.py``.
"""

from __future__ import annotations

import gc
import importlib.util
import random
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple, cast

import numpy as np
import pytest
import torch
from conduit import ExperienceDataPlane, ExperienceSchema, Field, Replay
from conduit.storage.columnar import ColumnarStorage

DIMS = [128, 1000, 5000, 20000]
BATCH = 512
LIBS = ["floor", "conduit", "cpprb", "torchrl"]


def capacity_for(d: int) -> int:
    """At most 100k items and about 512 MiB per buffer."""
    return int(min(100_000, (512 << 20) // (4 * d)))


class Calls(NamedTuple):
    """One library's buffer: the timed calls, and ``newest(n)``, the ``n`` rows it stored last (untimed: the
    ingestion check)."""

    ingest1: Callable[[], object]
    ingest256: Callable[[], object]
    sample: Callable[[], object]
    newest: Callable[[int], torch.Tensor]


def build(lib: str, d: int, cap: int, data: torch.Tensor) -> Calls:
    """Fill a buffer of ``lib`` with ``cap`` items; return its (ingest one, ingest 256, sample 512, newest) calls."""
    if lib in ("floor", "conduit"):
        edp = ExperienceDataPlane(ExperienceSchema(obs=Field((d,))), capacity=cap, semantics=Replay(seed=0))
        for s in range(0, cap, 1024):
            edp.ingest({"obs": data[: min(1024, cap - s)]})
        if lib == "conduit":
            one, chunk = data[:1], data[:256]
            store = cast(ColumnarStorage, edp.storage)

            def newest(n: int) -> torch.Tensor:
                nxt = store.next_handle
                return store._cols["obs"][torch.arange(nxt - n, nxt) % cap]
            return Calls(lambda: edp.ingest({"obs": one}), lambda: edp.ingest({"obs": chunk}),
                         lambda: edp.deliver(BATCH), newest)
        filled = cast(ColumnarStorage, edp.storage)._cols["obs"]  # its own storage, built and filled as Conduit's is
        out = torch.empty(BATCH, d)
        gen = torch.Generator().manual_seed(0)
        ring = torch.empty(cap, d).fill_(1.0)  # touch every page, as a filled buffer has
        pos = [0]

        def copy_into(src: torch.Tensor) -> None:  # memcpy floor for ingestion: one copy_ into a ring
            n = src.shape[0]
            p = pos[0] if pos[0] + n <= cap else 0
            ring[p:p + n].copy_(src)
            pos[0] = p + n

        one, chunk = data[:1], data[:256]
        return Calls(lambda: copy_into(one), lambda: copy_into(chunk),
                     lambda: torch.index_select(filled, 0, torch.randint(cap, (BATCH,), generator=gen), out=out),
                     lambda n: ring[pos[0] - n:pos[0]])
    if lib == "cpprb":
        import cpprb

        rb = cpprb.ReplayBuffer(cap, env_dict={"obs": {"shape": d, "dtype": np.float32}})
        arr = data.numpy()
        for s in range(0, cap, 1024):
            rb.add(obs=arr[: min(1024, cap - s)])
        one_np, chunk_np = arr[:1], arr[:256]

        def newest_cpprb(n: int) -> torch.Tensor:
            nxt = rb.get_next_index()
            return torch.from_numpy(rb._encode_sample(np.arange(nxt - n, nxt) % cap)["obs"])
        return Calls(lambda: rb.add(obs=one_np), lambda: rb.add(obs=chunk_np), lambda: rb.sample(BATCH), newest_cpprb)
    if lib == "torchrl":
        from tensordict import TensorDict
        from torchrl.data import LazyTensorStorage, ReplayBuffer

        rb = ReplayBuffer(storage=LazyTensorStorage(cap), batch_size=BATCH)
        for s in range(0, cap, 1024):
            n = min(1024, cap - s)
            rb.extend(TensorDict({"obs": data[:n]}, batch_size=[n]))
        one = TensorDict({"obs": data[0]}, batch_size=[])  # one item: TorchRL's add (extend of a batch of one
        chunk = TensorDict({"obs": data[:256]}, batch_size=[256])  # costs ~1.7x as much at d = 128)

        def newest_torchrl(n: int) -> torch.Tensor:
            nxt = int(rb._writer._cursor)
            return rb.storage[torch.arange(nxt - n, nxt) % cap]["obs"]
        return Calls(lambda: rb.add(one), lambda: rb.extend(chunk), lambda: rb.sample(), newest_torchrl)
    raise ValueError(lib)


def sampled_rows(lib: str, out: object) -> torch.Tensor:
    """The observations one ``sample`` call of ``lib`` returned."""
    if lib == "conduit":
        return out[0]["obs"]  # type: ignore[index]
    if lib == "cpprb":
        return torch.from_numpy(out["obs"])  # type: ignore[index]
    if lib == "torchrl":
        return out["obs"]  # type: ignore[index]
    return out  # type: ignore[return-value]


def check_sample(lib: str, out: object, data: torch.Tensor) -> None:
    """A draw is ``BATCH`` float32 rows of shape ``(d,)``, each one of the rows ingested (``data``'s): a fast wrong
    answer (an empty, short or foreign batch) must not be timed as a sample."""
    rows = sampled_rows(lib, out)
    assert tuple(rows.shape) == (BATCH, data.shape[1]) and rows.dtype == torch.float32, (lib, rows.shape, rows.dtype)
    assert all(stored_row(row, data) is not None for row in rows), f"{lib}: a sampled row is none of the rows ingested"


def check_ingest(lib: str, calls: Calls, chunk: int, data: torch.Tensor) -> None:
    """The rows ``lib`` stored last are the ones its timed ingest call hands over (``data[:chunk]``, float32): an
    ingestion that drops, truncates or garbles its rows must not be timed as one."""
    rows = calls.newest(chunk)
    assert tuple(rows.shape) == (chunk, data.shape[1]) and rows.dtype == torch.float32, (lib, rows.shape, rows.dtype)
    assert torch.equal(rows, data[:chunk]), f"{lib}: the rows stored last are not the {chunk} rows ingested"


def stored_row(row: torch.Tensor, data: torch.Tensor) -> int | None:
    """The index of a row of ``data`` equal to ``row`` (candidates found by the first value), or None."""
    for i in (data[:, 0] == row[0]).nonzero().flatten().tolist():
        if torch.equal(data[i], row):
            return int(i)
    return None


@pytest.fixture(scope="module", params=DIMS, ids=lambda d: f"d{d}")
def buffers(request: pytest.FixtureRequest):  # noqa: ANN201
    torch.set_num_threads(1)
    d = request.param
    cap = capacity_for(d)
    data = torch.randn(1024, d)
    made = {lib: build(lib, d, cap, data) for lib in LIBS}
    for lib, calls in made.items():
        check_sample(lib, calls.sample(), data)
    yield d, made, data
    made.clear()
    gc.collect()


@pytest.mark.parametrize("lib", LIBS)
def test_sample_512(benchmark, buffers, lib: str, ratios) -> None:  # noqa: ANN001
    d, made, data = buffers
    sample = made[lib][2]
    benchmark.group = f"sample512-d{d}"
    check_sample(lib, benchmark(sample), data)
    ratios.add("host_sample512", f"d={d}", lib, benchmark, baseline="floor",
               note=f"Sample {BATCH} float32 observations (host tier, 1 thread).")


def draw_then_read(lib: str, sample: Callable[[], object]) -> Callable[[], tuple[object, float]]:
    """``sample`` as a learner uses it: the draw, then one read of every value of the batch (a sum, the same kernel
    for every library). A draw alone leaves out where its batch ended up: a gather that writes around the caches
    (Conduit's, from 4 MiB per field) hands the reader a batch in memory, one with plain stores in the cache."""

    def call() -> tuple[object, float]:
        out = sample()
        return out, float(sampled_rows(lib, out).sum())
    return call


@pytest.mark.parametrize("lib", LIBS)
def test_sample_512_then_read(benchmark, buffers, lib: str, ratios) -> None:  # noqa: ANN001
    d, made, data = buffers
    benchmark.group = f"sample512-read-d{d}"
    out, _ = benchmark(draw_then_read(lib, made[lib][2]))
    check_sample(lib, out, data)
    ratios.add("host_sample512_read", f"d={d}", lib, benchmark, baseline="floor",
               note=f"Sample {BATCH} float32 observations, then read the batch once (a sum) as a learner would "
                    f"(host tier, 1 thread).")


@pytest.mark.parametrize("chunk", [1, 256])
@pytest.mark.parametrize("lib", LIBS)
def test_ingest(benchmark, buffers, lib: str, chunk: int, ratios) -> None:  # noqa: ANN001
    d, made, data = buffers
    fn = made[lib][0 if chunk == 1 else 1]
    benchmark.group = f"ingest{chunk}-d{d}"
    benchmark(fn)
    check_ingest(lib, made[lib], chunk, data)
    ratios.add(f"host_ingest{chunk}", f"d={d}", lib, benchmark, baseline="floor",
               note=f"Ingest chunks of {chunk} float32 observations; floor = one copy_ into a preallocated ring.")


# -- sample 512 without replacement: the cost must not grow with the buffer ----------------------------------------
NO_REPEAT_CAPS = [10_000, 100_000, 1_000_000]
NO_REPEAT_D = 16


@pytest.fixture(scope="module", params=NO_REPEAT_CAPS, ids=lambda c: f"cap{c}")
def no_repeat(request: pytest.FixtureRequest):  # noqa: ANN201
    """A full buffer of ``cap`` items (d = 16) and four ways to draw 512 of them: Conduit's ``replace=False``
    delivery; ``permutation``: the naive torch draw (the head of ``randperm(cap)``, gathered into a reused buffer);
    ``numpy-choice``: NumPy's ``Generator.choice(cap, 512, replace=False)`` (what a user would pick: its cost does
    not grow with ``cap``), gathered the same way; ``floor``: a draw *with* replacement gathered the same way (the
    cost of any 512-row draw)."""
    torch.set_num_threads(1)
    cap = request.param
    edp = ExperienceDataPlane(ExperienceSchema(obs=Field((NO_REPEAT_D,))), capacity=cap, semantics=Replay(seed=0))
    data = torch.randn(min(cap, 65536), NO_REPEAT_D)
    for s in range(0, cap, data.shape[0]):
        part = data[: min(data.shape[0], cap - s)].clone()
        part[:, 0] = torch.arange(s, s + part.shape[0])  # each item's first value is its index: draws can be checked
        edp.ingest({"obs": part})
    store = cast(ColumnarStorage, edp.storage)._cols["obs"]
    assert torch.equal(store[:, 0], torch.arange(cap, dtype=torch.float32))
    out = torch.empty(BATCH, NO_REPEAT_D)
    gen = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)
    calls = {
        "conduit": lambda: edp.deliver(BATCH, replace=False),
        "permutation": lambda: torch.index_select(store, 0, torch.randperm(cap, generator=gen)[:BATCH], out=out),
        # NumPy's own draw without replacement (for a draw of 512 its cost hardly grows with cap)
        "numpy-choice": lambda: torch.index_select(
            store, 0, torch.from_numpy(rng.choice(cap, BATCH, replace=False)), out=out),
        "floor": lambda: torch.index_select(store, 0, torch.randint(cap, (BATCH,), generator=gen), out=out),
    }
    for lib, call in calls.items():
        check_items(lib, call(), store, distinct=lib != "floor")
    yield cap, calls, store
    edp.close()
    calls.clear()
    gc.collect()


def check_items(lib: str, out: object, store: torch.Tensor, *, distinct: bool) -> None:
    """A draw is ``BATCH`` stored items (each row's first value is its item's index), all different ones with
    ``distinct``: a draw without replacement that repeats an item must not be timed as one."""
    rows = sampled_rows(lib, out)
    assert tuple(rows.shape) == (BATCH, store.shape[1]) and rows.dtype == torch.float32, (lib, rows.shape, rows.dtype)
    items = rows[:, 0].long()
    assert bool(((items >= 0) & (items < store.shape[0])).all()) and torch.equal(rows, store[items]), \
        f"{lib}: a drawn row is none of the items stored"
    if distinct:
        assert items.unique().numel() == BATCH, f"{lib}: a draw without replacement repeated an item"


@pytest.mark.parametrize("lib", ["floor", "conduit", "permutation", "numpy-choice"])
def test_sample_512_without_replacement(benchmark, no_repeat, lib: str, ratios) -> None:  # noqa: ANN001
    cap, calls, store = no_repeat
    benchmark.group = f"sample512-norepeat-cap{cap}"
    check_items(lib, benchmark(calls[lib]), store, distinct=lib != "floor")
    ratios.add("host_sample512_no_repeat", f"cap={cap}", lib, benchmark, baseline="floor",
               note=f"Sample {BATCH} distinct items of d = {NO_REPEAT_D} (host tier, 1 thread); floor = a draw with "
                    f"replacement gathered into a reused buffer.")


def test_host_paired_script_writes_its_figures_with_the_machine_and_command(tmp_path: Path) -> None:
    """``scripts/host_paired.py --out FILE`` (the paired figures ``benchmarks/README.md`` judges the targets on)
    writes, after a line naming the machine, the command and the date, a table per op with one row per d whose
    floor time and ratios parse (run here at a tiny size, without TorchRL: the figures themselves are not asserted)."""
    path = Path(__file__).parent / "scripts" / "host_paired.py"
    spec = importlib.util.spec_from_file_location("host_paired_under_test", path)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "paired.md"
    script.main(["--dims", "8", "16", "--rounds", "3", "--calls", "2", "--no-torchrl", "--out", str(out)])
    text = out.read_text()
    header = re.search(r"^Machine: (\d+) CPUs \(nproc\), (.+); command: `(.+)`; date: (\d{4}-\d{2}-\d{2})\.$", text,
                       re.M)
    assert header is not None, text
    assert int(header.group(1)) >= 1 and header.group(2)
    assert header.group(3).startswith("python benchmarks/scripts/host_paired.py --dims 8 16")
    ratio = re.compile(r"(\d+\.\d+)x \((\d+\.\d+)-(\d+\.\d+)\)")
    sections = re.split(r"^## (\w+)$", text, flags=re.M)[1:]
    assert sections[::2] == list(script.OPS), text
    for body in sections[1::2]:
        rows = re.findall(r"^\| d=(\d+) \| (\d+\.\d+) \| (.+) \|$", body, re.M)
        assert [int(d) for d, _, _ in rows] == [8, 16], body
        for _, floor_ms, cells in rows:
            assert float(floor_ms) >= 0
            figures = cells.split(" | ")
            assert len(figures) == 3, cells  # conduit / floor, cpprb / floor, conduit / cpprb
            for figure in figures:
                m = ratio.fullmatch(figure)
                assert m is not None, figure
                med, lo, hi = map(float, m.groups())
                assert 0 < lo <= med <= hi, figure


@pytest.mark.parametrize(("name", "args", "rows"), [
    ("torchrl_add_extend", ["--dims", "8", "16", "--rounds", "3", "--calls", "2"], 2),
    ("host_hold", ["--dims", "8", "16", "--rounds", "3", "--calls", "2"], 2),
    ("host_memory", ["--rounds", "2", "--item-dim", "16", "--item-capacity", "64", "--dims", "8", "--gather-rounds",
                     "3", "--calls", "2"], 2),
])
def test_host_side_scripts_write_their_figures_with_the_machine_and_command(
        tmp_path: Path, name: str, args: list[str], rows: int) -> None:
    """The paired scripts behind the README's side figures (TorchRL's ``add`` against ``extend`` of one, a held batch
    against a dropped one, prefault and huge pages) write, after a line naming the machine, the command and the date,
    their table rows, whose ratios parse with the median inside its interval (run here at a tiny size: the figures
    themselves are not asserted)."""
    if name == "torchrl_add_extend" and importlib.util.find_spec("torchrl") is None:
        pytest.skip("TorchRL is not installed")
    path = Path(__file__).parent / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", path)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / f"{name}.md"
    script.main([*args, "--out", str(out)])
    text = out.read_text()
    header = re.search(r"^Machine: (\d+) CPUs \(nproc\), (.+); command: `(.+)`; date: (\d{4}-\d{2}-\d{2})\.$", text,
                       re.M)
    assert header is not None, text
    assert header.group(3).startswith(f"python benchmarks/scripts/{name}.py {' '.join(args[:2])}")
    table_rows = [line for line in text.splitlines() if re.match(r"^\| [\w=.]+ \|", line)
                  and not re.match(r"^\| (d|append) ", line)]
    assert len(table_rows) == rows, text
    figures = re.findall(r"(\d+\.\d+)x \((\d+\.\d+)-(\d+\.\d+)\)", text)
    assert figures, text
    for med, lo, hi in figures:
        assert 0 < float(lo) <= float(med) <= float(hi), (med, lo, hi)


def test_paired_rounds_times_every_variant_once_a_round_in_the_rngs_shuffled_order() -> None:
    """``config_sweep.paired_rounds`` (the host scripts' paired loop), with callables that log their calls: each
    round runs every variant's ``warmup`` + ``reps`` calls together, then its ``after`` check, in the order
    ``rng.shuffle`` gives that round (a second ``Random`` of the same seed replays it; the orders differ between
    rounds); it returns one time per round per variant, keyed in the callables' order."""
    path = Path(__file__).parent / "scripts" / "config_sweep.py"
    spec = importlib.util.spec_from_file_location("config_sweep_under_test", path)
    assert spec is not None and spec.loader is not None
    sweep = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = sweep  # (its dataclasses look their module up)
    spec.loader.exec_module(sweep)
    log: list[str] = []
    keys = ["a", "b", "c", "d"]
    calls = {k: (lambda k=k: log.append(k)) for k in keys}
    rounds, reps, warmup = 5, 3, 2
    times = sweep.paired_rounds(calls, rounds=rounds, reps=reps, warmup=warmup, rng=random.Random(7),
                                after=lambda k: log.append(f"after {k}"))
    assert list(times) == keys
    assert all(len(t) == rounds and all(x >= 0 for x in t) for t in times.values()), times
    replay = random.Random(7)
    orders = []
    for _ in range(rounds):
        order = list(keys)
        replay.shuffle(order)
        orders.append(order)
    assert len({tuple(o) for o in orders}) > 1  # (this seed does reorder them)
    assert log == [x for order in orders for k in order for x in [k] * (warmup + reps) + [f"after {k}"]]
