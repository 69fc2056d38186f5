"""The host ring's compiled row copies (``conduit.storage._rows``). Synchronous replay ingestion through
``ColumnarStorage.append_rows``: the same contents, handles, evictions, priorities and telemetry as the general
path (validate into an ``ExperienceBatch``, then ``append``), and every batch it cannot take whole left to that
path, which stores it or refuses it with the same typed error, nothing changed. Gathers: what
``torch.index_select`` gives, for every dtype and row size, and the same refusals."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from conduit import (
    ExperienceBatch,
    ExperienceDataPlane,
    ExperienceSchema,
    Field,
    PrioritizedSampler,
    Replay,
    Synchronous,
)
from conduit.storage import columnar
from conduit.storage.columnar import ColumnarStorage

needs_rows = pytest.mark.skipif(columnar._rows is None, reason="no compiled row store in this install (whether one "
                                                               "is expected: test_the_compiled_tree_is_built)")

SCHEMA = ExperienceSchema(obs=Field((3, 2)), act=Field((), torch.int64), done=Field((), torch.bool))


class GeneralPath(Synchronous):
    """Synchronous under another type: ``ExperienceDataPlane.ingest`` takes its general path for it."""


def pair(capacity: int, prioritized: bool) -> tuple[ExperienceDataPlane, ExperienceDataPlane]:
    def one(scheduler: Synchronous) -> ExperienceDataPlane:
        sampler = PrioritizedSampler(alpha=0.7) if prioritized else None
        return ExperienceDataPlane(SCHEMA, capacity=capacity, scheduler=scheduler,
                                   semantics=Replay(sampler, seed=1) if sampler else Replay(seed=1))
    return one(Synchronous()), one(GeneralPath())


def batch(rng: np.random.Generator, n: int) -> dict[str, torch.Tensor]:
    return {"obs": torch.from_numpy(rng.random((n, 3, 2), dtype=np.float32)),
            "act": torch.from_numpy(rng.integers(0, 9, n)), "done": torch.from_numpy(rng.random(n) < 0.3)}


def outcome(call):  # noqa: ANN001, ANN201
    """What ``call()`` returned, or the type and message of what it raised."""
    try:
        out = call()
        return "returned", None if out is None else out.tolist()
    except Exception as e:  # noqa: BLE001 - compared between the two paths
        return type(e).__name__, str(e)


def same(a: ExperienceDataPlane, b: ExperienceDataPlane) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert (sa["storage"]["oldest"], sa["storage"]["next"]) == (sb["storage"]["oldest"], sb["storage"]["next"])
    for name in SCHEMA:
        assert torch.equal(sa["storage"]["data"][name], sb["storage"]["data"][name]), name
    assert torch.equal(a.storage._cols["obs"], b.storage._cols["obs"])  # type: ignore[attr-defined]
    sampler_a, sampler_b = sa["semantics"]["sampler"], sb["semantics"]["sampler"]
    assert sampler_a.keys() == sampler_b.keys()
    if "leaves" in sampler_a:
        assert torch.equal(sampler_a["leaves"], sampler_b["leaves"])
    ta, tb = a.telemetry.totals, b.telemetry.totals
    for kind in ("ingest", "ingest_wait"):
        assert (ta[kind].calls, ta[kind].items, ta[kind].nbytes) == (tb[kind].calls, tb[kind].items, tb[kind].nbytes)


@needs_rows
@pytest.mark.parametrize("prioritized", [False, True])
def test_the_row_store_ingests_what_the_general_path_does(prioritized: bool) -> None:
    """Random batch sizes (1 to the whole capacity) through a ring that wraps many times, mixed with batches the
    row store must leave to the general path (NumPy arrays, a strided view, another dtype, a missing or extra
    field, other shapes, sizes over the capacity, empty batches): both buffers return the same handles or errors
    and end with the same contents, sampler state and telemetry counts."""
    fast, general = pair(13, prioritized)
    rng = np.random.default_rng(7)
    stored = 0
    for step in range(300):
        n = int(rng.choice([1, 1, 2, 5, 13, 14, 0]))
        b: dict = batch(rng, n)
        kind = int(rng.integers(12))
        if kind == 0:
            b["obs"] = b["obs"].numpy()
        elif kind == 1:
            b["obs"] = torch.from_numpy(rng.random((n, 2, 3), dtype=np.float32)).transpose(1, 2)  # not contiguous
        elif kind == 2:
            b["act"] = b["act"].int()
        elif kind == 3:
            del b["done"]
        elif kind == 4:
            b["extra"] = b["act"]
        elif kind == 5:
            b["obs"] = b["obs"].reshape(n, 6)
        elif kind == 6:
            b["obs"] = b["obs"].requires_grad_()  # stored by value, as the general path stores it
        got = [outcome(lambda e=e, b=b: e.ingest(dict(b))) for e in (fast, general)]
        assert got[0] == got[1], (step, kind, n, got)
        stored += got[0][0] == "returned" and n
        same(fast, general)
        if prioritized and got[0][0] == "returned" and rng.random() < 0.3 and len(fast):
            _, info = fast.deliver(4)
            p = rng.random(4) + 0.1
            for e in (fast, general):
                e.update_priorities(info.handles.numpy(), p)
    assert stored > 5 * 13, "the ring should have wrapped several times"
    for e in (fast, general):
        e.close()


@needs_rows
def test_the_row_store_refuses_a_batch_whole_and_changes_nothing() -> None:
    """``append_rows`` checks every field before it writes: a bad last field leaves the earlier ones unwritten."""
    st = ColumnarStorage(SCHEMA, 6)
    rng = np.random.default_rng(0)
    assert st.append_rows(batch(rng, 4)) == (0, 4, 0, 0)
    before = {n: c.clone() for n, c in st._cols.items()}
    bad = [
        {**batch(rng, 2), "done": torch.zeros(2, dtype=torch.uint8)},  # last field of another dtype
        {**batch(rng, 2), "done": torch.zeros(3, dtype=torch.bool)},  # rows differ
        {**batch(rng, 2), "done": torch.zeros(2, dtype=torch.bool)[:, None]},  # another item shape
        {**batch(rng, 2), "done": torch.zeros(2, dtype=torch.bool).to("meta")},
        {**batch(rng, 2), "obs": torch.zeros(2, 3, 2)._neg_view()},  # a negative view bit: stored by value elsewhere
        {**batch(rng, 2), "act": torch.zeros(2, dtype=torch.int64).to_sparse()},
        batch(rng, 7),  # more than the capacity
        batch(rng, 0),
        {"obs": batch(rng, 2)["obs"]},
    ]
    for b in bad:
        assert st.append_rows(b) is None, b
        assert (st.oldest, st.next_handle) == (0, 4)
        assert all(torch.equal(st._cols[n], before[n]) for n in before)
    res = st.append_rows(batch(rng, 5))  # wraps: slots 4, 5, 0, 1, 2; evicts handles 0..2
    assert res == (4, 5, 0, 3) and (st.oldest, st.next_handle) == (3, 9)


@needs_rows
def test_subclassed_tensors_and_other_storages_take_the_general_path() -> None:
    """A tensor subclass (its own semantics for attribute reads) and storages without a row store (ragged fields,
    disk once closed) are left to the general path."""

    class Tagged(torch.Tensor):
        pass

    st = ColumnarStorage(SCHEMA, 4)
    b = batch(np.random.default_rng(0), 2)
    b["act"] = b["act"].as_subclass(Tagged)
    assert st.append_rows(b) is None and st.next_handle == 0
    ragged = ColumnarStorage(ExperienceSchema(tok=Field((), torch.int64, ragged=True)), 4)
    assert ragged._plan is None and ragged.append_rows({"tok": torch.zeros(3, dtype=torch.int64)}) is None


def test_without_the_row_store_ingestion_takes_the_general_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """An install built without a C compiler has no row store: buffers have no plan and ingest as before."""
    monkeypatch.setattr(columnar, "_rows", None)
    edp = ExperienceDataPlane(SCHEMA, capacity=4, semantics=Replay(seed=0))
    assert edp.storage._plan is None  # type: ignore[attr-defined]
    handles = edp.ingest(batch(np.random.default_rng(0), 3))
    assert handles is not None and handles.tolist() == [0, 1, 2] and len(edp) == 3
    edp.close()


@pytest.fixture(params=["streamed", "plain"])
def streaming(request: pytest.FixtureRequest):  # noqa: ANN201 - yields the setting's name
    """The compiled copies with non-temporal stores from 16 bytes (every copy they can take) or never, whatever
    this machine's cache picked (``conduit.storage.columnar.stream_thresholds``); restored after."""
    if columnar._rows is None:
        pytest.skip("no compiled row store in this install (whether one is expected: test_the_compiled_tree_is_built)")
    size = 16 if request.param == "streamed" else 1 << 62
    before = columnar._rows.streaming(size, size)
    yield request.param
    columnar._rows.streaming(*before)


