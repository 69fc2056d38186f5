"""The multi-node driver's bookkeeping under faults at exact points, without a cluster.

A real cluster cannot kill a shard between two writes of one ingestion round on demand, so these
tests inject the faults: the shard servers are real :class:`~conduit.distributed.server.ShardServer`
bodies, called in-process through a small stand-in for Ray's remote calls (a call runs at once; a
"dead" actor answers every call as lost). The driver (``_store``, ``_ingest``, ``_fetch``,
``load_state_dict``) runs unchanged. The same behaviours on a real local cluster, where a run can
produce them, are in ``test_distributed.py`` and ``test_distributed_faults*.py``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from conduit import ExperienceBatch, ExperienceSchema, Field, Ragged
from conduit.distributed import _ray as ray_mod
from conduit.distributed import checkpoint as checkpoint_mod
from conduit.distributed import plane as plane_mod
from conduit.distributed import recovery as recovery_mod
from conduit.distributed import servers as servers_mod
from conduit.distributed._ray import Outcome
from conduit.distributed.errors import ClusterError
from conduit.distributed.plane import DistributedDataPlane
from conduit.distributed.server import ShardServer
from conduit.distributed.servers import ServerInfo, ShardServers
from conduit.errors import ConduitError
from conduit.testing.reference import ID_SCHEMA, check_payload, id_batch

pytestmark = pytest.mark.timeout(60)


# -- an in-process stand-in for Ray ------------------------------------------------------------------
class _Ref:
    def __init__(self, value: Any = None, error: BaseException | None = None, lost: bool = False) -> None:
        self.value, self.error, self.lost = value, error, lost


class _Method:
    def __init__(self, actor: _Actor, name: str) -> None:
        self.actor, self.name = actor, name

    def options(self, **_: Any) -> _Method:
        return self

    def remote(self, *args: Any) -> _Ref:
        if self.actor.unknown:  # as Ray refuses to submit to an actor it does not know (e.g. after a restart)
            raise Exception(f"Can't find actor for {self.name}")  # noqa: TRY002 - Ray raises a plain Exception
        return self.actor.call(self.name, args)


class _Actor:
    """A ShardServer called in-process; ``die_after_appends`` kills it after that many appends, and
    ``fail_appends_after`` makes later appends fail as an unreadable argument does (the actor lives)."""

    def __init__(self) -> None:
        self.server = ShardServer()
        self.dead = False
        self.appends = 0
        self.die_after_appends: int | None = None
        self.fail_appends_after: int | None = None
        self.unknown = False

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("_"):
            raise AttributeError(name)
        return _Method(self, name)

    def call(self, name: str, args: tuple[Any, ...]) -> _Ref:
        if name == "append" and self.die_after_appends is not None and self.appends >= self.die_after_appends:
            self.dead = True
        if self.dead:
            return _Ref(error=RuntimeError("The actor died unexpectedly"), lost=True)
        if name == "append" and self.fail_appends_after is not None and self.appends >= self.fail_appends_after:
            return _Ref(error=RuntimeError("the batch's object could not be fetched"))
        vals = []
        for a in args:
            if isinstance(a, _Ref):
                if a.error is not None:
                    return _Ref(error=a.error, lost=a.lost)
                a = a.value
            vals.append(a)
        try:
            out = getattr(self.server, name)(*vals)
        except ConduitError as e:
            return _Ref(error=e)
        if name == "append":
            self.appends += 1
        return _Ref(out)


class _FakeRay:
    @staticmethod
    def put(x: Any) -> Any:
        return x

    @staticmethod
    def kill(actor: _Actor, no_restart: bool = True) -> None:
        actor.dead = True


def _wait_all(refs: Any, timeout: float) -> dict[Any, Outcome]:
    items = dict(refs) if isinstance(refs, dict) else dict(enumerate(refs))
    return {k: Outcome(r.value, r.error, r.lost) for k, r in items.items()}


def patch_ray(monkeypatch: pytest.MonkeyPatch, ray: Any) -> None:
    """Route a plane's Ray calls (and its servers' group's) to ``ray``, and its waits to :func:`_wait_all`, in every
    module that imported ``ray_module`` or ``wait_all`` by name (``ray_mod``'s own ``ray_module``: ``ray_is_up``)."""
    for mod in (plane_mod, checkpoint_mod, servers_mod, ray_mod):
        monkeypatch.setattr(mod, "ray_module", lambda **_: ray)
    for mod in (plane_mod, recovery_mod, checkpoint_mod):
        monkeypatch.setattr(mod, "wait_all", _wait_all)


@pytest.fixture
def fake_ray(monkeypatch: pytest.MonkeyPatch) -> Any:
    threads = torch.get_num_threads()
    patch_ray(monkeypatch, _FakeRay)
    yield _FakeRay
    torch.set_num_threads(threads)


def _servers(nodes: list[str]) -> ShardServers:
    group = object.__new__(ShardServers)
    group.servers = [ServerInfo(_Actor(), n, 0) for n in nodes]
    group._links = None
    group._torch = None
    return group


def _plane(nodes: list[str], schema: ExperienceSchema = ID_SCHEMA, **kw: Any) -> DistributedDataPlane:
    kw.setdefault("capacity", 100)
    return DistributedDataPlane(schema, servers=_servers(nodes), learner_node=nodes[0], measure=False,
                                health_period=None, transport="object_store", **kw)


def _ids(plane: DistributedDataPlane) -> list[int]:
    return sorted(check_payload(plane.read(plane.live_handles())).tolist())


RAGGED = ExperienceSchema(id=Field((), torch.int64), tok=Field((), torch.int64, ragged=True))


def _ragged_batch(ids: list[int], length: int) -> ExperienceBatch:
    n = len(ids)
    return ExperienceBatch({"id": torch.tensor(ids, dtype=torch.int64),
                            "tok": Ragged(torch.arange(n * length, dtype=torch.int64),
                                          torch.full((n,), length, dtype=torch.int64))}, n)


# -- the harness itself --------------------------------------------------------------------------------
def test_harness_round_trip_over_two_shards(fake_ray):
    p = _plane(["a", "b"], capacity=10)
    p.ingest(id_batch(np.arange(6)))
    p.ingest(id_batch(np.arange(6, 12)))  # evicts 0, 1
    assert _ids(p) == list(range(2, 12)) and len(p) == 10


# -- probes --------------------------------------------------------------------------------------------
def test_an_ingestion_every_shard_refuses_leaves_the_stored_items_readable(fake_ray):
    """A full buffer, then a batch no shard can take (its ragged field overflows every pool): the
    typed error must leave the buffer as it was. The shards used to release the items the
    ingestion would have evicted before refusing it, while the index still lists them, so every
    later read of those items failed ("the buffer's index and this shard disagree")."""
    p = _plane(["a", "b"], schema=RAGGED, capacity=4, ragged_capacity=8)
    p.ingest(_ragged_batch([0, 1, 2, 3], 1))
    with pytest.raises(ClusterError):
        p.ingest(_ragged_batch([4], 20))
    assert len(p) == 4 and p.index.oldest == 0
    got = p.read(p.live_handles())
    assert got.tensor("id").tolist() == [0, 1, 2, 3]


def test_a_shard_that_dies_between_two_writes_of_one_round_is_not_left_in_the_index(fake_ray):
    """Two producers' runs coalesced in one write both go to shard 0; it dies after storing the first.
    The first run must not be recorded on the dead shard (the buffer then read it from a shard it
    had fenced, forever: _fetch retried the dead shard without end). Its rows are stored elsewhere."""
    p = _plane(["a", "b"], capacity=100)
    producer = plane_mod._PRODUCER
    b = ExperienceBatch({**id_batch(np.arange(10)),
                         producer: torch.tensor([0] * 5 + [p._producer_id("a2")] * 5, dtype=torch.int32)}, 10)
    # both runs' producers rank shard 0 (node "a") first: "a2" is on no shard, so the learner's node wins
    p.servers[0].actor.die_after_appends = 1
    h = p.ingest_now(b)
    assert h.tolist() == list(range(10))
    assert not p._alive[0]
    rows = list(p.index.live_rows())
    assert not (p.index._shard[rows] == 0).any(), "a segment is recorded on the fenced shard"
    assert _ids(p) == list(range(10)) and not p.lost_items


def test_rows_stored_on_a_shard_lost_in_a_later_round_are_stored_again(fake_ray):
    """Round 1: run A goes to shard 0, run B to shard 1, which is lost. Round 2: B goes to shard 0, which
    dies at that write, taking A with it. A must not stay recorded on shard 0: both runs land on shard 2."""
    p = _plane(["a", "b", "c"], capacity=100)
    producer = plane_mod._PRODUCER
    b = ExperienceBatch({**id_batch(np.arange(10)),
                         producer: torch.tensor([0] * 5 + [p._producer_id("b")] * 5, dtype=torch.int32)}, 10)
    p.servers[1].actor.die_after_appends = 0
    p.servers[0].actor.die_after_appends = 1
    p.ingest_now(b)
    assert p.alive_shards == [2]
    rows = list(p.index.live_rows())
    assert (p.index._shard[rows][:, 0] == 2).all(), "a segment is recorded on a fenced shard"
    assert _ids(p) == list(range(10)) and not p.lost_items


def test_rows_replicated_after_an_ingestion_are_the_segments_it_added(fake_ray, monkeypatch):
    """Segments an ingestion adds with too few replicas get a copy right after: the rows named must be
    those segments even when adding the second one compacted the index's arrays."""
    p = _plane(["a", "b", "c"], capacity=8, replication=2)
    for i in range(63):  # one segment each, FIFO-evicted: the segment arrays fill with dead rows
        p.ingest(id_batch([i]))
    assert p.index._hi == p.index._first.shape[0] - 1
    seen: list[tuple[int, int]] = []

    def fake_store(payload, runs, row_bytes, oldest, copies=None, **_):
        return [(0, 1, [(0, 900)]), (1, 1, [(1, 900)])]  # two single-replica segments

    def record(rows):
        for r in rows:
            assert r in p.index.live_rows(), f"row {r} is not a live segment"
            seen.append(p.index.segment(r)[:2])
        return 0

    monkeypatch.setattr(p, "_store", fake_store)
    monkeypatch.setattr(p, "_replicate", record)
    h = p.ingest(id_batch([100, 101]))
    assert seen == [(int(h[0]), 1), (int(h[1]), 1)]


def test_loading_a_checkpoint_keeps_the_buffers_ragged_capacity(fake_ray):
    """The shards' partitions are reopened on load with the buffer's own ragged_capacity (they were
    reopened with the default, 64 x shard_capacity, so a checkpoint this buffer held no longer fit)."""
    p = _plane(["a", "b"], schema=RAGGED, capacity=4, ragged_capacity=1000)
    p.ingest(_ragged_batch([0, 1, 2, 3], 200))  # 800 elements > 64 * 4
    state = p.state_dict()
    p.load_state_dict(state)
    got = p.read(p.live_handles())
    assert got.tensor("id").tolist() == [0, 1, 2, 3] and got["tok"].lengths.tolist() == [200] * 4


def test_a_shard_found_dead_while_loading_reports_no_item_of_the_checkpoint_lost(fake_ray):
    """A shard found dead by the load's reopen held only the contents the load replaces: its report
    must not name handles that the loaded buffer then delivers."""
    p = _plane(["a", "b"], capacity=20)
    p.ingest(id_batch(np.arange(10)), node="b")  # on shard 1
    state = p.state_dict()
    p.servers[1].actor.dead = True
    p.load_state_dict(state)
    assert _ids(p) == list(range(10))
    assert len(p.losses) == 1 and p.losses[0].shard == 1
    live = set(p.live_handles().tolist())
    assert not live & set(p.losses[0].lost.tolist()), "the report names items that are delivered"


def test_a_read_from_a_shard_the_index_still_names_after_fencing_raises_instead_of_looping(fake_ray):
    """Should the index ever name a fenced shard, reading those items must end in a typed error."""
    from conduit.distributed.errors import DistributedError

    p = _plane(["a", "b"], capacity=20)
    p.ingest(id_batch(np.arange(5)), node="a")
    p.servers[0].actor.dead = True
    p._alive[0] = False  # fenced without the index being told: the state the bound guards against
    with pytest.raises(DistributedError, match="index names a lost shard"):
        p.read(p.live_handles())


# -- an ingestion that fails after some shards stored their rows ------------------------------------------
def _two_producer_batch(p: DistributedDataPlane, ids: list[int]) -> ExperienceBatch:
    """Rows of ``ids``: the first half produced on node "a" (shard 0), the rest on node "b" (shard 1)."""
    half = len(ids) // 2
    producer = torch.tensor([p._producer_id("a")] * half + [p._producer_id("b")] * (len(ids) - half),
                            dtype=torch.int32)
    return ExperienceBatch({**id_batch(np.asarray(ids)), plane_mod._PRODUCER: producer}, len(ids))


def test_a_failed_ingestion_leaves_no_row_on_the_shards_that_stored_theirs(fake_ray):
    """Shard 0 stores its run, shard 1 cannot read the batch: the typed error must leave no row of the
    batch on shard 0 (the index never names it: it only took the shard's space, for good)."""
    from conduit.distributed.errors import TransferError

    p = _plane(["a", "b"], capacity=100)
    p.ingest(id_batch(np.arange(4)), node="a")
    span = p.servers[0].actor.server.span(p.buffer_id)
    p.servers[1].actor.fail_appends_after = 0
    with pytest.raises(TransferError):
        p.ingest_now(_two_producer_batch(p, [10, 11, 12, 13]))
    assert p.servers[0].actor.server.span(p.buffer_id) == span, "shard 0 kept rows of the failed batch"
    assert p._local_next[0] == span[1]
    assert _ids(p) == [0, 1, 2, 3] and len(p) == 4
    p.servers[1].actor.fail_appends_after = None
    p.ingest_now(_two_producer_batch(p, [20, 21]))
    assert _ids(p) == [0, 1, 2, 3, 20, 21]


def test_a_failed_ingestion_into_a_full_buffer_evicts_what_the_shards_released_and_every_item_reads(fake_ray):
    """A full buffer: the failed ingestion's shard 0 released the 2 oldest items (its own) to make room
    and wrote over their slots. The index must evict them too (FIFO, the error says so): it used to
    keep listing them, and every later read of them failed ("the buffer's index and this shard disagree")."""
    from conduit.distributed.errors import TransferError

    p = _plane(["a", "b"], capacity=4, shard_capacity=2)
    p.ingest(id_batch([0, 1]), node="a")
    p.ingest(id_batch([2, 3]), node="b")
    p.servers[1].actor.fail_appends_after = 1
    with pytest.raises(TransferError) as err:
        p.ingest_now(_two_producer_batch(p, [10, 11, 12, 13]))
    assert any("4 oldest items" in n for n in getattr(err.value, "__notes__", [])), err.value
    assert p.index.oldest == 4 and len(p) == 0 and p.live_handles().size == 0
    p.servers[1].actor.fail_appends_after = None
    h = p.ingest_now(_two_producer_batch(p, [20, 21, 22, 23]))
    assert _ids(p) == [20, 21, 22, 23] and h.tolist() == [4, 5, 6, 7]
    batch, _ = p.deliver(64)
    assert set(check_payload(batch).tolist()) == {20, 21, 22, 23}


def test_a_failed_ingestion_that_evicts_keeps_the_rest_readable_with_priorities(fake_ray):
    """Prioritized: items the failed ingestion evicted leave the sum tree; the others keep being drawn."""
    from conduit.distributed.errors import TransferError
    from conduit.semantics.replay import PrioritizedSampler, Replay

    p = _plane(["a", "b"], capacity=4, shard_capacity=3, semantics=Replay(PrioritizedSampler(alpha=1.0), seed=0))
    p.ingest(id_batch([0, 1]), node="a")
    p.ingest(id_batch([2, 3]), node="b")
    p.servers[1].actor.fail_appends_after = 1  # shard 0 stores 10 (releasing 0 and 1), shard 1 fails on 11
    with pytest.raises(TransferError):
        p.ingest_now(_two_producer_batch(p, [10, 11]))
    assert p.index.oldest == 2
    live = _ids(p)
    assert live == [2, 3]
    batch, _ = p.deliver(200)
    assert set(check_payload(batch).tolist()) == set(live)


# -- checkpoint loads that cannot complete -------------------------------------------------------------------
def test_a_checkpoint_larger_than_the_live_shards_is_refused_before_anything_changes(fake_ray):
    """Ten items cannot fit the one live shard of five slots left: a typed error, and the buffer keeps its
    items (the shards used to be reopened first, so its contents were gone before the load failed)."""
    from conduit.errors import CapacityError

    p = _plane(["a", "b"], capacity=10, shard_capacity=5)
    p.ingest(id_batch(np.arange(10)))
    state = p.state_dict()
    p.servers[1].actor.dead = True
    p._lose(1, "test: actor died")
    kept = _ids(p)
    assert len(kept) == 5
    with pytest.raises(CapacityError, match="add shard servers or raise shard_capacity"):
        p.load_state_dict(state)
    assert _ids(p) == kept


def test_a_load_that_stops_part_way_marks_the_rest_of_the_checkpoint_lost_and_the_buffer_stays_usable(fake_ray):
    """The shard cannot read the checkpoint's rows: the old contents are gone already, so the buffer must
    describe the checkpoint with its missing items lost, not mix the old semantics (here: the old sum tree)
    with an index that holds nothing, where every draw failed."""
    from conduit.semantics.replay import PrioritizedSampler, Replay

    p = _plane(["a"], capacity=8, semantics=Replay(PrioritizedSampler(alpha=1.0), seed=0))
    p.ingest(id_batch(np.arange(6)))
    state = p.state_dict()
    p.ingest(id_batch([50, 51]))
    p.servers[0].actor.fail_appends_after = p.servers[0].actor.appends
    with pytest.raises(ClusterError, match="Loading stopped after 0 of the checkpoint's 6 items"):
        p.load_state_dict(state)
    assert len(p) == 0 and p.index.lost_in_window() == 6 and p.index.next_handle == 6
    p.servers[0].actor.fail_appends_after = None
    h = p.ingest(id_batch([70, 71]))
    assert h.tolist() == [6, 7] and _ids(p) == [70, 71]
    batch, _ = p.deliver(100)
    assert set(check_payload(batch).tolist()) == {70, 71}


def test_float_handles_in_a_priority_update_are_refused_and_change_nothing(fake_ray):
    """Swapped arguments (priorities where handles go) were cast to int64 and applied to other items."""
    from conduit.errors import PriorityError
    from conduit.semantics.replay import PrioritizedSampler, Replay

    p = _plane(["a"], capacity=8, semantics=Replay(PrioritizedSampler(alpha=1.0), seed=0))
    p.ingest(id_batch(np.arange(4)))
    leaves = p.semantics.sampler._tree.get(np.arange(4)).copy()
    with pytest.raises(PriorityError, match="Handles must be integers"):
        p.update_priorities(torch.tensor([2.5, 0.5]), torch.tensor([0, 1]))
    assert np.array_equal(p.semantics.sampler._tree.get(np.arange(4)), leaves)
    assert p.update_priorities(torch.tensor([0, 1]), torch.tensor([2.5, 0.5])) == 2


def test_a_closed_buffers_scheduler_serves_a_rebuilt_one_and_an_open_ones_does_not(fake_ray):
    """As for ExperienceDataPlane: one open buffer per scheduler, and a closed one frees it."""
    from conduit import Synchronous
    from conduit.errors import ConfigurationError

    sched = Synchronous()
    first = _plane(["a"], capacity=8, scheduler=sched)
    with pytest.raises(ConfigurationError, match="one scheduler per buffer"):
        _plane(["a"], capacity=8, scheduler=sched)
    first.close()
    second = _plane(["a"], capacity=8, scheduler=sched)
    second.ingest(id_batch(np.arange(3)))
    assert _ids(second) == [0, 1, 2]


def test_a_health_check_that_ray_refuses_to_submit_reports_the_shard_lost_typed(fake_ray):
    """check_health() raised Ray's raw submission error (an actor Ray no longer knows) instead of a loss."""
    p = _plane(["a", "b"], replication=1)
    p.ingest(id_batch(range(6)), node="b")
    p.servers[1].actor.unknown = True
    (report,) = p.check_health()
    assert report.shard == 1 and p.alive_shards == [0], f"shard 1 should be reported lost: {report}"
    assert p.check_health() == [], "a lost shard is not pinged again"
