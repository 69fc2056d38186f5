"""Single-item host ingestion (Synchronous scheduler, host storage, uniform Replay): what one
``ExperienceDataPlane.ingest`` call must keep however its path is tuned: the telemetry records it
leaves (names, counts, bytes, nesting of the times), the generation-stamped handles it returns, the
typed errors for bad input with the buffer unchanged, and unique handles under concurrent producers.
"""

from __future__ import annotations

import threading

import pytest
import torch
from conduit import ExperienceDataPlane, ExperienceSchema, Field, Replay, SchemaError

D = 128


def make(capacity: int = 8) -> ExperienceDataPlane:
    return ExperienceDataPlane(ExperienceSchema(obs=Field((D,))), capacity=capacity, semantics=Replay(seed=0))


def test_one_ingest_records_ingest_inside_ingest_wait() -> None:
    edp = make()
    one = torch.ones(1, D)
    edp.ingest({"obs": one})
    recs = [r for r in edp.telemetry.records if r.kind in ("ingest", "ingest_wait")]
    assert [r.kind for r in recs] == ["ingest", "ingest_wait"]  # the storing part ends first
    store, wait = recs
    assert (store.items, store.nbytes) == (1, D * 4)  # bytes stored: one float32 row of d
    assert (wait.items, wait.nbytes) == (1, 0)  # the caller's wait moves no bytes of its own
    assert wait.start <= store.start <= store.end <= wait.end  # the storing part lies within the caller's call
    assert store.thread == wait.thread
    totals = edp.telemetry.totals
    assert (totals["ingest"].calls, totals["ingest"].items, totals["ingest"].nbytes) == (1, 1, D * 4)
    assert (totals["ingest_wait"].calls, totals["ingest_wait"].items) == (1, 1)
    assert totals["ingest_wait"].seconds >= totals["ingest"].seconds >= 0.0


def test_many_single_ingests_count_every_call_across_folds() -> None:
    edp = make(capacity=100)
    one = torch.zeros(1, D)
    calls = 3000  # more than a fold's worth of records (Telemetry's default fold_every is 1024)
    for _ in range(calls):
        edp.ingest({"obs": one})
    totals = edp.telemetry.totals
    assert (totals["ingest"].calls, totals["ingest"].items, totals["ingest"].nbytes) == (calls, calls, calls * D * 4)
    assert (totals["ingest_wait"].calls, totals["ingest_wait"].items, totals["ingest_wait"].nbytes) == (calls, calls, 0)


def test_single_item_handles_are_consecutive_and_generation_stamped() -> None:
    cap = 4
    edp = make(capacity=cap)
    handles = []
    for i in range(2 * cap + 1):
        h = edp.ingest({"obs": torch.full((1, D), float(i))})
        assert h is not None and h.dtype == torch.int64 and h.shape == (1,)
        handles.append(int(h[0]))
    assert handles == list(range(2 * cap + 1))
    last = handles[-1]
    assert (last // cap, last % cap) == (2, 0)  # generation 2 of slot 0: the handle is not reused after a wrap
    # the live items are the newest cap ones, each holding what its call gave
    batch, info = edp.deliver(32)
    for h, row in zip(info.handles.tolist(), batch.tensor("obs")[:, 0].tolist(), strict=True):
        assert last - cap < h <= last and row == float(h)


def test_returned_handles_are_the_callers_own() -> None:
    edp = make()
    a = edp.ingest({"obs": torch.zeros(1, D)})
    assert a is not None
    a.fill_(-7)  # changing one call's handles must not change the next call's
    b = edp.ingest({"obs": torch.zeros(1, D)})
    assert b is not None and b.tolist() == [1]


@pytest.mark.parametrize("bad, words", [
    ({"obs": torch.zeros(1, D, dtype=torch.float64)}, "dtype"),
    ({"obs": torch.zeros(1, D + 1)}, "shape"),
    ({"obs": torch.zeros(D)}, "shape"),
    ({}, "missing ['obs']"),
    ({"obs": torch.zeros(1, D), "extra": torch.zeros(1)}, "unexpected ['extra']"),
])
def test_bad_single_item_is_refused_unrecorded_and_unstored(bad: dict[str, torch.Tensor], words: str) -> None:
    edp = make()
    edp.ingest({"obs": torch.ones(1, D)})
    before = edp.telemetry.totals
    with pytest.raises(SchemaError) as exc:
        edp.ingest(bad)
    assert words in str(exc.value)
    after = edp.telemetry.totals
    assert after["ingest"] == before["ingest"] and after["ingest_wait"] == before["ingest_wait"]
    assert len(edp) == 1
    h = edp.ingest({"obs": torch.ones(1, D)})
    assert h is not None and h.tolist() == [1]  # no handle was spent on the refused call


def test_concurrent_single_item_producers_get_unique_handles() -> None:
    edp = make(capacity=10_000)
    per, threads = 500, 4
    got: list[list[int]] = [[] for _ in range(threads)]

    def produce(k: int) -> None:
        row = torch.full((1, D), float(k))
        for _ in range(per):
            h = edp.ingest({"obs": row})
            assert h is not None
            got[k].append(int(h[0]))

    workers = [threading.Thread(target=produce, args=(k,)) for k in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    every = sorted(h for hs in got for h in hs)
    assert every == list(range(per * threads))  # nothing lost or handed out twice
    for hs in got:
        assert hs == sorted(hs)  # each producer's items in its call order
    totals = edp.telemetry.totals
    assert totals["ingest"].calls == totals["ingest_wait"].calls == per * threads
    # every item holds its producer's row
    st = edp.state_dict()["storage"]["data"]["obs"]
    for k, hs in enumerate(got):
        assert all(float(st[h, 0]) == float(k) for h in hs)