# -- gathers: the compiled row copy behind ColumnarStorage.gather -------------------------------------------------
@needs_rows
@pytest.mark.usefixtures("streaming")
@pytest.mark.parametrize(("dtype", "item", "rows"), [
    (torch.float32, (5000,), 300),  # 6 MB
    (torch.float32, (1000,), 512),  # 2 MB: the GIL released
    (torch.float32, (4,), 32),  # 512 bytes
    (torch.float16, (3, 3), 700),  # rows of 18 bytes: no 16-byte stores
    (torch.bfloat16, (7,), 40), (torch.bool, (2,), 17), (torch.uint8, (1999,), 2200),
    (torch.uint8, (1,), 50), (torch.float32, (1,), 50), (torch.float64, (1,), 50),  # rows of 1, 4, 8 bytes
    (torch.int64, (), 9),  # a scalar column: torch's own gather
])
def test_compiled_gathers_equal_index_select(dtype: torch.dtype, item: tuple[int, ...], rows: int) -> None:
    """Rows drawn with repeats, in any order, of several dtypes and row sizes (with and without non-temporal
    stores, both sides of the GIL threshold) come out as torch.index_select gives them, in the reused buffers
    handed in."""
    cap = 2500 if item != (5000,) else 400
    st = ColumnarStorage(ExperienceSchema(x=Field(item, dtype)), cap)
    g = torch.Generator().manual_seed(rows)
    values = (torch.rand((cap, *item), generator=g) * 100).to(dtype)
    st.append(ExperienceBatch({"x": values}, cap))
    slots = torch.randint(cap, (rows,), generator=g)
    out = {"x": torch.full((rows, *item), 7).to(dtype)}
    got = st.gather(slots, out)
    assert got["x"] is out["x"] and torch.equal(got["x"], torch.index_select(values, 0, slots))


