"""Refused calls leave their state alone: the replay plug's staleness check in verl's ``sync`` mode, and a refused
epoch start of the verl loader order.

* ``ConduitReplayBuffer.sample`` in ``sync`` mode checked staleness only after verl's ``_materialize_batch`` had
  cleared the selected prompts from TransferQueue: a left-over group one step old (``max_off_policy_threshold=1``)
  raised after TransferQueue had changed, and raised under ``on_stale=drop`` too. Stale groups are now dropped (or
  refused) before selection; a drop that would leave too few groups for the batch raises, changing nothing, instead
  of waiting forever for a refill verl's sync trainer never sends.
* A refused epoch start of :class:`~conduit_verl.delivery.VerlOnPolicy` used up a pass of the loader: the retry
  delivered another order than a buffer never refused, and ``orders_drawn`` counted the refused pass.
* A process that died between the prepare and the commit of a put over several storage units left its reservation
  on the units for good (until a checkpoint restore): with ``max_items`` reached, every later put there was refused.
  A prepared put now holds a lease (a Ray object its process owns); a unit drops the reservation once Ray lost it.

The sampling tests run against a live TransferQueue with the Conduit backend (``tq_session``), as verl's trainer
leaves it: prompt keys tagged with their status and step, trajectory keys ``{uid}_0_0`` with their fields.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import TensorDict

sys.path.insert(0, str(Path(__file__).parent))
from test_put_all_or_nothing import _on_unit, _rows, _wire  # noqa: E402, I001  (keys routed to a unit; rows)

pytestmark = pytest.mark.requires("verl")

#: how long a sampling test waits for ``sample`` to return (a hang fails the test instead of blocking it)
WAIT_S = 120.0


# -- verl's sync sampling, on a live TransferQueue -----------------------------------------------------------
def _groups(groups: dict[str, tuple[str, int]], partition: str = "train") -> None:
    """Register GRPO groups in ``partition`` as verl's trainer and agent loop do: ``uid -> (status, global_steps)``; a
    finished or failed group gets one trajectory ``{uid}_0_0`` with a field."""
    import transfer_queue as tq

    uids = list(groups)
    tq.kv_batch_put(keys=uids, partition_id=partition,
                    tags=[{"is_prompt": True, "status": st, "global_steps": step} for st, step in groups.values()])
    done = [u for u in uids if groups[u][0] in ("finished", "failure")]
    if done:
        fields = TensorDict({"responses": torch.arange(len(done) * 3, dtype=torch.int64).reshape(len(done), 3)},
                            batch_size=[len(done)])
        tq.kv_batch_put(keys=[f"{u}_0_0" for u in done], partition_id=partition, fields=fields,
                        tags=[{"status": "success", "global_steps": groups[u][1]} for u in done])


def _listing(partition: str = "train") -> dict[str, dict[str, Any]]:
    import transfer_queue as tq

    return {k: dict(v) for k, v in (tq.kv_list(partition) or {}).get(partition, {}).items()}


def _buffer(on_stale: str, cls: Any = None, threshold: int = 1) -> Any:
    from conduit_verl.replay import ConduitReplayBuffer

    return (cls or ConduitReplayBuffer)(trainer_mode="sync", trainer_config={}, max_off_policy_threshold=threshold,
                                        max_off_policy_strategy="drop", sampler_kwargs={"on_stale": on_stale},
                                        poll_interval=0.05)


def _sample(buf: Any, global_steps: int, batch_size: int, partition: str = "train") -> tuple[Any, BaseException | None]:
    """``buf.sample`` of ``partition`` in a thread: (its result, its error); fails the test if it does not return."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = buf.sample(global_steps, partition, batch_size)
        except BaseException as e:  # noqa: BLE001  (the test inspects it)
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(WAIT_S)
    assert not t.is_alive(), f"sample() did not return within {WAIT_S}s (it waits for groups that never come)"
    return out.get("result"), out.get("error")


def _live_tq(tq_session: Callable[..., Any]) -> None:
    import verl  # noqa: F401  (verl loads its plugins: conduit-verl registers the "Conduit" backend)

    tq_session("Conduit", num_units=1, capacity=8, mean_length=4)


