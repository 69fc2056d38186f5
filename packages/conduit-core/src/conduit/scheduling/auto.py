"""Automatic scheduling: granularities and overlap chosen from the running job's telemetry.

``Automatic()`` needs nothing but the buffer: on/off-policy and M come from its
semantics, and the caps are optional. It runs in three phases:

1. **probe** -- sequentially, the first deliveries (and ingestion writes) cycle through
   a few granularities of the safe range (1, 2, 4, 8, ...). Each call is recorded by the
   EDP's telemetry as usual; real batches are delivered throughout.
2. **fit** -- the latency model (per-call overhead + per-byte cost + chunk-management
   cost, :mod:`conduit.scheduling.model`) is fitted to those calls; the caller's own time
   between calls (the learner's update, the actor's rollout) is read from the same
   telemetry. The model predicts the cost per batch of every granularity in the range,
   sequential and overlapped, and picks the cheapest (the smaller on ties). The fit comes when the
   delivery probe ends; off-policy, an ingestion probe that has not written at every probed ``g_ing``
   by then (the producer ingests rarely) fits no ingestion model: ``g_ing`` stays the smallest, and
   the decision's reason says which were not written.
3. **confirm** (only when ``overlap`` is left to it) -- windows of a few deliveries
   alternate between the chosen sequential configuration and the chosen overlapped one;
   the one with the shorter median cycle per delivery (experience path plus everything
   else the caller did) is kept. This catches what the model cannot see, e.g. a machine
   with no spare core, where worker threads slow the learner down. When the two medians
   differ by less than the windows' own spread (half the range of a configuration's
   windows), the measurement cannot tell them apart and the model's prediction decides.

After that the job runs on an :class:`~conduit.scheduling.Overlapped` scheduler with the
chosen settings; :attr:`Automatic.decision` says what was measured and why.

**Checkpoints.** Once calibration is over, the buffer's ``state_dict()`` carries the decision
(:meth:`Automatic.state_dict`). A buffer built with a new ``Automatic`` that loads it skips
calibration and runs on the same settings, so (sequentially, or with no background work racing
the draws) it delivers exactly what the saved buffer delivers after its ``state_dict()``. A
checkpoint taken while calibrating carries nothing (the restored buffer calibrates afresh); a
decision outside the loading scheduler's own settings (caps, forced overlap, memory budget, on/off-
policy or M) is not applied either; and a buffer with another kind of scheduler ignores it.

**Inside ``read_locked()``.** A hand-over from a thread that holds the buffer's lock does not wait for another
producer's hand-over or for a switch of scheduler (either may be waiting for that lock): it goes to the scheduler that
serves now, as it would on that scheduler alone (stored in the call when ingestion runs in the caller, as in the probe).
A switch of scheduler (the end of a calibration phase) that meets such a hand-over, or that a delivery inside
``read_locked()`` would start while another thread's hand-over is under way, is made after a later delivery instead;
the delivery returns its batch either way.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

import torch

from conduit.batch import ExperienceBatch
from conduit.checks import is_bool, is_int, is_real
from conduit.errors import ConfigurationError
from conduit.scheduling.base import Scheduler, unattached
from conduit.scheduling.buffers import buffers_needed
from conduit.scheduling.granularity import GranularityRange, g_del_fitting, ranges_for, safe_ranges
from conduit.scheduling.model import (
    LatencyFit,
    choose_granularity,
    exposed_per_unit,
    fit_latency,
    observations,
    per_unit,
)
from conduit.scheduling.overlapped import Overlapped
from conduit.semantics.base import SampleInfo
from conduit.semantics.onpolicy import OnPolicy
from conduit.telemetry import CallRecord

if TYPE_CHECKING:
    from conduit.edp import ExperienceDataPlane

__all__ = ["Automatic", "Decision", "confirm_choice"]

#: the caller-side cost assumed for one overlapped call (queueing, waking the worker, accounting) in
#: the model's predictions; the confirm phase measures the real cycle, hand-over included (seconds)
HANDOVER_S = 30e-6
#: overlapped granularities whose predicted exposed time per unit differs by less than this share of the
#: caller's time between calls are ties (the smaller wins): below it a larger chunk buys nothing measurable
TIE_SHARE = 0.01
#: the cost assumed for handing one background job (a delivery chunk) to its worker thread and waking it;
#: it makes larger chunks cheaper once everything is hidden (measured: a wake-up per batch slowed the loop)
WAKE_S = 60e-6


@dataclass
class Decision:
    """What :class:`Automatic` measured, predicted and chose."""

    range: GranularityRange
    g_ing: float
    g_del: float
    overlap: bool
    deliver_fit: LatencyFit | None = None
    ingest_fit: LatencyFit | None = None
    #: bytes per delivered batch / per ingested rollout during calibration (on-policy: a whole rollout, which
    #: the producer may hand over in several ingest calls)
    batch_bytes: float = 0.0
    rollout_bytes: float = 0.0
    #: the caller's median time between deliveries / between ingestions (what overlap can hide behind;
    #: on-policy, ingestion's is per rollout)
    deliver_gap_s: float = 0.0
    ingest_gap_s: float = 0.0
    #: predicted seconds per batch (delivery) and per rollout (ingestion), per granularity
    deliver_sequential: dict[float, float] = field(default_factory=dict)
    deliver_overlapped: dict[float, float] = field(default_factory=dict)
    ingest_sequential: dict[float, float] = field(default_factory=dict)
    ingest_overlapped: dict[float, float] = field(default_factory=dict)
    #: measured cycle per delivery in the confirm phase: {"sequential": s, "overlapped": s}
    confirmed: dict[str, float] = field(default_factory=dict)
    reason: str = ""

    def explain(self) -> str:
        def row(name: str, costs: dict[float, float]) -> str:
            return f"  {name:22}" + "".join(f"  g={g:g}: {c * 1e3:.3f} ms" for g, c in sorted(costs.items()))
        lines = [f"safe ranges: {self.range.describe()}",
                 f"chosen: g_ing={self.g_ing:g}, g_del={self.g_del:g}, overlap={'on' if self.overlap else 'off'} "
                 f"({self.reason})"]
        if self.deliver_fit is not None:
            lines += [f"delivery model: {self.deliver_fit.describe()}; batch {self.batch_bytes / 2**20:.2f} MiB, "
                      f"learner time between deliveries {self.deliver_gap_s * 1e3:.3f} ms",
                      row("deliver, sequential", self.deliver_sequential),
                      row("deliver, overlapped", self.deliver_overlapped)]
        if self.ingest_fit is not None:
            lines += [f"ingestion model: {self.ingest_fit.describe()}; rollout {self.rollout_bytes / 2**20:.2f} MiB, "
                      f"time between ingestions {self.ingest_gap_s * 1e3:.3f} ms",
                      row("ingest, sequential", self.ingest_sequential),
                      row("ingest, overlapped", self.ingest_overlapped)]
        elif not self.range.on_policy and len(self.range.g_ing) > 1:  # (one g_ing: nothing to choose)
            lines.append(f"ingestion model: none (too few ingestion writes while probing); g_ing={self.g_ing:g}, the "
                         f"smallest")
        if self.confirmed:
            lines.append("measured in the confirm phase (the reason above says if it decided), cycle per delivery: "
                         + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in self.confirmed.items()))
        return "\n".join(lines)


def _probe_values(values: tuple[float, ...]) -> list[float]:
    """1, 2, 4, ... within the range, plus its top (off-policy); every value on-policy (M is small)."""
    if not values:
        return []
    if values[0] < 1:  # on-policy fractions
        return [values[0], values[-1]] if len(values) > 1 else [values[0]]
    out = [v for v in values if v >= 1 and (int(v) & (int(v) - 1)) == 0]
    if values[-1] not in out:
        out.append(values[-1])
    return out


class Automatic(Scheduler):
    """Chooses ``g_ing``, ``g_del`` and overlap for this job, from this job's telemetry.

    Keyword Args:
        overlap: force overlap on or off; ``None`` (default) lets the measurement decide.
        g_ing_max: cap on rollouts per ingestion write (off-policy; bounds ingestion lag).
        g_del_max: cap on batches per delivery call (off-policy; bounds priority staleness).
        memory_budget: bytes the delivery buffers may take (off-policy): every delivery, in any phase, keeps its
            delivery buffers (``buffers_needed(g_del, output_depth)`` chunks of ``g_del`` batches) within it for
            its own batch size. The range is capped for the largest batch the probe delivered when choosing;
            a later delivery of a batch too large for the chosen ``g_del`` (or a probed one) is prepared at the
            largest ``g_del`` below it that fits, and a later batch that fits goes back to the chosen ``g_del``
            (the decision, and :attr:`decision`, stay as chosen; :attr:`g_del` is the value the last delivery
            used). Chunk buffers sized for other batch sizes or granularities, and the idle confirm
            candidate's, are let go of, so the buffers held stay within it. A budget smaller than ``g_del = 1``
            needs for a batch (``buffers_needed(1, output_depth)`` batches) does not refuse it: that batch is
            delivered at ``g_del = 1``, the least any scheduler buffers, whenever it comes (the first delivery
            or a later one, before or after the decision; a checkpointed decision of ``g_del = 1`` is taken
            likewise). ``None``: no cap.
        probe_rounds: how many chunks of each probed granularity to time.
        confirm_deliveries: deliveries per window in the confirm phase.
        confirm_windows: windows per configuration in the confirm phase (alternating, median kept).
        output_depth: deliveries a delivered batch stays valid for.
        queue_depth: ingestion queue bound (backpressure) once overlapped.
        copy_on_ingest: copy each batch in ``ingest`` before handing it over, so the producer may overwrite its
            arrays at once (as :class:`Overlapped`'s). Off by default: every phase may hold handed-over batches
            (``ingest`` returns None), coalescing them at ``g_ing`` or storing them on a worker, so the producer
            must not write into a handed-over batch until ``flush()``.

    Raises:
        ConfigurationError: a setting of the wrong type or below its bound (checked here, before a
            buffer is built; counts may be numpy integers).

    Before it serves a buffer (passed as ``scheduler=``), nothing was handed over: ``flush`` and ``close`` do
    nothing, ``pending()`` is empty and :attr:`calibrated` is False; :attr:`g_ing` and :attr:`g_del`, chosen for
    the buffer, raise :class:`~conduit.errors.ConfigurationError`.

    Examples:
        >>> import torch
        >>> from conduit import Automatic, ExperienceDataPlane, ExperienceSchema, Field
        >>> edp = ExperienceDataPlane(ExperienceSchema(obs=Field((8,))), capacity=4096, scheduler=Automatic())
        >>> for _ in range(8):
        ...     edp.ingest({"obs": torch.randn(256, 8)})
        >>> for _ in range(80):
        ...     batch, info = edp.deliver(64)
        >>> edp.scheduler.decision is not None
        True
        >>> edp.close()
    """

    def __init__(self, *, overlap: bool | None = None, g_ing_max: int = 8, g_del_max: int = 8,
                 memory_budget: int | None = 1 << 30, probe_rounds: int = 3, confirm_deliveries: int = 6,
                 confirm_windows: int = 3, output_depth: int = 2, queue_depth: int = 8,
                 copy_on_ingest: bool = False) -> None:
        for name, v in (("probe_rounds", probe_rounds), ("confirm_deliveries", confirm_deliveries),
                        ("confirm_windows", confirm_windows)):
            if not is_int(v):
                raise ConfigurationError(f"{name} must be an int (values below 1 count as 1), got {v!r}.")
        if overlap is not None and not is_bool(overlap):
            raise ConfigurationError(f"overlap must be True, False or None (let the measurement decide), got "
                                     f"{overlap!r}.")
        if not is_bool(copy_on_ingest):  # ("false" from a config is truthy)
            raise ConfigurationError(f"copy_on_ingest must be True or False, got {copy_on_ingest!r}.")
        if not is_int(queue_depth) or queue_depth < 1:
            raise ConfigurationError(f"queue_depth must be an int >= 1, got {queue_depth!r}.")
        # the caps are checked here, not at the buffer's first delivery (ConfigurationError, as safe_ranges says)
        safe_ranges(on_policy=False, g_ing_max=g_ing_max, g_del_max=g_del_max, memory_budget=memory_budget,
                    output_depth=output_depth)
        self.force_overlap: bool | None = None if overlap is None else bool(overlap)
        self.g_ing_max: int = int(g_ing_max)
        self.g_del_max: int = int(g_del_max)
        self.memory_budget: int | None = None if memory_budget is None else int(memory_budget)
        self.probe_rounds: int = max(1, int(probe_rounds))
        self.confirm_deliveries: int = max(1, int(confirm_deliveries))
        self.confirm_windows: int = max(1, int(confirm_windows))
        self.output_depth: int = int(output_depth)
        self.queue_depth: int = int(queue_depth)
        self.copy_on_ingest: bool = bool(copy_on_ingest)
        #: set once calibration is over
        self.decision: Decision | None = None

    # -- set-up ----------------------------------------------------------------------------
    def _attach(self, edp: ExperienceDataPlane) -> None:
        self.on_policy = isinstance(edp.semantics, OnPolicy)
        self.range = ranges_for(edp.semantics, g_ing_max=self.g_ing_max, g_del_max=self.g_del_max)
        self.decision = None  # (a scheduler serving a new buffer calibrates afresh: no decision of the last one)
        self._ing_plan = _probe_values(self.range.g_ing) * self.probe_rounds
        self._del_plan: list[float] | None = None  # set at the first delivery, when the batch size is known
        self._ing_seen = 0
        #: on-policy probe: the rollout (version, first handle) that was open when flush() last stored everything
        self._probe_rollout: tuple[int, int] | None = None
        self._del_left = 0
        self._phase = "probe"
        self._confirm: list[str] = []
        self._confirm_start = 0.0
        self._confirm_name: str  # set by _next_confirm before it is read
        self._confirm_left = 0
        self._since = time.perf_counter()
        #: the telemetry at attach and its mark then: the probe's calls are those folded at or after it
        self._probe_telemetry, self._probe_mark = edp.telemetry, edp.telemetry.mark()
        #: what the model was fitted without (see :meth:`_records`), said in the decision's reason
        self._fit_note = ""
        self._candidates: dict[str, Overlapped] = {}
        #: a switch of scheduler that waits until the current one's queue can be stored (see _activate)
        self._retry: Callable[[], None] | None = None
        #: held by a hand-over and by a switch of scheduler: a producer's batch never lands in a scheduler
        #: that was drained and switched away from (it would stay invisible to flush, or be refused by close).
        #: A thread holding the buffer's lock never waits for it (see :meth:`_enter_route`)
        self._route = threading.RLock()
        #: the probe's ingestion marks (``_ing_plan``, ``_ing_seen``, ``_probe_rollout``): held only while they are
        #: read and changed, never across a wait (a thread holding the buffer's lock may go on without ``_route``)
        self._probe_mu = threading.Lock()
        #: off-policy with a memory budget, once decided: the decided ``g_del`` of the scheduler that serves calls
        #: (0: no check, see :meth:`_deliver_within_budget`), and the batch sizes ``lo..hi`` already checked at its
        #: current ``g_del`` (an empty range makes the next delivery check its size)
        self._budget_g = 0
        self._checked_lo, self._checked_hi = 1, 0
        #: added to the decision's reason when the ingestion probe did not write every probed g_ing (see _decide)
        self._ing_unprobed = ""
        self.inner = self._make(self._ing_plan[0] if self._ing_plan else 1, 1, overlap=False)

    def _make(self, g_ing: float, g_del: float, *, overlap: bool) -> Overlapped:
        s = Overlapped(g_ing=g_ing, g_del=g_del, overlap=overlap, output_depth=self.output_depth,
                       queue_depth=self.queue_depth, copy_on_ingest=self.copy_on_ingest)
        s.attach(self.edp)
        return s

    @property
    def calibrated(self) -> bool:
        """Whether calibration has finished: the granularities and overlap of :attr:`decision` serve from now on.
        (``decision`` is set when the model has chosen the candidates, before the confirm phase measures them.)"""
        return self._serves and self._phase == "run"

    @property
    def g_ing(self) -> float:  # type: ignore[override]
        if not self._serves:
            raise unattached(self, "g_ing")
        return self.inner.g_ing

    @property
    def g_del(self) -> float:  # type: ignore[override]
        if not self._serves:
            raise unattached(self, "g_del")
        return self.inner.g_del

    @property
    def priority_staleness(self) -> int:
        """The bound over every phase: a prioritized draw misses at most ``g_del_max`` priority updates (off-policy;
        0 on-policy, which has no priorities). Before the scheduler serves a buffer: the off-policy bound."""
        return 0 if getattr(self, "on_policy", False) else self.g_del_max

    def __repr__(self) -> str:
        phase = getattr(self, "_phase", None)
        if phase is None:  # not attached to a buffer yet: its settings are all there is
            overlap = {None: "auto", True: "on", False: "off"}[self.force_overlap]
            return f"Automatic(g_ing_max={self.g_ing_max}, g_del_max={self.g_del_max}, overlap={overlap})"
        return f"Automatic(phase={phase}, inner={self.inner!r})"

    # -- the scheduler role ------------------------------------------------------------------
    def ingest(self, batch: ExperienceBatch, *, version: int | None,
               priorities: torch.Tensor | None) -> torch.Tensor | None:
        routed = self._enter_route()
        try:
            inner = self.inner  # (no switch completes before this hand-over is queued: see _enter_route)
            if self._probe_rollout is not None:
                with self._probe_mu:
                    self._rollout_probed()  # before this batch's hand-over: a new rollout starts at the next value
            out = inner.ingest(batch, version=version, priorities=priorities)
            if self._phase == "probe" and self._ing_plan and not self.on_policy:
                with self._probe_mu:
                    self._ing_seen += 1
                    if self._ing_plan and self._ing_seen >= self._ing_plan[0] and not inner.pending():
                        self._ing_plan.pop(0)
                        self._ing_seen = 0
                        if self._ing_plan:
                            inner.retune(g_ing=self._ing_plan[0])
            return out
        finally:
            if routed:
                self._route.release()

    def flush(self) -> None:
        if not self._serves:
            return  # (nothing was handed over)
        self.inner.flush()
        if self._phase == "probe" and self.on_policy and self._ing_plan:
            routed = self._enter_route()  # (a producer's hand-over checks the same mark)
            try:
                with self._probe_mu:
                    self._rollout_probed()
                    # seal() flushes, then ends the rollout open now: the next hand-over or flush sees that it ended
                    self._probe_rollout = self._open_rollout()
            finally:
                if routed:
                    self._route.release()

    def _enter_route(self) -> bool:
        """Take ``_route`` (for a hand-over, a flush's probe mark or a switch of scheduler); True when taken.

        A thread that holds the buffer's lock (inside ``read_locked()``, or a callback the buffer runs under it) does
        not wait for it: the thread holding it may be waiting for that lock (a producer storing in its own call, or a
        switch draining the scheduler it leaves), so waiting could last forever. It goes on without ``_route``
        (False), which is safe because a switch sets the new scheduler only under the buffer's lock, after checking
        there that the scheduler it leaves holds nothing unstored (:meth:`_activate`): while this thread holds that
        lock, the scheduler it hands over to stays the one that serves, and a switch under way that drained it before
        this hand-over finds the batch there and is retried after a later delivery.
        """
        if self._route.acquire(blocking=False):
            return True
        if self.edp.holds_lock():
            return False
        self._route.acquire()
        return True

    def _open_rollout(self) -> tuple[int, int] | None:
        """On-policy: (version, first handle) of the rollout storage is filling, None when none is open."""
        sem = self.edp.semantics
        return sem.open_rollout if isinstance(sem, OnPolicy) else None

    def _rollout_probed(self) -> None:
        """On-policy ingestion probe: one rollout per probed ``g_ing``. The next value is taken once the rollout
        open at the last flush has ended (``seal``, or a new version), not at every flush (``state_dict``,
        ``migrate`` and the caller's own flushes end no rollout)."""
        if self._probe_rollout is None or self._open_rollout() == self._probe_rollout:
            return
        self._probe_rollout = None
        if self._phase == "probe" and self._ing_plan:
            self._ing_plan.pop(0)
            if self._ing_plan:
                self.inner.retune(g_ing=self._ing_plan[0])

    def deliver(self, n: int | None, **kwargs: Any) -> tuple[ExperienceBatch, SampleInfo]:
        if self._phase == "probe" and self._del_plan is None:
            out = self._first_delivery(n, kwargs)
        elif self._phase == "probe":
            probed = self.inner.g_del
            self._fit_budget(n)
            try:
                out = self.inner.deliver(n, **kwargs)
            except BaseException:  # refused (or failed): the probed g_del stays, as the semantics' state does
                if self.inner.g_del != probed:
                    self.inner.retune(g_del=probed)
                raise
        elif self._budget_g and not (type(n) is int and self._checked_lo <= n <= self._checked_hi):
            out = self._deliver_within_budget(n, kwargs)  # (a batch size not checked at this g_del yet)
        else:
            out = self.inner.deliver(n, **kwargs)
        if self._phase == "probe" and self.memory_budget is not None and not self.on_policy:
            size = out[0].batch_size  # (the chunk buffers this delivery left, within the budget for its size)
            if size > 0:
                self._trim_buffers(size, _item_bytes(self.edp) * size, room_for_a_chunk=False)
        if self._retry is not None:
            retry, self._retry = self._retry, None
            retry()
        elif self._phase == "probe":
            self._del_left -= 1
            if self._del_left <= 0:
                assert self._del_plan is not None
                if self._del_plan:
                    self._del_plan.pop(0)
                if self._del_plan:
                    if not self.on_policy:
                        self.inner.retune(g_del=self._del_plan[0])
                    self._del_left = int(self._del_plan[0])
                else:  # (this call's deliver_wait is recorded once it returns: its size is passed on)
                    self._decide(out[0].batch_size)
        elif self._phase == "confirm":
            self._confirm_left -= 1
            if self._confirm_left == self.confirm_deliveries:  # the window's first chunk primed it: time the rest
                self._confirm_start = time.perf_counter()
            if self._confirm_left <= 0:
                self._next_confirm()
        return out

    def invalidate(self, reason: str = "contents") -> None:
        """Forwarded to the active scheduler and to the confirm phase's idle candidate, which a migration
        must re-size too before it is switched back in. After ``"contents"`` (a migration may change the
        schema, so the bytes of a batch) the next delivery's size is checked against the memory budget again."""
        if not self._serves:
            return  # (nothing prepared)
        if reason == "contents":
            self._checked_lo, self._checked_hi = 1, 0
        self.inner.invalidate(reason)
        for c in self._candidates.values():
            if c is not self.inner:
                c.invalidate(reason)

    def close(self) -> None:
        if not self._serves:
            return  # (nothing to close)
        for c in self._candidates.values():
            if c is not self.inner:
                c.close()
        self.inner.close()

    def pending(self) -> list[Any]:
        return self.inner.pending() if self._serves else []

    # -- checkpoint ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``{"decision": ...}`` (plain Python values) once calibration is over; ``{}`` before (a buffer that
        loads such a checkpoint calibrates afresh)."""
        d = self.decision
        if getattr(self, "_phase", None) != "run" or d is None:
            return {}
        return {"decision": _decision_state(d)}

    def check_state_dict(self, state: Mapping[str, Any]) -> None:
        """Refuse a damaged state (see :meth:`load_state_dict`) before anything changes."""
        super().check_state_dict(state)
        if not set(state) <= {"decision"}:
            raise _damaged(f"unknown keys {sorted(map(str, set(state) - {'decision'}))} (expected 'decision' only)")
        _decision_from(state.get("decision"))

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take a calibrated decision that :meth:`state_dict` saved: calibration (any phase, also one finished
        already) ends, and the buffer runs on the decision's ``g_ing``, ``g_del`` and overlap from now on.

        A decision this scheduler's own settings do not allow is not applied (it goes on as before, e.g. it
        calibrates): another on/off-policy kind or M, ``g_ing``/``g_del`` above ``g_ing_max``/``g_del_max``,
        overlap other than a forced ``overlap``, or ``g_del > 1`` whose delivery buffers exceed ``memory_budget``
        at the saved batch size. An empty state (saved while calibrating) changes nothing. An applied decision's
        range and predicted costs keep only the granularities within this scheduler's caps (what it may use).

        Raises:
            ConfigurationError: ``state`` is damaged (nothing changed), or this scheduler serves no open buffer.
        """
        self.check_state_dict(state)
        edp = getattr(self, "edp", None)
        if edp is None or edp.closed or getattr(self, "_phase", None) is None:
            raise ConfigurationError("This Automatic scheduler serves no open buffer; load the checkpoint into a "
                                     "buffer built with it (ExperienceDataPlane.load_state_dict).")
        d = _decision_from(state.get("decision"))
        if d is None or not self._allows(d):
            return
        for c in self._candidates.values():  # (a calibration's candidates: not the decision's settings)
            if c is not self.inner:
                c.close()
        self._candidates = {}
        self._confirm = []
        self._retry = None
        self._ing_plan, self._del_plan, self._del_left = [], [], 0
        self._probe_rollout = None
        self._ing_unprobed = ""  # (the saved reason says it already)
        # the saved range (and its predictions) may reach past this scheduler's caps: the decision says, and saves,
        # the granularities this scheduler may use (its g_ing and g_del among them, see _allows)
        g_ing = tuple(g for g in d.range.g_ing if any(math.isclose(g, h) for h in self.range.g_ing))
        g_del = d.range.g_del if self.on_policy else tuple(g for g in d.range.g_del if g <= self.g_del_max)
        d.range = GranularityRange(d.range.on_policy, g_ing, g_del, d.range.num_minibatches)
        for costs, kept in ((d.deliver_sequential, g_del), (d.deliver_overlapped, g_del),
                            (d.ingest_sequential, g_ing), (d.ingest_overlapped, g_ing)):
            for g in [g for g in costs if g not in kept]:
                del costs[g]
        self.range = d.range
        self.decision = d
        self._choices = {d.overlap: (d.g_ing, d.g_del)}
        self._finish(d.overlap, d.reason)

    def _allows(self, d: Decision) -> bool:
        """Whether decision ``d`` is within this scheduler's settings for the buffer it serves."""
        if d.range.on_policy != self.on_policy or (self.force_overlap is not None and self.force_overlap != d.overlap):
            return False
        if not any(math.isclose(d.g_ing, g) for g in self.range.g_ing):
            return False
        if self.on_policy:
            return math.isclose(d.g_del, self.range.g_del[0])
        if d.g_del > self.g_del_max:
            return False
        return self._fitting_g_del(int(d.g_del), d.batch_bytes) == d.g_del  # (g_del = 1 always: see memory_budget)

    # -- calibration ---------------------------------------------------------------------------
    def _first_delivery(self, n: int | None, kwargs: dict[str, Any]) -> tuple[ExperienceBatch, SampleInfo]:
        """The first delivery sizes the probe plan from its batch size; a refused one leaves no plan behind."""
        if not self.on_policy and not (is_int(n) and n > 0):
            self.edp.select_now([n], peek=True, **kwargs)  # the semantics refuse it as a delivery would (a peek)
        saved = (self.range, self.inner.g_del)
        self._start_delivery_probe(n)
        try:
            self._fit_budget(n)  # (its g_del fits already: chunk buffers of an earlier, refused first delivery)
            return self.inner.deliver(n, **kwargs)
        except BaseException:  # refused (or failed): the next delivery plans again, from its own batch size
            self.range, g_del = saved
            self._del_plan, self._del_left = None, 0
            if not self.on_policy:
                self.inner.retune(g_del=g_del)
            raise

    def _start_delivery_probe(self, n: int | None) -> None:
        if self.on_policy:
            self._del_plan = [1.0] * (2 * self.probe_rounds)  # g_del is fixed; time a few deliveries
        else:
            fits = g_del_fitting(self.g_del_max, batch_bytes=_item_bytes(self.edp) * int(n or 1),
                                 memory_budget=self.memory_budget, output_depth=self.output_depth)
            self.range = GranularityRange(False, self.range.g_ing, tuple(float(g) for g in fits or (1,)))
            self._del_plan = _probe_values(self.range.g_del) * self.probe_rounds
            self.inner.retune(g_del=self._del_plan[0])
        self._del_left = int(self._del_plan[0])

    def _fitting_g_del(self, g: int, batch_bytes: float) -> int:
        """The largest ``g_del`` up to ``g`` whose delivery buffers fit ``memory_budget`` (:func:`g_del_fitting`); 1
        when even one batch per call does not fit (see the class docstring: such a batch is delivered at
        ``g_del = 1``, not refused)."""
        fits = g_del_fitting(max(1, int(g)), batch_bytes=batch_bytes, memory_budget=self.memory_budget,
                             output_depth=self.output_depth)
        return fits[-1] if fits else 1

    def _fit_budget(self, n: int | None) -> None:
        """Off-policy probe: lower this call's ``g_del`` (the probed value stays planned) until its delivery
        buffers fit ``memory_budget`` for this call's batch size ``n`` (the probe range was sized from the first
        delivery, which may have been smaller), and let go of chunk buffers from earlier calls that would take the
        probe's buffers over the budget (see :meth:`_trim_buffers`). ``g_del = 1`` stays when even that does not
        fit. A later call whose batch fits goes back to the probed value. A size the semantics refuse is left to
        them."""
        if self.on_policy or self.memory_budget is None or not is_int(n) or n <= 0:
            return
        batch_bytes = _item_bytes(self.edp) * int(n)
        planned = self._del_plan[0] if self._del_plan else self.inner.g_del  # (not a value an earlier call lowered)
        g = self._fitting_g_del(int(planned), batch_bytes)
        if g != self.inner.g_del:
            self.inner.retune(g_del=g)
        self._trim_buffers(int(n), batch_bytes, room_for_a_chunk=True)

    def _watch_budget(self, g_del: float) -> None:
        """Once decided (off-policy, with a memory budget): deliveries go to a scheduler whose decided ``g_del`` is
        ``g_del``; the next one checks its batch size (:meth:`_deliver_within_budget`)."""
        if self.on_policy or self.memory_budget is None:
            return
        self._budget_g = max(1, int(g_del))
        self._checked_lo, self._checked_hi = 1, 0

    def _deliver_within_budget(self, n: int | None, kwargs: dict[str, Any]) -> tuple[ExperienceBatch, SampleInfo]:
        """After the decision (off-policy, with a memory budget), a delivery of a batch size not checked yet at the
        active scheduler's ``g_del``: it is prepared at the largest ``g_del`` up to the decided one whose delivery
        buffers fit ``memory_budget`` for this size (``g_del = 1`` when none does: delivered, never refused).

        The batches prepared for earlier calls are given back (``invalidate("contents")``: their draws are made
        again, as after a checkpoint) and every chunk buffer is let go of (delivered batches keep their memory and
        stay valid), so the chunks of this size are allocated afresh at their own size: a buffer sized for a
        larger batch or chunk is never reused, so the buffers held stay within the budget (a chunk buffer only
        grows). The size is remembered, so later deliveries of a size already checked cost one comparison: up to
        the largest size checked that fits at the decided ``g_del`` (smaller batches reuse those buffers without
        growing them), or exactly this size at a lowered one. A delivery the semantics refuse changes nothing (they
        are asked first, as the scheduler does for a new request); a size that is not a positive int is left to
        them.
        """
        if not is_int(n) or n <= 0:
            return self.inner.deliver(n, **kwargs)
        size = int(n)
        if self._checked_lo <= size <= self._checked_hi:  # (checked already: an int of another type, e.g. numpy's)
            return self.inner.deliver(n, **kwargs)
        batch_bytes = _item_bytes(self.edp) * size
        g = self._fitting_g_del(self._budget_g, batch_bytes)
        before = self.inner.g_del
        if len(self.edp.storage):  # a size the semantics refuse changes nothing (a peek; with nothing stored yet
            self.edp.select_now([n], peek=True, **kwargs)  # nothing is prepared, and the scheduler flushes first)
        self.inner.invalidate("contents")  # (prepared chunks hold their buffers: given back first)
        self.inner.release_buffers()
        if g != before:
            self.inner.retune(g_del=g)
        try:
            out = self.inner.deliver(n, **kwargs)
        except BaseException:  # refused (or failed): back to the g_del the checked sizes were checked at
            if g != before:
                self.inner.retune(g_del=before)
            raise
        assert self.memory_budget is not None
        if g == self._budget_g and buffers_needed(g, self.output_depth) * g * batch_bytes <= self.memory_budget:
            self._checked_lo, self._checked_hi = 1, max(size, self._checked_hi if self._checked_lo == 1 else 0)
        else:
            self._checked_lo = self._checked_hi = size
        return out

    def _trim_buffers(self, n: int, batch_bytes: int, *, room_for_a_chunk: bool) -> None:
        """Off-policy probe: keep the bytes the probing scheduler's chunk buffers hold within ``memory_budget``
        (at least what ``g_del = 1`` needs for batches of ``n``), with room for the chunk this call may allocate
        when ``room_for_a_chunk``.

        The probe changes ``g_del`` and the batch size, and a chunk buffer keeps the rows it was sized for: without
        this, buffers of earlier granularities (more of them at ``g_del = 1``, larger ones at a larger ``g_del``)
        would add up past the budget. Buffers holding prepared batches are kept; the others are let go of
        (:meth:`Overlapped.trim_buffers`: batches a buffer handed out keep their own memory and stay valid).
        """
        if batch_bytes <= 0:
            return
        assert self.memory_budget is not None
        g = int(self.inner.g_del)
        allowed = max(self.memory_budget, buffers_needed(g, self.output_depth) * g * batch_bytes)
        self.inner.trim_buffers(allowed, n, batch_bytes / n, room_for_a_chunk=room_for_a_chunk)

    def _cap_g_del(self, items: int) -> None:
        """Off-policy: keep the delivery range within ``memory_budget`` for the largest batch the probe delivered
        (the range was sized from the first delivery alone, which may have been smaller than the job's batches).
        ``g_del = 1`` stays when even that does not fit: the probe already delivered such batches."""
        fits = g_del_fitting(self.g_del_max, batch_bytes=_item_bytes(self.edp) * items,
                             memory_budget=self.memory_budget, output_depth=self.output_depth)
        g_del = tuple(g for g in self.range.g_del if g in fits)
        self.range = GranularityRange(False, self.range.g_ing, g_del or self.range.g_del[:1])

    def _records(self) -> list[CallRecord]:
        """The calls recorded since calibration began, oldest first.

        A probe that records more calls than the telemetry's ring holds (``Telemetry(maxlen=...)``) loses its
        earliest ones: the model is fitted on the rest, and a :class:`RuntimeWarning` and the decision's reason say
        how many were dropped.
        """
        tel = self.edp.telemetry
        # (a telemetry put in place since the scheduler was attached: all of its calls, from its first mark)
        recs, dropped = tel.calls_since(self._probe_mark if tel is self._probe_telemetry else 0)
        if dropped:
            self._fit_note = (f"; fitted without the {dropped} earliest calls of the probe, which the telemetry's "
                              f"ring (Telemetry(maxlen={tel.maxlen})) dropped")
            warnings.warn(f"Automatic's probe recorded more calls than the buffer's telemetry keeps: its ring "
                          f"(Telemetry(maxlen={tel.maxlen})) dropped the {dropped} earliest, so the latency model is "
                          f"fitted on the rest. Raise the Telemetry's maxlen above the calls the probe records.",
                          RuntimeWarning, stacklevel=2)
        return [r for r in recs if r.start >= self._since]

    def _decide(self, last_items: int) -> None:
        """Choose from the probe's telemetry; ``last_items``: the size of the delivery that ended the probe."""
        recs = self._records()
        d_obs = observations(recs, "deliver")
        i_obs = observations(recs, "ingest")
        dfit = fit_latency(d_obs) if d_obs else None
        ifit = fit_latency(i_obs) if len({(b, s) for b, _, s in i_obs}) >= 2 else None
        #: off-policy, what the ingestion probe left unwritten (it goes as fast as the producer ingests): a model
        #: fitted to the calls of a few small granularities only would rank the larger ones by extrapolation
        self._ing_unprobed = ""
        probed = _probe_values(self.range.g_ing)
        written = len(probed) * self.probe_rounds - len(self._ing_plan)
        if not self.on_policy and written < len(probed):
            ifit = None
            self._ing_unprobed = (f"; g_ing={self.range.g_ing[0]:g}, the smallest: no ingestion model, the probe "
                                  f"ended after {len(i_obs)} ingestion writes, before one at "
                                  f"{', '.join(f'g_ing={g:g}' for g in probed[written:])}")
        # (calls that raised are recorded with no items: they delivered or accepted nothing to size the model by)
        waits = [r for r in recs if r.kind == "deliver_wait" and r.items]
        ing = [r for r in recs if r.kind == "ingest_wait" and r.items]
        sizes = [r.items for r in waits] + [last_items]
        if not self.on_policy and self.memory_budget is not None:
            self._cap_g_del(max(sizes))
        batch_bytes = _bytes_per_call(recs, "deliver", sizes)
        rollout_bytes = _bytes_per_call(recs, "ingest", [r.items for r in ing])
        ingest_gap = _median_gap(ing)
        m = self.range.num_minibatches
        per_call = statistics.median(r.items for r in ing) if ing else 0
        #: producer calls per model unit: a write of g units that covers more than one call concatenates (stages) them
        calls = 1.0
        if self.on_policy and m and per_call > 0:
            # on-policy g_ing is a part of a *rollout* (the model's unit), which the producer may hand over in
            # several ingest calls: one rollout feeds M deliveries, so it holds M deliveries' items
            calls = m * statistics.median(sizes) / per_call
            rollout_bytes *= calls
            ingest_gap *= calls  # (the producer's time per rollout, what a rollout's writes can hide behind)
        d = Decision(self.range, 1, self.range.g_del[0], False, dfit, ifit, batch_bytes, rollout_bytes,
                     _median_gap(waits), ingest_gap)
        prioritized = getattr(getattr(self.edp.semantics, "sampler", None), "prioritized", False)
        if dfit is not None and not self.on_policy:
            for g in self.range.g_del:
                d.deliver_sequential[g] = per_unit(dfit, g, batch_bytes)
                d.deliver_overlapped[g] = exposed_per_unit(dfit, g, batch_bytes, gap_s=d.deliver_gap_s,
                                                           handover_s=HANDOVER_S, wake_s=WAKE_S,
                                                           window_units=1 if prioritized else None)
        if ifit is not None:
            for g in self.range.g_ing:
                staged = g * calls > 1 + 1e-9  # (on-policy too: 1/2 of a rollout handed over in quarters is staged)
                d.ingest_sequential[g] = per_unit(ifit, g, rollout_bytes, staged=staged)
                d.ingest_overlapped[g] = exposed_per_unit(ifit, g, rollout_bytes, gap_s=d.ingest_gap_s,
                                                          handover_s=HANDOVER_S, staged=staged)
        gd_seq = choose_granularity(d.deliver_sequential) if d.deliver_sequential else self.range.g_del[0]
        gd_ovl = (choose_granularity(d.deliver_overlapped, slack_s=TIE_SHARE * d.deliver_gap_s)
                  if d.deliver_overlapped else self.range.g_del[0])
        gi_seq = choose_granularity(d.ingest_sequential) if d.ingest_sequential else self.range.g_ing[0]
        gi_ovl = (choose_granularity(d.ingest_overlapped, slack_s=TIE_SHARE * d.ingest_gap_s)
                  if d.ingest_overlapped else self.range.g_ing[0])
        if self.on_policy and not d.ingest_sequential:
            gi_seq = gi_ovl = self.range.g_ing[0]
        self.decision = d
        self._choices = {False: (gi_seq, gd_seq), True: (gi_ovl, gd_ovl)}
        self._watch_budget(self.inner.g_del)  # (until a candidate is switched in, the probe's scheduler serves)
        if self.force_overlap is not None:
            self._finish(self.force_overlap, "overlap fixed by the caller; granularity from the model")
            return
        self._phase = "confirm"
        # both candidates live through the whole phase, so no window pays for starting threads (or, without a
        # memory budget, for allocating buffers: with one, the idle candidate's go, see _activate)
        self._candidates = {name: self._make(*self._choices[name == "overlapped"], overlap=name == "overlapped")
                            for name in ("sequential", "overlapped")}
        self._confirm = ["sequential", "overlapped"] * self.confirm_windows
        self._cycles: dict[str, list[float]] = {"sequential": [], "overlapped": []}
        self._next_confirm()

    def _next_confirm(self) -> None:
        """Alternate windows of sequential and overlapped delivery; keep the shorter median cycle.

        Each window first delivers one chunk untimed (the overlapped candidate's prefetch is
        not primed yet after a switch), then times ``confirm_deliveries`` deliveries.
        """
        now = time.perf_counter()
        assert self.decision is not None
        if self._confirm_start:
            self._cycles[self._confirm_name].append((now - self._confirm_start) / self.confirm_deliveries)
            self._confirm_start = 0.0
        if not self._confirm:
            c = self.decision.confirmed
            c.update({k: statistics.median(v) for k, v in self._cycles.items() if v})
            self._finish(*confirm_choice(self._cycles, self._model_prefers_overlap()))
            return
        cand = self._candidates[self._confirm[0]]
        if not self._activate(cand):
            self._retry = self._next_confirm
            return
        self._watch_budget(self._choices[self._confirm[0] == "overlapped"][1])
        self._confirm_name = self._confirm.pop(0)
        warm = 1 if self.on_policy else int(cand.g_del)
        self._confirm_left = warm + self.confirm_deliveries
        self._confirm_start = 0.0

    def _model_prefers_overlap(self) -> bool:
        """Whether the fitted model predicts less exposed time per delivery with overlap (both chosen granularities)."""
        d = self.decision
        assert d is not None
        gi_s, gd_s = self._choices[False]
        gi_o, gd_o = self._choices[True]
        # ingestions per delivery, from the caller's own pacing (time between ingestions vs between deliveries)
        share = min(1.0, d.deliver_gap_s / d.ingest_gap_s) if d.ingest_gap_s > 0 else 0.0

        def exposed(deliver: dict[float, float], ingest: dict[float, float], gi: float, gd: float) -> float:
            return deliver.get(gd, 0.0) + share * ingest.get(gi, 0.0)

        return (exposed(d.deliver_overlapped, d.ingest_overlapped, gi_o, gd_o)
                < exposed(d.deliver_sequential, d.ingest_sequential, gi_s, gd_s))

    def _activate(self, new: Overlapped) -> bool:
        """Route calls to ``new``: the current scheduler stores what it was handed and drops what it prepared.

        Runs after a delivery has its batch. When the current scheduler's queue cannot be stored now
        (e.g. on-policy, the next rollout fits only once the learner has consumed the current one),
        nothing is switched and False is returned: the caller retries after a later delivery, the
        delivered batch is not lost, and the failure stays for the producer's next call to raise.

        The same holds (False, retried later) for a delivery that holds the buffer's lock (inside ``read_locked()``)
        while another thread holds ``_route`` (a producer's hand-over, which may wait for that lock), and when a
        thread holding the buffer's lock handed a batch over to the current scheduler after it was drained (such a
        thread does not wait for ``_route``, see :meth:`_enter_route`): ``new`` is set under the buffer's lock, once
        the current scheduler holds nothing unstored, so no batch stays behind in a scheduler switched away from.
        """
        if not self._enter_route():  # (the producer holding it may wait for the buffer's lock this thread holds)
            return False
        try:  # no hand-over from a thread without the buffer's lock to ``old`` between its drain and the switch
            old = self.inner
            if old is new:
                return True
            if not old.drain():
                return False
            old.invalidate("contents")
            if self.memory_budget is not None and not self.on_policy:
                # (it holds no prepared batch now.) Its chunk buffers go: kept, they would count against the budget
                # while it is idle, and back in a later confirm window their expiry (counted in its own deliveries
                # only) would keep them in use for output_depth more, so its ring would grow past the budget
                old.release_buffers()
            with self.edp.lock:
                if old.pending():  # handed over since the drain from inside read_locked(): drained next time
                    return False
                self.inner = new
        finally:
            self._route.release()
        if old not in self._candidates.values():
            old.close()
        return True

    def _finish(self, overlap: bool, reason: str) -> None:
        assert self.decision is not None
        gi, gd = self._choices[overlap]
        self.decision.g_ing, self.decision.g_del, self.decision.overlap = gi, gd, overlap
        self.decision.reason = reason + self._ing_unprobed + self._fit_note
        if self.on_policy:
            self.decision.g_del = self.range.g_del[0]
        name = "overlapped" if overlap else "sequential"
        chosen = self._candidates.get(name)
        if chosen is None:  # kept with the candidates, so that a retry does not build another
            chosen = self._candidates[name] = self._make(gi, gd if not self.on_policy else 1, overlap=overlap)
        if not self._activate(chosen):
            self._retry = lambda: self._finish(overlap, reason)
            return
        self._watch_budget(gd)
        for c in self._candidates.values():
            if c is not chosen:
                c.close()
        self._candidates = {}
        self._confirm = []
        self._phase = "run"


def confirm_choice(cycles: dict[str, list[float]], model_prefers_overlap: bool) -> tuple[bool, str]:
    """Overlap on or off from the confirm phase's windows (seconds per delivery, per configuration).

    The shorter median cycle wins, unless the two medians differ by no more than the windows'
    own spread (half the range of a configuration's windows, the larger of the two): then the
    measurement cannot tell them apart and the model's prediction decides.
    """
    seq = statistics.median(cycles["sequential"]) if cycles.get("sequential") else float("inf")
    ovl = statistics.median(cycles["overlapped"]) if cycles.get("overlapped") else float("inf")
    noise = max(((max(v) - min(v)) / 2 for v in cycles.values() if v), default=0.0)
    if abs(ovl - seq) <= noise:
        on = model_prefers_overlap
        return on, (f"measured cycles within their window-to-window spread ({noise * 1e3:.3f} ms); the model "
                    f"predicts less exposed time {'with' if on else 'without'} overlap")
    on = ovl < seq
    return on, "shorter measured cycle per delivery " + ("with" if on else "without") + " overlap"


def _item_bytes(edp: ExperienceDataPlane) -> int:
    """Bytes of one item's fixed fields (ragged fields are not in the delivery buffers)."""
    total = 0
    for name in edp.schema.fixed:
        f = edp.schema[name]
        total += f.item_numel * torch.empty((), dtype=f.dtype).element_size()
    return total


def _median_gap(recs: list[CallRecord]) -> float:
    """Median time between the end of one call and the start of the next on the same thread."""
    by_thread: dict[int, list[CallRecord]] = {}
    for r in recs:
        by_thread.setdefault(r.thread, []).append(r)
    gaps = [b.start - a.end for rs in by_thread.values() for a, b in zip(rs, rs[1:], strict=False)]
    gaps = [g for g in gaps if g >= 0]
    return statistics.median(gaps) if gaps else 0.0


def _bytes_per_call(recs: list[CallRecord], work: str, items: list[int]) -> float:
    """Bytes one caller-side call moves: bytes per item of the ``work`` records times the median of ``items``
    (items per call)."""
    per_item = [r.nbytes / r.items for r in recs if r.kind == work and r.items]
    return statistics.median(per_item) * statistics.median(items) if per_item and items else 0.0


def _decision_state(d: Decision) -> dict[str, Any]:
    """``d`` as plain Python values (what :func:`_decision_from` reads back)."""
    def costs(c: dict[float, float]) -> list[list[float]]:
        return [[float(g), float(v)] for g, v in c.items()]

    def fit(f: LatencyFit | None) -> dict[str, Any] | None:
        return None if f is None else asdict(f)
    r = d.range
    return {"range": {"on_policy": r.on_policy, "g_ing": [float(g) for g in r.g_ing],
                      "g_del": [float(g) for g in r.g_del], "num_minibatches": r.num_minibatches},
            "g_ing": float(d.g_ing), "g_del": float(d.g_del), "overlap": bool(d.overlap),
            "deliver_fit": fit(d.deliver_fit), "ingest_fit": fit(d.ingest_fit),
            "batch_bytes": float(d.batch_bytes), "rollout_bytes": float(d.rollout_bytes),
            "deliver_gap_s": float(d.deliver_gap_s), "ingest_gap_s": float(d.ingest_gap_s),
            "deliver_sequential": costs(d.deliver_sequential), "deliver_overlapped": costs(d.deliver_overlapped),
            "ingest_sequential": costs(d.ingest_sequential), "ingest_overlapped": costs(d.ingest_overlapped),
            "confirmed": {str(k): float(v) for k, v in d.confirmed.items()}, "reason": str(d.reason)}


def _damaged(what: str) -> ConfigurationError:
    return ConfigurationError(f"The checkpoint's Automatic scheduler state is damaged: {what}. Drop its "
                              f"'scheduler' entry to load the checkpoint and calibrate afresh.")


def _real(v: Any, what: str, *, least: float | None = 0.0, finite: bool = True) -> float:
    if not is_real(v):
        raise _damaged(f"{what} must be a number, got {v!r}")
    x = float(v)
    if (finite and not math.isfinite(x)) or (least is not None and not x >= least):
        raise _damaged(f"{what} must be a finite number >= {least:g}" if finite else f"{what} out of range: {v!r}")
    return x


def _decision_from(state: Any) -> Decision | None:
    """The :class:`Decision` that :func:`_decision_state` wrote (None for none); ``ConfigurationError`` for
    anything else."""
    if state is None:
        return None
    if not isinstance(state, Mapping):
        raise _damaged(f"'decision' must be a dict, got {type(state).__name__}")
    keys = {"range", "g_ing", "g_del", "overlap", "deliver_fit", "ingest_fit", "batch_bytes", "rollout_bytes",
            "deliver_gap_s", "ingest_gap_s", "deliver_sequential", "deliver_overlapped", "ingest_sequential",
            "ingest_overlapped", "confirmed", "reason"}
    if set(state) != keys:
        raise _damaged(f"'decision' has the keys {sorted(map(str, state))}, expected {sorted(keys)}")
    r = state["range"]
    if not isinstance(r, Mapping) or set(r) != {"on_policy", "g_ing", "g_del", "num_minibatches"}:
        raise _damaged("'range' must be a dict of on_policy, g_ing, g_del and num_minibatches")
    on_policy, m = r["on_policy"], r["num_minibatches"]
    if not isinstance(on_policy, bool):
        raise _damaged(f"range.on_policy must be True or False, got {on_policy!r}")
    if m is not None and (not is_int(m) or m < 1):
        raise _damaged(f"range.num_minibatches must be None or an int >= 1, got {m!r}")

    def granularity(v: Any, what: str) -> float:
        g = _real(v, what)
        if not (0 < g <= 1 if on_policy else g >= 1 and g == int(g)):
            raise _damaged(f"{what} must be {'in (0, 1]' if on_policy else 'a whole number >= 1'}, got {v!r}")
        return g

    def granularities(v: Any, what: str) -> tuple[float, ...]:
        if not isinstance(v, (list, tuple)) or not v:
            raise _damaged(f"{what} must be a non-empty list of granularities")
        return tuple(granularity(g, what) for g in v)
    rng = GranularityRange(on_policy, granularities(r["g_ing"], "range.g_ing"),
                           granularities(r["g_del"], "range.g_del"), None if m is None else int(m))
    g_ing, g_del = granularity(state["g_ing"], "g_ing"), granularity(state["g_del"], "g_del")
    if g_ing not in rng.g_ing or g_del not in rng.g_del:
        raise _damaged(f"g_ing={g_ing:g} or g_del={g_del:g} is outside its own range ({rng.describe()})")
    if not isinstance(state["overlap"], bool):
        raise _damaged(f"overlap must be True or False, got {state['overlap']!r}")

    def fit(v: Any, what: str) -> LatencyFit | None:
        if v is None:
            return None
        names = {f.name for f in fields(LatencyFit)}
        if not isinstance(v, Mapping) or set(v) != names:
            raise _damaged(f"{what} must be None or a dict of {sorted(names)}")
        args: dict[str, Any] = {}
        for k in names:
            if k in ("calls", "sizes"):
                if not is_int(v[k]) or v[k] < 0:
                    raise _damaged(f"{what}.{k} must be an int >= 0, got {v[k]!r}")
                args[k] = int(v[k])
            else:  # (the knee is infinite when none was found; the error may be NaN on degenerate telemetry)
                args[k] = _real(v[k], f"{what}.{k}", least=None, finite=False)
        return LatencyFit(**args)

    def costs(v: Any, what: str) -> dict[float, float]:
        if not isinstance(v, (list, tuple)) or not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in v):
            raise _damaged(f"{what} must be a list of [granularity, seconds] pairs")
        return {granularity(g, what): _real(c, what) for g, c in v}
    confirmed = state["confirmed"]
    if not isinstance(confirmed, Mapping) or not all(isinstance(k, str) for k in confirmed):
        raise _damaged("'confirmed' must be a dict of seconds by configuration name")
    if not isinstance(state["reason"], str):
        raise _damaged(f"'reason' must be a str, got {type(state['reason']).__name__}")
    return Decision(rng, g_ing, g_del, state["overlap"], fit(state["deliver_fit"], "deliver_fit"),
                    fit(state["ingest_fit"], "ingest_fit"), _real(state["batch_bytes"], "batch_bytes"),
                    _real(state["rollout_bytes"], "rollout_bytes"), _real(state["deliver_gap_s"], "deliver_gap_s"),
                    _real(state["ingest_gap_s"], "ingest_gap_s"),
                    costs(state["deliver_sequential"], "deliver_sequential"),
                    costs(state["deliver_overlapped"], "deliver_overlapped"),
                    costs(state["ingest_sequential"], "ingest_sequential"),
                    costs(state["ingest_overlapped"], "ingest_overlapped"),
                    {k: _real(v, f"confirmed[{k!r}]") for k, v in confirmed.items()}, state["reason"])