@needs_rows
def test_a_gather_of_a_slot_outside_the_ring_is_refused_before_it_copies() -> None:
    st = ColumnarStorage(ExperienceSchema(x=Field((4,))), 8)
    out = {"x": torch.zeros(3, 4)}
    with pytest.raises(IndexError):
        st.gather(torch.tensor([1, 8, 2]), out)
    with pytest.raises(IndexError):
        st.gather(torch.tensor([-1, 2, 3]), out)
    assert torch.equal(out["x"], torch.zeros(3, 4))


def test_gathers_the_row_copy_cannot_take_go_to_index_select() -> None:
    """int32 slots, a strided slot view, a non-contiguous output and no output at all give index_select's results,
    and an output of another dtype its refusal (the general path)."""
    st = ColumnarStorage(ExperienceSchema(x=Field((4,))), 8)
    values = torch.arange(32.0).reshape(8, 4)
    st.append(ExperienceBatch({"x": values}, 8))
    idx = torch.tensor([3, 1, 3, 7])
    want = values[idx]
    assert torch.equal(st.gather(idx.int(), {"x": torch.empty(4, 4)})["x"], want)
    assert torch.equal(st.gather(torch.tensor([3, 0, 1, 0, 3, 0, 7])[::2], {"x": torch.empty(4, 4)})["x"], want)
    with pytest.raises(RuntimeError):  # index_select's own refusal of an output of another dtype
        st.gather(idx, {"x": torch.empty(4, 4, dtype=torch.float64)})
    assert torch.equal(st.gather(idx, {"x": torch.empty(4, 8)[:, ::2]})["x"], want)
    assert torch.equal(st.gather(idx)["x"], want)