class TestSyncSampling:
    """The sampling tests share one live TransferQueue (``tq_shared``, ``_live_tq``'s configuration); each registers
    its groups in a partition of its own. (verl prefixes its own metrics of a partition other than ``train`` with
    ``validation/``; these tests check Conduit's ``conduit/...`` metrics, whose names do not depend on it.)"""

    TQ_BACKEND = ("Conduit", {"num_units": 1, "capacity": 8, "mean_length": 4})

    @pytest.mark.slow
    def test_sync_raise_refuses_a_left_over_stale_group_before_transfer_queue_changes(self, tq_shared: Any) -> None:
        """A group of step 1 left unsampled is stale at step 2 with threshold 1 (verl's sync sampling selects the oldest
        first). on_stale=raise must raise StaleExperienceError with TransferQueue as it was; it used to raise after
        verl had cleared the selected prompt, so the group was gone from the listing."""
        from conduit import StaleExperienceError

        part = tq_shared("train")  # this test's partition
        _groups({"old": ("finished", 1), "new": ("finished", 2)}, part)
        before = _listing(part)
        _, err = _sample(_buffer("raise"), 2, 1, part)
        assert isinstance(err, StaleExperienceError), f"a stale group under on_stale=raise was not refused: {err!r}"
        assert _listing(part) == before, f"the refused sample changed TransferQueue ({err})"
        assert "1 policy versions behind step 2" in str(err) and "on_stale=drop" in str(err), f"says not what: {err}"

    @pytest.mark.slow
    def test_sync_drop_drops_the_stale_group_and_samples_a_fresh_one(self, tq_shared: Any) -> None:
        """Under on_stale=drop the stale left-over group is dropped (cleared, counted) and the batch is the fresh group;
        it used to raise StaleExperienceError after clearing the stale group's prompt."""
        part = tq_shared("train")  # this test's partition
        _groups({"old": ("finished", 1), "new": ("finished", 2)}, part)
        buf = _buffer("drop")
        result, err = _sample(buf, 2, 1, part)
        assert err is None, f"on_stale=drop raised instead of dropping: {err!r}"
        batch, metrics = result
        assert list(batch.keys) == ["new_0_0"], f"sampled {batch.keys}, want the fresh group's trajectory"
        assert buf.stale_groups == 1 and metrics["conduit/stale_groups/sum"] == 1
        assert metrics["conduit/staleness/max"] == 0
        assert sorted(_listing(part)) == ["new_0_0"], f"left in TransferQueue: {sorted(_listing(part))}"

    @pytest.mark.slow
    def test_sync_drop_leaving_too_few_groups_raises_instead_of_waiting(self, tq_shared: Any) -> None:
        """Dropping the stale group would leave one fresh group for a batch of two, and verl's sync trainer refills
        nothing dropped: sample must raise a typed error that says what to do, dropping nothing (not wait forever, and
        not raise after clearing)."""
        from conduit import StaleExperienceError

        part = tq_shared("train")  # this test's partition
        _groups({"old": ("finished", 1), "new": ("finished", 2)}, part)
        before = _listing(part)
        buf = _buffer("drop")
        _, err = _sample(buf, 2, 2, part)
        assert isinstance(err, StaleExperienceError), f"want StaleExperienceError, got {err!r}"
        assert _listing(part) == before, f"the refused sample changed TransferQueue ({err})"
        msg = str(err)
        assert "leaving 1 fresh group(s)" in msg and "batch of 2" in msg and "max_off_policy_threshold" in msg, msg
        assert buf.stale_groups == 0, "a refused drop was counted"

    @pytest.mark.slow
    def test_sync_drop_waits_for_a_fresh_group_still_generating(self, tq_shared: Any) -> None:
        """A fresh group still running counts toward the batch: the stale group is dropped and sampling waits for the
        running one (here the rollout finishes it at the first poll), instead of refusing."""
        import transfer_queue as tq
        from conduit_verl.replay import ConduitReplayBuffer

        part = tq_shared("train")  # this test's partition
        _groups({"old": ("finished", 1), "new": ("running", 2)}, part)

        class RolloutFinishesAtFirstPoll(ConduitReplayBuffer):
            """The agent loop's part, played between two polls: the running group finishes."""

            polls = 0

            def _wait_for_next_poll(self, partition_id: str, last_debug_time: float) -> float:
                self.polls += 1
                if self.polls == 1:
                    _groups({"new": ("finished", 2)}, part)
                return float(super()._wait_for_next_poll(partition_id, last_debug_time))

        buf = _buffer("drop", RolloutFinishesAtFirstPoll)
        result, err = _sample(buf, 2, 1, part)
        assert err is None, f"a fresh group was still generating, yet the sample was refused: {err!r}"
        assert list(result[0].keys) == ["new_0_0"] and buf.polls >= 1 and buf.stale_groups == 1
        assert "old" not in (tq.kv_list(part) or {}).get(part, {})


