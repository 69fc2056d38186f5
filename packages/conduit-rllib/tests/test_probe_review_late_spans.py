"""A wrapped experience-path call still running when :meth:`ExperiencePathProbe.take` closes a window ("a late span").

Before the fix such a call was credited, whole, to the window in which it ended: the window it ran in read 0 for
it, the next one its whole duration (more than that window's time), and a Conduit worker's span the loop waited
for inside it counted as hidden in the window it ran in. The call is timed here through the probe's own wrapping
(``_timed``, what every wrapped RLlib method runs), on a real thread that blocks until the test lets it go, so
that it is in flight, for certain, while ``take()`` runs. Assertions are on recorded values and on bounds made
of clock readings around the calls, never on how long anything took.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from conduit.exposure import WORK_KINDS
from conduit.telemetry import CallRecord, Telemetry, thread_id
from conduit_rllib.compare import Variant
from conduit_rllib.profiling import CONTEXT, PARTS


class _Blocked:
    """A wrapped call on a thread of its own that blocks until :meth:`finish` (clock readings taken around it)."""

    def __init__(self, probe: Any, parts: tuple[str, ...]) -> None:
        self.entered, self.go = threading.Event(), threading.Event()
        self.t: dict[str, float] = {}
        self.ident: list[int] = []

        def innermost() -> None:
            self.t["in"] = time.perf_counter()
            self.entered.set()
            self.go.wait()
            self.t["out"] = time.perf_counter()

        def nest(i: int) -> Callable[[], None]:
            if i == len(parts):
                return innermost
            return lambda: probe._timed(parts[i], nest(i + 1))

        def run() -> None:
            self.ident.append(thread_id())
            self.t["call"] = time.perf_counter()
            nest(0)()
            self.t["ret"] = time.perf_counter()

        self.thread = threading.Thread(target=run, name="conduit-test-loop")
        self.thread.start()
        self.entered.wait()

    def finish(self) -> None:
        self.go.set()
        self.thread.join()


def _accounted(p: dict[str, float]) -> float:
    return sum(p[k] for k in PARTS if k in p) + sum(p[k] for k in CONTEXT)


def test_a_call_running_across_take_is_split_between_the_windows_it_ran_in(conduit_variant: Variant) -> None:
    probe = conduit_variant.probe
    opened = time.perf_counter()
    probe.take()
    call = _Blocked(probe, ("sample",))
    before_a = time.perf_counter()
    a = probe.take()  # the call is in flight: its part so far belongs to this window
    after_a = time.perf_counter()
    call.finish()
    b = probe.take()
    after_b = time.perf_counter()
    t = call.t
    assert a["sample"] >= before_a - t["in"] > 0, f"the window the call ran in reads {a['sample']} for it: {a}"
    assert b["sample"] <= t["ret"] - before_a, (f"the next window took {b['sample']:.6f} s of it, more than the "
                                                f"{t['ret'] - before_a:.6f} s it ran after that window began")
    assert t["out"] - t["in"] <= a["sample"] + b["sample"] <= t["ret"] - t["call"], "each moment counts once"
    # no window accounts for more time than it lasted
    assert _accounted(a) <= after_a - opened and _accounted(b) <= after_b - before_a, (a, b)


def test_nested_calls_running_across_take_keep_their_exclusive_times(conduit_variant: Variant) -> None:
    probe = conduit_variant.probe
    probe.take()
    call = _Blocked(probe, ("update", "minibatch"))  # a learner update waiting in a minibatch's next()
    before_a = time.perf_counter()
    a = probe.take()
    call.finish()
    b = probe.take()
    t = call.t
    assert a["minibatch"] >= before_a - t["in"] > 0, a
    assert b["minibatch"] <= t["ret"] - before_a, b
    both = a["minibatch"] + b["minibatch"]
    assert t["out"] - t["in"] <= both <= t["ret"] - t["call"]
    # the update's own time is only what lies outside its minibatch: the moments before and after it
    assert 0 <= a["update"] + b["update"] <= (t["ret"] - t["call"]) - (t["out"] - t["in"])
    assert 0 <= a["update"] and 0 <= b["update"]


def test_worker_work_the_loop_waits_for_in_a_call_still_running_is_not_hidden(conduit_variant: Variant) -> None:
    probe = conduit_variant.probe
    edp = probe.buffer.edp
    since = time.perf_counter()
    probe.take()
    call = _Blocked(probe, ("sample",))  # the loop waits in sample() ...
    worker: list[int] = []

    def gather() -> None:  # ... for a worker's gather, which ends before the window does (the call does not)
        worker.append(thread_id())
        with edp.telemetry.span("deliver"):
            time.sleep(0.01)

    w = threading.Thread(target=gather, name="conduit-test-worker")
    w.start()
    w.join()
    a = probe.take()
    until = time.perf_counter()
    call.finish()
    probe.take()
    gathers = [r for r in edp.telemetry.records if r.thread == worker[0] and r.kind == "deliver"]
    assert len(gathers) == 1 and gathers[0].start > call.t["in"]
    # other work off the loop in the window (Conduit's own workers), outside the loop's wait: hidden, as it should be
    others = sorted((max(r.start, since), min(r.end, call.t["in"])) for r in edp.telemetry.records
                    if r.kind in WORK_KINDS and r.thread not in (worker[0], call.ident[0])
                    and r.thread not in probe._loop_threads and r.end > since and r.start < call.t["in"])
    other = sum(max(0.0, b - a_) for a_, b in others)
    assert a["background"] <= other + 1e-9, (
        f"the worker's gather ran wholly while the loop waited in sample(): exposed, not hidden; background="
        f"{a['background']:.6f} s with {other:.6f} s of other work off the loop ({a})")
    assert until > since


class _LetGoWhenRead(Telemetry):
    """The data plane's telemetry, real, that lets a blocked wrapped call end the first time take() reads the calls
    recorded in its window: a call that ends while take() measures the window's background time."""

    def __init__(self, call: _Blocked) -> None:
        super().__init__()
        self.call: _Blocked | None = call

    def calls_since(self, since: int) -> tuple[list[CallRecord], int]:
        call, self.call = self.call, None
        if call is not None:
            call.finish()
        return super().calls_since(since)


def test_a_call_that_ends_while_take_measures_the_window_is_not_lost(conduit_variant: Variant) -> None:
    probe = conduit_variant.probe
    edp = probe.buffer.edp
    probe.take()
    call = _Blocked(probe, ("sample",))
    own = edp.telemetry
    edp.telemetry = _LetGoWhenRead(call)  # (the probe reads a telemetry new in this window from its first mark)
    try:
        a = probe.take()
        assert not call.thread.is_alive(), "the call ended inside take()"
        b = probe.take()
    finally:
        edp.telemetry = own
    t = call.t
    assert t["out"] - t["in"] <= a["sample"] + b["sample"] <= t["ret"] - t["call"], (
        f"the call ran {t['out'] - t['in']:.6f} s, the windows account for {a['sample'] + b['sample']:.6f} s of it")