@needs_rows
def test_large_stores_and_stores_from_the_ring_itself_keep_every_byte(streaming: str) -> None:
    """Large runs (written around the caches, or not, and with the GIL released), a batch that wraps the ring
    (two runs), and a source that overlaps its destination (rows of the ring itself: copied as memmove copies it,
    never streamed) each leave exactly the rows given."""
    d, cap = 5000, 120  # 20 kB rows
    st = ColumnarStorage(ExperienceSchema(x=Field((d,))), cap)
    g = torch.Generator().manual_seed(0)
    first = torch.rand(100, d, generator=g)
    assert st.append_rows({"x": first}) == (0, 100, 0, 0)  # one 2 MB run
    second = torch.rand(60, d, generator=g)
    assert st.append_rows({"x": second}) == (100, 60, 0, 40)  # 20 rows to the end, 40 from the start
    want = torch.cat([second[20:], first[40:], second[:20]])  # slots 0..39, 40..99, 100..119
    assert torch.equal(st._cols["x"], want)
    ring = st._cols["x"]
    view = ring[30:90]  # a source inside the ring, overlapping slots 40..99 that the next 60 rows take
    expected = view.clone()
    assert st.append_rows({"x": view}) == (160, 60, 40, 100)
    assert torch.equal(ring[40:100], expected)


def test_stream_thresholds_grow_with_the_last_level_cache() -> None:
    """From 4 MiB (gathers) and 1 MiB (ring runs) where the cache is unknown or small, from an eighth and a quarter
    of it where it is large; the compiled copies use what this machine's cache gives."""
    assert columnar.stream_thresholds(None) == (4 << 20, 1 << 20)
    assert columnar.stream_thresholds(16 << 20) == (4 << 20, 4 << 20)
    assert columnar.stream_thresholds(300 << 20) == (300 << 17, 75 << 20)
    if columnar._rows is not None:
        assert columnar._rows.streaming(None, None) == columnar.stream_thresholds(columnar.last_level_cache())


def test_the_last_level_cache_is_the_highest_data_or_unified_level(tmp_path) -> None:  # noqa: ANN001
    """Read from Linux's cache directories: the instruction cache is skipped, sizes in K/M are bytes; a missing or
    unreadable directory reports none."""
    for i, (kind, level, size) in enumerate([("Data", 1, "48K"), ("Instruction", 1, "32K"),
                                             ("Unified", 2, "2048K"), ("Unified", 3, "30M"),
                                             ("Instruction", 4, "64M")]):
        d = tmp_path / "cache" / f"index{i}"
        d.mkdir(parents=True)
        for name, value in (("type", kind), ("level", level), ("size", size)):
            (d / name).write_text(f"{value}\n")
    assert columnar.last_level_cache(str(tmp_path)) == 30 << 20
    assert columnar.last_level_cache(str(tmp_path / "none")) is None
    (tmp_path / "cache" / "index3" / "size").write_text("lots\n")
    assert columnar.last_level_cache(str(tmp_path)) is None


@needs_rows
def test_the_streaming_setting_refuses_sizes_below_one_byte_and_changes_nothing() -> None:
    before = columnar._rows.streaming(None, None)
    with pytest.raises(ValueError, match="at least 1 byte"):
        columnar._rows.streaming(0, 5)
    with pytest.raises(TypeError):
        columnar._rows.streaming(None)
    assert columnar._rows.streaming(None, None) == before