# -- a refused epoch start gives its loader pass back ----------------------------------------------------------
def _plane(refuse: dict[str, bool], seed: int | None) -> Any:
    """Two epochs over a 6-item rollout, in verl's loader order (shuffled); ``refuse["now"]`` makes the next epoch
    start refused (an adapter's ``epoch_sizes`` saying no, as core allows)."""
    from conduit import ConfigurationError, ExperienceDataPlane
    from conduit.testing.reference import ID_SCHEMA, id_batch
    from conduit_verl.delivery import VerlOnPolicy

    class Refusing(VerlOnPolicy):
        def epoch_sizes(self, n: int, epoch: int) -> list[int]:
            if refuse["now"]:
                raise ConfigurationError("refused for the test")
            return super().epoch_sizes(n, epoch)

    sem = Refusing(num_minibatches=2, num_epochs=3, seed=seed, dataloader_kwargs={"shuffle": True})
    edp = ExperienceDataPlane(ID_SCHEMA, capacity=16, semantics=sem)
    edp.ingest(id_batch(torch.arange(6).numpy()), version=0)
    edp.seal()
    return edp


@pytest.mark.parametrize("seed", [7, None], ids=["seeded", "unseeded"])
def test_a_refused_epoch_start_leaves_the_loader_where_it_was(seed: int | None) -> None:
    """Epoch 1's start is refused once, then allowed: every minibatch, the saved ``orders_drawn`` and the global RNG
    must be what a buffer never refused gives (the refused start used to draw a pass, so epoch 1 got the loader's
    third pass and ``orders_drawn`` counted one more)."""
    from conduit import ConfigurationError

    def run(refuse_once: bool) -> tuple[list[list[int]], list[int], torch.Tensor]:
        torch.manual_seed(11)
        refuse = {"now": False}
        edp = _plane(refuse, seed)
        got: list[list[int]] = []
        drawn: list[int] = []  # orders_drawn after each delivery, and after the refusal
        refused = 0
        while len(got) < 6:
            try:
                got.append(edp.deliver()[0]["id"].tolist())
            except ConfigurationError as e:  # only epoch 1's start (seeded: selecting minibatch 1; unseeded:
                assert "refused for the test" in str(e)  # deferred to epoch 1's first delivery)
                refused += 1
                refuse["now"] = False
            else:
                torch.rand(3)  # training draws from the global RNG between minibatches
            drawn.append(edp.state_dict()["semantics"]["orders_drawn"])
            refuse["now"] = refuse_once and len(got) >= 1 and not refused
        assert refused == int(refuse_once)
        return got, drawn, torch.get_rng_state()

    ref, ref_drawn, ref_rng = run(False)
    got, got_drawn, got_rng = run(True)
    assert got == ref, f"after a refused epoch start the minibatches differ:\n got {got}\n ref {ref}"
    assert torch.equal(got_rng, ref_rng), "the refused start left the global RNG elsewhere"
    assert max(got_drawn) == max(ref_drawn) == 3, f"orders_drawn counted the refused pass: {got_drawn} vs {ref_drawn}"
    assert sorted(set(got_drawn)) == sorted(set(ref_drawn)), f"orders_drawn: {got_drawn} vs {ref_drawn}"


