"""A small discrete-event engine: tasks with durations, dependencies and one resource each.

A task becomes *ready* when every task it depends on has finished; it then queues at its
resource (a link, a device, a lock) and runs when the resource is free, first come first
served (ties in submission order: tasks ready at the same time, also through a zero-duration task without a
resource, which ends the moment it is ready). A task without a resource runs as soon as it is ready.
:meth:`Simulation.run` returns the makespan; every task keeps its start and end, and every
resource its busy time, so a run says what was on the critical path and what was busy.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from conduit.checks import is_int, is_real

__all__ = ["Task", "Simulation"]


@dataclass(eq=False)
class Task:
    """One piece of work: ``duration`` seconds on ``resource`` once ``deps`` are done."""

    name: str
    duration: float
    resource: str | None = None
    deps: tuple[Task, ...] = ()
    start: float = float("nan")
    end: float = float("nan")
    _waiting: int = field(default=0, repr=False)
    _next: list[Task] = field(default_factory=list, repr=False)
    _seq: int = field(default=0, repr=False)


class Simulation:
    """Build tasks with :meth:`task`, then :meth:`run` them once."""

    def __init__(self) -> None:
        self.tasks: list[Task] = []
        self.busy: dict[str, float] = {}
        self._ids: set[int] = set()  # (ids of self.tasks, which holds them: a dependency is checked in O(1))
        self._ran = False

    def task(self, name: str, duration: float, resource: str | None = None, deps: Iterable[Task] = ()) -> Task:
        """Add a task (``duration``: finite seconds >= 0) and return it, to be named as a later task's dependency.

        Raises:
            ValueError: ``duration`` is no finite number >= 0, or a dependency is no task of this simulation.
        """
        if not is_real(duration) or not 0 <= duration < math.inf:
            raise ValueError(f"task {name!r} has duration {duration!r}; durations are finite seconds >= 0")
        before = tuple(deps)
        for d in before:
            if id(d) not in self._ids:  # (another simulation's task would never end here: this one would never start)
                what = f"task {d.name!r}" if isinstance(d, Task) else repr(d)
                raise ValueError(f"task {name!r} depends on {what}, which is no task of this simulation; name a "
                                 f"task that this simulation's task() returned")
        t = Task(name, float(duration), resource, before)
        t._seq = len(self.tasks)
        self.tasks.append(t)
        self._ids.add(id(t))
        return t

    def run(self) -> float:
        """Simulate every task; returns the time the last one ends (0 with no tasks)."""
        if self._ran:
            raise RuntimeError("a Simulation runs once; build a new one")
        self._ran = True
        for t in self.tasks:
            t._waiting = len(t.deps)
            for d in t.deps:
                d._next.append(t)
        queues: dict[str, deque[Task]] = {}
        free: dict[str, bool] = {}
        events: list[tuple[float, int, Task]] = []
        now = 0.0

        def start(t: Task, at: float) -> None:
            t.start, t.end = at, at + t.duration
            heapq.heappush(events, (t.end, t._seq, t))

        def ready(t: Task, at: float) -> None:
            if t.resource is None:
                start(t, at)
                return
            if free.get(t.resource, True):
                free[t.resource] = False
                start(t, at)
            else:
                queues.setdefault(t.resource, deque()).append(t)

        done = 0

        def settle(became: list[Task], at: float) -> None:
            # tasks ready at ``at``: a zero-duration task without a resource ends at once, so what it makes
            # ready is ready at ``at`` too; then all of them take their resources in submission order
            nonlocal done
            stack, out = list(became), []
            while stack:
                t = stack.pop()
                if t.resource is None and t.duration == 0.0:
                    t.start = t.end = at
                    done += 1
                    for nxt in t._next:
                        nxt._waiting -= 1
                        if nxt._waiting == 0:
                            stack.append(nxt)
                else:
                    out.append(t)
            for t in sorted(out, key=lambda x: x._seq):
                ready(t, at)

        settle([t for t in self.tasks if not t.deps], 0.0)
        while events:
            # every task ending at ``now`` first (queued tasks take the resources they free), then the
            # tasks this made ready, in submission order (ties at a resource: submission order)
            now = events[0][0]
            became: list[Task] = []
            while events and events[0][0] == now:
                _, _, t = heapq.heappop(events)
                done += 1
                if t.resource is not None:
                    self.busy[t.resource] = self.busy.get(t.resource, 0.0) + t.duration
                    q = queues.get(t.resource)
                    if q:
                        start(q.popleft(), now)
                    else:
                        free[t.resource] = True
                for nxt in t._next:
                    nxt._waiting -= 1
                    if nxt._waiting == 0:
                        became.append(nxt)
            settle(became, now)
        if done != len(self.tasks):  # pragma: no cover - deps are built from earlier tasks, so no cycles
            raise RuntimeError("some tasks never became ready (a dependency cycle)")
        return now

    def busiest(self, k: int = 3) -> list[tuple[str, float]]:
        """The ``k`` resources busy longest (name, seconds; all of them when there are fewer).

        Raises:
            ValueError: ``k`` is no int >= 0 (a negative one would cut that many off the end instead).
        """
        if not is_int(k) or k < 0:
            raise ValueError(f"Simulation.busiest(k={k!r}) is how many of the busiest resources to list; pass an "
                             f"int >= 0")
        return sorted(self.busy.items(), key=lambda kv: -kv[1])[:k]