def _child(code: str) -> str:
    """Run ``code`` in a fresh interpreter (a memory error there crashes it, not the test run); its stdout."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, f"rc {proc.returncode} (-11: a segfault)\n{proc.stdout}\n{proc.stderr[-2000:]}"
    return proc.stdout


@needs_rows
def test_a_field_replaced_while_the_store_checks_it_is_still_the_one_stored() -> None:
    """The store's checks read tensor attributes, which can run Python code (here a torch function mode) that
    replaces the dict's entry: the tensor checked stays alive and is what gets stored (16 MiB, copied without the
    GIL), never the freed memory it lived in."""
    out = _child("""
        import torch
        from torch.overrides import TorchFunctionMode
        from conduit import ExperienceSchema, Field
        from conduit.storage.columnar import ColumnarStorage
        D = 1 << 16
        st = ColumnarStorage(ExperienceSchema(obs=Field((D,))), 64)
        cols = {"obs": torch.full((64, D), 7.0)}
        class Swap(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if getattr(func, "__name__", "") == "data_ptr" and cols["obs"][0, 0].item() == 7.0:
                    cols["obs"] = torch.full((64, D), 9.0)  # the checked tensor's last reference in the dict
                return out
        with Swap():
            res = st.append_rows(cols)
        print(res.count, float(st._cols["obs"].min()), float(st._cols["obs"].max()))
    """)
    assert out.split() == ["64", "7.0", "7.0"], out


@needs_rows
def test_closing_a_disk_storage_during_a_store_leaves_its_files_mapped_until_the_copy_ends() -> None:
    """A store of 128 MiB runs without the GIL while another thread closes the memory-mapped storage: the plan the
    store was given holds the columns, so the copy finishes into mapped memory (the close lets go after it).

    On a loaded machine the close can come before the store starts: then ``append_rows`` declines (None, as for
    anything it does not take) and ``append`` refuses the closed storage typed; the child then tries again with a
    new storage, until a close lands during a store."""
    out = _child("""
        import tempfile, threading, time, torch
        from conduit import ConfigurationError, ExperienceBatch, ExperienceSchema, Field
        from conduit.storage.disk import DiskStorage
        D, N = 1 << 16, 512
        src = torch.ones(N, D)
        for attempt in range(20):
            st = DiskStorage(ExperienceSchema(obs=Field((D,))), N, directory=tempfile.mkdtemp())
            def close():
                time.sleep(0.002)
                st.close()
            t = threading.Thread(target=close)
            t.start()
            res = st.append_rows({"obs": src})
            t.join()
            if res is not None:
                print("stored", res.count)
                break
            try:  # the close came first
                st.append(ExperienceBatch({"obs": src}, N))
            except ConfigurationError:
                continue
            raise SystemExit("an append to a closed disk storage was not refused")
    """)
    assert out.split() == ["stored", "512"], out


@needs_rows
def test_slots_written_by_another_thread_during_a_gather_are_never_read_unchecked() -> None:
    """A 256 MiB gather runs without the GIL while another thread writes a slot far outside the ring: the gather
    copies the rows of the slots it checked (or refuses the written slot, had the write come first), never reads
    outside the column."""
    out = _child("""
        import threading, time, torch
        from conduit import ExperienceBatch, ExperienceSchema, Field
        from conduit.storage.columnar import ColumnarStorage, gather_into
        D, CAP, K = 1 << 12, 256, 1 << 14
        st = ColumnarStorage(ExperienceSchema(x=Field((D,))), CAP)
        st.append(ExperienceBatch({"x": torch.ones(CAP, D)}, CAP))
        slots, out = torch.zeros(K, dtype=torch.int64), torch.empty(K, D)
        def write():
            time.sleep(0.003)
            slots[-1] = 1 << 40
        t = threading.Thread(target=write)
        t.start()
        try:
            gather_into(st._cols["x"], slots, out, st._raw_cols["x"])
            print("copied", float(out[-1].sum()))
        except IndexError:
            print("refused", float(D))
        t.join()
    """)
    what, total = out.split()
    assert what in ("copied", "refused") and float(total) == 1 << 12, out