# -- a put's reservation goes with the process that made it ---------------------------------------------------
@pytest.mark.slow
def test_a_reservation_of_a_process_that_died_before_committing_is_freed(tq_session: Any, tmp_path: Path) -> None:
    """A client process (a Ray actor) puts a sample to unit 1 of two (``max_items=1``); unit 0, busy reading a
    checkpoint from a pipe, holds the put between its prepare on unit 1 and its commit. The client is killed there.
    Unit 1 used to keep the dead put's reservation for good, refusing every later put (CapacityError); now such a
    put stores once Ray reports the client's lease lost (within seconds; each refused try changes nothing)."""
    import asyncio

    import ray
    import transfer_queue as tq
    import verl  # noqa: F401  (verl loads its plugins: conduit-verl registers the "Conduit" backend)
    from conduit import CapacityError
    from conduit_verl.packing import objects_from_wire

    tq_session("Conduit", num_units=2, capacity=2, mean_length=2, max_items=1)
    client = tq.get_client()
    manager = client.storage_manager
    dead_meta, live_meta = _on_unit(client, "lease", "dead", 1), _on_unit(client, "lease", "live", 1)

    pipe = tmp_path / "unit0.pt"
    os.mkfifo(pipe)
    busy = manager.units[0].load.remote(str(pipe))  # unit 0 waits in open() for a writer of the pipe
    probe = manager.units[0].stats.remote()  # runs after the load (one caller's calls run in order)
    assert not ray.wait([probe], timeout=2.0)[0], "unit 0 is not held by the pipe"
    deadline = time.monotonic() + WAIT_S

    @ray.remote(num_cpus=0)
    class Putter:
        def put(self, meta: Any, value: float, uid: str) -> None:
            """A put as ``_rows([value], [uid])`` builds it (this runs in another process: no test helpers)."""
            import asyncio

            import torch as t
            import transfer_queue as here
            import verl as plugins  # noqa: F401  (registers the "Conduit" backend in this process)
            from tensordict import NonTensorStack as Stack
            from tensordict import TensorDict as TD

            here.init()  # attaches to the running TransferQueue
            rows = TD({"r": t.full((1, 2), value), "uid": Stack(uid)}, batch_size=[1])
            asyncio.run(here.get_client().storage_manager.put_data(rows, meta))

    putter = Putter.remote()  # type: ignore[attr-defined]  # (ray.remote's class has .remote)
    try:
        putter.put.remote(dead_meta, 1.0, "dead")
        while ray.get(manager.units[1].stats.remote())["prepared_puts"] != 1:
            assert time.monotonic() < deadline, "the client's put never got prepared on unit 1"
            time.sleep(0.05)
        ray.kill(putter, no_restart=True)  # dies between prepare (unit 1) and commit
    finally:
        os.close(os.open(pipe, os.O_WRONLY))  # unit 0 opens the pipe: not a checkpoint, its load fails and it goes on
    with pytest.raises(Exception):  # noqa: B017  (what torch raises for a pipe; unit 0 keeps its state)
        ray.get(busy, timeout=WAIT_S)
    ray.get(probe, timeout=WAIT_S)

    tries = 0
    while True:
        tries += 1
        try:
            asyncio.run(manager.put_data(_rows([2.0], ["live"]), live_meta))
            break
        except CapacityError as e:
            assert "reserved by puts in flight" in str(e), f"refused for another reason: {e}"
            assert time.monotonic() < deadline, (f"the dead client's reservation on unit 1 was never freed "
                                                 f"({tries} puts refused): {e}")
            time.sleep(0.5)
    assert ray.get(manager.units[1].stats.remote())["prepared_puts"] == 0
    gi = int(live_meta.global_indexes[0])
    got = objects_from_wire(ray.get(manager.units[1].get.remote([gi], ["uid"])))
    assert got == {"uid": ["live"]}, "the put did not store"


def test_a_reservation_of_a_live_process_stays(ray_local: Path) -> None:
    """The lease of a process that is alive (this one) keeps its reservation: a put that would not fit beside it is
    refused, however long it waits; an abort frees the room."""
    import ray
    from conduit import CapacityError
    from conduit_verl.tq_storage import DEFAULTS
    from conduit_verl.unit import _UnitState

    unit = _UnitState(dict(DEFAULTS, capacity=2, mean_length=2, max_items=1, num_units=2))
    lease = ray.put("p")
    unit.prepare("p", [1], _wire([1.0]), lease)
    time.sleep(2.0)
    for _ in range(2):
        with pytest.raises(CapacityError, match="1 reserved by puts in flight"):
            unit.prepare("q", [3], _wire([2.0]), ray.put("q"))
        assert sorted(unit.pending) == ["p"]
    unit.abort("p")
    unit.put([3], _wire([2.0]))
    assert sorted(unit.objects["uid"]) == [3]
