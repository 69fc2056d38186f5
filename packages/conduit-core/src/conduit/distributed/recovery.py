"""Shard faults of a :class:`~conduit.distributed.DistributedDataPlane`: finding them, fencing the lost shard,
accounting its items exactly (lost or recovered), and restoring replication.

These are the plane's own steps, kept here so the plane's module holds ingestion and delivery: each function takes
the plane and works on its index, servers and lock as a method would. The plane calls them through its methods
(``check_health``, ``_settle``, ``_lose``, ``_replicate``), and they call each other through those methods too, so
a plane's step can be wrapped on the instance.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Collection
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from conduit.distributed._ray import Outcome, ray_is_up, wait_all
from conduit.distributed.faults import LossReport
from conduit.distributed.server import ping, tick
from conduit.semantics.base import Semantics

if TYPE_CHECKING:
    from conduit.distributed.plane import DistributedDataPlane

__all__ = ["COPY_ROUNDS", "check_health", "forget_lost_priorities", "failure", "lose", "replicate", "settle",
           "stuck_data_threads"]

log = logging.getLogger("conduit.distributed")

#: terminal colour codes (Ray colours the headers of its task errors)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")

#: rounds of re-replication copies in one call (the first and its retries): a copy that fails while its source
#: lives is sent again to another target, so one stuck or refusing target does not leave a segment short. Each
#: round waits at most ``timeout`` for its copies, then probes the shards of copies whose outcome is unknown (at
#: most ``timeout``; after the last round only when no health monitor runs): one lost shard's re-replication holds
#: the caller at most ``2 * COPY_ROUNDS * timeout`` (see :func:`replicate`), and then gives up
COPY_ROUNDS = 3


def check_health(plane: DistributedDataPlane) -> list[LossReport]:
    """:meth:`DistributedDataPlane.check_health`: one ping of every live shard, each that did not answer lost; then
    each that answered but whose data thread is stuck (see :func:`stuck_data_threads`) lost too."""
    live = plane.alive_shards
    if plane._closed or not live:
        return []
    outs = ping_shards(plane, live)
    found: list[LossReport] = []
    if plane._closed or not ray_is_up():
        # close() ran while the pings were out: it stopped the shards, nothing was lost; or Ray was shut down
        # meanwhile: the pings' failures say nothing about the shards (and losing them would call Ray again)
        return found
    for s, o in outs.items():
        if o.lost:
            plane._lose(s, failure(o), found=found)
    for s, waited in stuck_data_threads(plane, [s for s, o in outs.items() if o.ok]):
        plane._lose(s, f"its data thread ran nothing for {waited:.0f} s (stuck_after={plane.stuck_after:g} s) "
                       f"while it answered health checks: a data call there never returned", found=found)
    return found


def stuck_data_threads(plane: DistributedDataPlane, shards: Collection[int]) -> list[tuple[int, float]]:
    """Probe the data thread of each of ``shards`` (alive: their pings answered); returns (shard, seconds waited) for
    each whose probe has waited ``plane.stuck_after`` seconds or more.

    The probe is a no-op call on the server's data thread (:func:`~conduit.distributed.server.tick`): it runs once
    the data calls queued before it did. One is kept per shard: a shard whose probe answered gets a new one, one whose
    probe still waits keeps it, and this only reads how long it has waited (it never waits itself).
    """
    now = time.monotonic()
    # (read once: a check on another thread may replace or drop an entry meanwhile)
    waiting = {s: sent for s in shards if (sent := plane._ticks.get(s)) is not None}
    outs = wait_all({s: ref for s, (ref, _) in waiting.items()}, 0.0)  # (a probe not answered yet: a TimeoutError)
    stuck = []
    for s in shards:
        if s in outs and outs[s].lost and isinstance(outs[s].error, TimeoutError):
            if now - waiting[s][1] >= plane.stuck_after:
                stuck.append((s, now - waiting[s][1]))
            continue
        try:
            plane._ticks[s] = (tick(plane.servers[s].actor), now)
        except Exception:  # noqa: BLE001 - a server Ray cannot reach is the pings' to find (the next check)
            plane._ticks.pop(s, None)
    return stuck


def ping_shards(plane: DistributedDataPlane, shards: Collection[int]) -> dict[int, Outcome]:
    """Ping ``shards`` at once, at most ``timeout`` seconds in all.

    A ping Ray refuses to send (the server's actor is unknown to it, e.g. after Ray was restarted under the
    buffer) is an answer of a lost server. A ping Ray answers with ``ActorUnavailableError`` (the actor is
    unreachable for now, which proves no death) is sent again, after a short pause, until it gets another
    answer or the ``timeout`` is spent: a passing fault is not a loss, and a server that stays unreachable
    is still found lost within ``timeout``.
    """
    deadline = time.monotonic() + plane.timeout
    out: dict[int, Outcome] = {}
    todo, pause = list(shards), 0.05
    while True:
        refs = {}
        for s in todo:
            try:
                refs[s] = ping(plane.servers[s].actor)
            except Exception as e:  # noqa: BLE001 - classified: the actor cannot be reached
                out[s] = Outcome(error=e, lost=True)
        got = wait_all(refs, max(0.0, deadline - time.monotonic()))
        out.update(got)
        todo = [s for s, o in got.items() if o.unconfirmed and not isinstance(o.error, TimeoutError)]
        left = deadline - time.monotonic()
        if not todo or left <= 0:
            return out
        time.sleep(min(pause, left))
        pause = min(2 * pause, 0.5)


def settle(plane: DistributedDataPlane, failed: dict[int, Outcome]) -> set[int]:
    """Decide which shards whose call failed are lost; returns those found alive (their call is stuck).

    A shard whose actor or node died is lost. A shard whose call only timed out, or that Ray
    reported unavailable for now (``ActorUnavailableError``), is pinged (health checks run on
    their own thread there, see :func:`ping_shards`): no answer within ``timeout`` makes it lost; an
    answer means it lives and the call itself is stuck (or failed in passing).
    """
    probe = set()
    for s, o in failed.items():
        if not plane._alive[s]:
            continue
        if o.unconfirmed:
            probe.add(s)
        else:
            plane._lose(s, failure(o))
    if not probe:
        return set()
    answers = ping_shards(plane, probe)
    stuck = set()
    for s, a in answers.items():
        if a.ok:
            stuck.add(s)
        else:
            plane._lose(s, failure(a))
    return stuck


def lose(plane: DistributedDataPlane, shard: int, reason: str, *,
         found: list[LossReport] | None = None) -> LossReport | None:
    """Declare ``shard`` lost: fence it, account its items, restore replication where possible.

    ``found`` gets every report this recorded: this shard's, and those of shards the re-replication of its
    items found lost (their copies failed).

    Once the plane's ``close()`` marked the buffer closed (under this lock) this does nothing: a health check that was
    under way then (its pings out, or past its own "closed?" check) reports no loss for shards close() stops.

    Runs in the calling thread (the call that met the failure, ``check_health``, or the health monitor's thread)
    under the plane's lock, re-replication included: the plane's other calls (``ingest``, ``deliver``, ``read``...)
    wait for it, at most the bound :func:`replicate` states, for this shard and for each shard the copies find lost.
    """
    with plane._lock:
        if plane._closed or not plane._alive[shard]:
            return None
        before = len(plane.losses)
        plane._alive[shard] = False
        plane._ticks.pop(shard, None)
        plane.servers.kill(shard)
        lost, recovered, under = plane.index.drop_shard(shard)
        if lost.size and plane._replay and getattr(plane.semantics.sampler, "prioritized", False):  # type: ignore[attr-defined]
            _zero_priorities(plane.semantics, lost, plane.capacity)
        evicting = plane._evicting is not None
        keep = max(plane.index.oldest, cast(int, plane._evicting)) if evicting else plane.index.oldest
        gone = lost[lost < keep]
        if gone.size:  # the write under way evicts these (unless it fails and evicts nothing)
            lost = lost[lost >= keep]
        # so are the oldest items of segments with a replica elsewhere: neither lost nor recovered
        spared = [(r, plane.index.segment(r)[1] - max(0, plane.index.segment(r, keep)[1])) for r in under]
        spared = [(r, k) for r, k in spared if k > 0]
        recovered -= sum(k for _, k in spared)
        copied = plane._replicate(under) if under else 0
        if len(plane.losses) > before:
            # the copies found the other replica of some segments lost too: that loss reports their items
            # lost, so they are not recovered here (each item counted once, lost or recovered)
            recovered = sum(c for _, c, reps in (plane.index.segment(r, keep) for r in under) if c > 0 and reps)
        report = LossReport(shard, plane.shard_node(shard), reason, time.time(), lost, recovered, copied)
        plane.losses.append(report)
        if evicting or plane._held_losses:  # held until the write ends (see the plane's _release_losses), in order
            plane._held_losses.append((len(plane.losses) - 1, gone, spared))
        else:  # on_loss runs once this thread's outermost hold of the lock ends
            plane._callbacks.add(report)
        if found is not None:  # (under the lock: every report since ``before`` was recorded by this call)
            found.extend(plane.losses[before:])
    log.warning("conduit: %s", report)
    return report


def replicate(plane: DistributedDataPlane, rows: list[int]) -> int:
    """Give under-replicated segments the copies they lack, each on another live node; returns items copied.

    A copy that fails while its source lives (its target refused it, died, or answered a health probe but
    did not store the copy within ``timeout``) is sent again to another target, in at most
    :data:`COPY_ROUNDS` rounds in all; a target whose copy failed gets no more copies in this call (a late
    copy there is discarded, see :func:`_discard_late`). A copy whose rows were lost after its source read them
    (Ray's ``ObjectLostError``: the source's node died before the target fetched them) does not count against its
    target, which stays a candidate for every copy; its source is probed instead. Before a retry, the shards of
    copies whose outcome is unknown (timed out, or Ray reported the shard unavailable) are probed (at most
    ``timeout``), so a retry never waits on a source found dead; and a target of such copies that answered the
    probe, while the probe found every source it waited for lost (dead, though Ray had not reported it when the
    copy timed out), never had the rows to store: it is a candidate again for the next rounds (a target whose
    copy failed otherwise in the call, or that waited for a source that lives, stays skipped). A segment
    still short of ``replication`` copies afterwards (no room on another node, or every copy failed) counts
    its items in the plane's ``under_replicated``; one whose source (or another replica) was lost meanwhile is
    accounted by that loss instead, and so is one whose copy landed on a target lost later in this call (that
    loss copies it again or counts it; the items returned leave it out). During a write (a shard lost while an
    ingestion stores its batch) only the items the write keeps are copied, into the room its evictions free:
    the oldest items it evicts are not (a segment it evicts whole is kept aside, and copied only if the write
    fails and evicts nothing).

    Bound: this runs on the caller's thread, under the plane's lock (nothing is copied in the background), and
    waits at most ``COPY_ROUNDS * timeout`` for copies plus ``COPY_ROUNDS * timeout`` for probes (``(COPY_ROUNDS -
    1) * timeout`` with a health monitor running): ``6 * timeout`` (``5 * timeout``) at the default 3 rounds. A shard
    found lost meanwhile (a copy's source or target died) is fenced at once, and its own re-replication adds its own
    bound. Then it gives up: a segment still short stays readable from the copies it has, is counted in the plane's
    ``under_replicated`` and left out of the count returned (the loss report's ``re_replicated``); nothing copies it
    later.
    """
    if plane.replication < 2:
        return 0
    oldest = plane.index.oldest if plane._evicting is None else max(plane.index.oldest, plane._evicting)
    #: the shards holding each segment (now, and the targets its copies land on): a segment one of them is lost
    #: from is that loss's to account
    held = {row: {s for s, _ in plane.index.segment(row, oldest)[2]} for row in rows}
    copied: dict[int, int] = {}  # rows that got a copy -> their items
    avoid: set[int] = set()  # targets whose copy failed in this call
    waited: dict[int, set[int]] = {}  # targets in ``avoid`` only because copies timed out -> those copies' sources
    todo = list(held)
    for attempt in range(COPY_ROUNDS):
        retry, unsure = _copy_round(plane, todo, oldest, held, avoid, waited, copied)
        last = attempt == COPY_ROUNDS - 1 or not retry
        if unsure and (not last or plane._monitor is None):
            # probe now (at most ``timeout``): before a retry, so it does not wait on a dead source; and
            # when no health monitor will look at them, so a shard that stays unreachable is found lost
            # here (its segments accounted again by its loss), not never
            plane._settle(unsure)
            # a target that answered the probe and whose failed copies only waited for sources found lost did
            # nothing wrong (the rows it waited for never came): a candidate again
            for t in [t for t, srcs in waited.items() if plane._alive[t] and not any(plane._alive[s] for s in srcs)]:
                avoid.discard(t)
                del waited[t]
        if last:
            break
        todo = retry
    short = 0
    for row, shards in held.items():
        _, count, reps = plane.index.segment(row, oldest)
        if count > 0 and reps and len(reps) < plane.replication and all(plane._alive[s] for s in shards):
            short += count
    plane.under_replicated += short
    return sum(count for row, count in copied.items() if all(plane._alive[s] for s in held[row]))


def _copy_round(plane: DistributedDataPlane, rows: list[int], oldest: int, held: dict[int, set[int]], avoid: set[int],
                waited: dict[int, set[int]], copied: dict[int, int]) -> tuple[list[int], dict[int, Outcome]]:
    """One round of :func:`replicate`: copy each short segment of ``rows`` to targets not in ``avoid``.

    Records the copies that landed (in the index, ``copied`` and ``held``), all of them before any failed copy
    is settled: a target (or source) found lost by a failure then has its landed copies in the index, so its
    loss accounts them (the index never names a replica on a lost shard). Adds the targets whose copy failed to
    ``avoid``; those whose every failed copy of the round timed out (or was unavailable) also to ``waited``, with
    the sources of those copies (:func:`replicate` puts them back as candidates once those sources are found
    lost). Returns the rows to copy again (their source lives) and the outcomes of copies whose outcome is
    unknown, by shard (source and target), to probe.
    """
    rooms = {s: plane._room(s, oldest) for s in plane.alive_shards if s not in avoid}
    jobs: dict[tuple[int, int], tuple[int, int, int]] = {}
    calls: dict[tuple[int, int], Any] = {}
    for row in rows:
        if not all(plane._alive[s] for s in held[row]):
            continue  # the loss of one of its shards accounted it again
        first, count, reps = plane.index.segment(row, oldest)
        if reps and len(reps) < plane.replication and count <= 0 < plane.index.segment(row)[1]:
            plane._short_evicted.append(row)  # evicted by the write under way (unless it fails)
            continue
        if count <= 0 or not reps or len(reps) >= plane.replication:
            continue
        # as many copies as the segment lacks (a write that lost several shards leaves it more than one short),
        # each on another node
        used = {plane.shard_node(s) for s, _ in reps}
        src, src_local = reps[0]
        targets: list[int] = []
        for s in plane.plan.order(plane.shard_node(src), count * plane.schema.fixed_item_bytes, list(rooms)):
            if len(reps) + len(targets) < plane.replication and plane.shard_node(s) not in used \
                    and rooms[s][0] >= count:
                targets.append(s)
                used.add(plane.shard_node(s))
        if not targets:
            continue
        data = plane.servers[src].actor.gather.remote(plane.buffer_id, np.arange(src_local, src_local + count))
        for t in targets:
            rooms[t] = (rooms[t][0] - count, rooms[t][1])
            calls[(row, t)] = plane.servers[t].actor.append.remote(plane.buffer_id, data, 0, count, rooms[t][1])
            jobs[(row, t)] = (count, first, src)
    outs = wait_all(calls, plane.timeout)
    late: set[int] = set()  # targets of copies whose outcome is unknown (they may still run)
    unsure: dict[int, Outcome] = {}  # their sources and targets
    waits: dict[int, set[int]] = {}  # targets of those copies -> their sources
    blamed: set[int] = set()  # targets whose copy failed otherwise (refused, or the target died)
    retry: list[int] = []
    for (row, t), o in outs.items():
        # first every copy that landed (no loss is settled before: each target here is alive)
        if o.ok and plane._alive[t]:
            count, first, _ = jobs[(row, t)]
            plane._local_next[t] = max(plane._local_next[t], int(o.value[2]))
            seg_first, _ = plane.index.segment_span(row)
            plane.index.add_replica(row, t, int(o.value[0]) - (first - seg_first))
            copied[row] = count
            held[row].add(t)
    for (row, t), o in outs.items():
        if o.ok:
            continue
        count, first, src = jobs[(row, t)]
        if o.lost and not o.unconfirmed:
            # a two-hop copy: the error names the actor that died (source or target); a timeout or a
            # passing unavailability is settled by a probe (see replicate) or by the health monitor
            dead = getattr(o.error, "actor_id", None)
            if dead == _actor_hex(plane.servers[src].actor):
                # the source's loss accounts the segment again (copied from another replica, or lost)
                plane._lose(src, failure(o))
                continue
            plane._lose(t, failure(o))
        elif o.lost:
            late.add(t)
            unsure[src] = unsure[t] = o
            waits.setdefault(t, set()).add(src)
            avoid.add(t)
            retry.append(row)
            continue
        elif o.argument_lost:
            # the rows the source read were lost before the target fetched them (the source's node died after
            # the read): the target did nothing wrong and stays a candidate; the source is probed before a retry
            unsure.setdefault(src, Outcome(error=TimeoutError(f"the rows it read for a copy were lost before "
                                                              f"the copy's target had them ({failure(o)})"),
                                           lost=True))
            retry.append(row)
            continue
        blamed.add(t)
        avoid.add(t)
        retry.append(row)
    for t, srcs in waits.items():
        if t not in blamed:
            waited.setdefault(t, set()).update(srcs)
    for t in blamed:
        waited.pop(t, None)
    _discard_late(plane, late)
    return list(dict.fromkeys(retry)), unsure


def _discard_late(plane: DistributedDataPlane, shards: Collection[int]) -> None:
    """Make appends whose outcome is unknown (timed out, or Ray reported the shard unavailable) harmless.

    Such an append may still run, and store rows the index does not know. A shard runs data calls one at
    a time in submission order, so a truncate sent now runs right after it, before any later call: it
    forgets whatever the late append stored (rows from ``_local_next`` on, which no segment names). Not
    waited for (it queues behind the stuck call); the shard's next answer tells its next handle. During a
    write, the shard is also marked doubtful: the late append may have released the items the write
    evicts, so a write that then fails counts them evicted (the plane's ``_undo_store``).
    """
    for t in shards:
        if not plane._alive[t]:
            continue
        if plane._evicting is not None:
            plane._doubtful.add(t)
        try:
            plane.servers[t].actor.truncate.remote(plane.buffer_id, max(plane._local_next[t], plane.index.held_end(t)))
        except Exception:  # noqa: BLE001 - Ray cannot reach the shard: the health checks will find it lost
            log.debug("conduit: discarding a late copy on shard %d failed", t, exc_info=True)


def forget_lost_priorities(plane: DistributedDataPlane) -> None:
    """Give every lost item in the window priority 0 (prioritized replay), as :func:`lose` does."""
    if plane._replay and getattr(plane.semantics.sampler, "prioritized", False) and plane.index.lost_in_window():  # type: ignore[attr-defined]
        h = np.arange(plane.index.oldest, plane.index.next_handle, dtype=np.int64)
        _zero_priorities(plane.semantics, h[plane.index.lost_mask(h)], plane.capacity)


def failure(o: Outcome) -> str:
    """What failed, in one line, for a loss report.

    A Ray task error is described by its cause: its own first line is a coloured header naming the process the
    task ran in (for a copy, the target's, whichever shard died).
    """
    e = o.error
    cause = getattr(e, "cause", None)
    if isinstance(cause, BaseException):
        e = cause
    if isinstance(e, TimeoutError):
        return f"no answer: {e}"
    text = _ANSI.sub("", str(e)).strip()
    first = text.splitlines()[0] if text else type(e).__name__
    return f"{type(e).__name__}: {first}"


def _actor_hex(actor: Any) -> str | None:
    try:
        return str(actor._actor_id.hex())
    except AttributeError:  # pragma: no cover - Ray internals moved
        return None


def _zero_priorities(semantics: Semantics, handles: np.ndarray, capacity: int) -> None:
    """Give lost items priority 0 in the global sum tree, so they are never drawn and not in the total."""
    tree = semantics.sampler._tree  # type: ignore[attr-defined]
    tree.set(handles % capacity, np.zeros(handles.shape[0]))
