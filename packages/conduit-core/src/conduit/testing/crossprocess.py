"""Determinism across processes: the same seed and calls draw the same items in every Python process.

The suites' ``test_deterministic_under_seed`` compares draws made inside one process. Python randomises
``hash()`` of ``str`` and ``bytes`` per process (``PYTHONHASHSEED``), so an endpoint that derives a seed from
``hash("...")``, or an order from iterating a ``set`` of strings, draws the same twice in one process and
differently in the next run. This module replays that test's calls in fresh ``sys.executable`` processes, each
with its own ``PYTHONHASHSEED`` (inherited by whatever they start, e.g. a Ray cluster's workers), and compares
what they drew.

The endpoint is rebuilt in the subprocess from its :class:`~conduit.testing.EndpointFactory`, named either by
the name it is registered under (the ``conduit.conformance`` entry-point group) or as ``"module:attribute"``
(an importable module holding the factory, e.g. a test module's mutant). The subprocess makes, for every kind
the factory builds:

* ``replay/uniform`` and, when the endpoint declares ``CAP_PRIORITIZED``, ``replay/prioritized``: a buffer of
  capacity 64 with seed 7, ids ``0..49`` then ``50..99`` inserted, 5 draws of 32 (:func:`replay_draws`; a
  prioritized endpoint that declares ``priority_staleness`` 0 gets a priority update after each draw);
* ``on_policy``: 4 minibatches x 3 epochs with seed 5, rollouts of ids ``0..39`` (version 0) and
  ``100..139`` (version 1), each delivered whole (:func:`on_policy_deliveries`);

exactly the calls of ``ReplaySuite.test_deterministic_under_seed`` and ``FreshnessSuite.test_deterministic_under_seed``
(which use these functions), and prints them as JSON. ``integration-tests/`` compares two such processes for
every registered adapter; an adapter's own tests may call :func:`assert_deterministic_across_processes` with its
name. A pair of processes costs what two fresh imports of the adapter cost (a few seconds; a multi-node endpoint
also starts a local Ray cluster in each, or joins this process's shared one as a job of its own when it runs:
``conduit.distributed.testing.SHARED_CLUSTER_ENV``). A subprocess connected to Ray also reports ``hash()`` of one
string from a worker of its Ray job, and the check requires it to equal the subprocess's own
(:meth:`ProcessDraws.check_hash_seed`): workers with another hash seed would hide what the check is for.

A subprocess dies with the process that started it (on Linux: ``PR_SET_PDEATHSIG``; elsewhere on posix a watchdog
thread that sees it re-parented ends its process group), so a parent killed outright (a test runner's SIGKILL)
leaves no subprocess hanging for ever in its own session.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from conduit.testing.endpoints import CAP_PRIORITIZED, EndpointFactory, OnPolicyEndpoint, ReplayEndpoint
from conduit.testing.suites.base import draw, staleness

__all__ = ["ProcessDraws", "draws_in_subprocess", "assert_deterministic_across_processes", "replay_draws",
           "fill_replay", "replay_call", "on_policy_deliveries", "deliver_rollout", "resolve_factory", "HASH_SEEDS",
           "TIMEOUT_S", "REPLAY_SEED", "ON_POLICY_SEED", "ENTRIES", "EXIT_GRACE_S"]

#: the ``PYTHONHASHSEED`` values of the two processes :func:`assert_deterministic_across_processes` compares
HASH_SEEDS = (1, 2)
#: how long one subprocess may take by default, in seconds (start-up included: a multi-node endpoint starts a Ray
#: cluster); read at each call, so a slow machine's test set-up may raise it
TIMEOUT_S = 300.0
#: the seed of the replay endpoints of the determinism checks
REPLAY_SEED = 7
#: the seed of the on-policy endpoints of the determinism checks
ON_POLICY_SEED = 5
#: replay draws: ``REPLAY_CALLS`` sample calls of ``REPLAY_DRAW`` items each
REPLAY_CALLS, REPLAY_DRAW = 5, 32
#: how long a subprocess that reported its draws may take to exit, in seconds (a Ray cluster's shutdown included);
#: past it the subprocess is killed and the check fails: something its endpoints started outlives ``close()``
EXIT_GRACE_S = 60.0
#: how much of a failed subprocess's stderr an assertion message quotes
STDERR_TAIL = 3000
#: what the subprocess draws, in this order (an entry is left out for a kind the factory does not build)
ENTRIES = ("replay/uniform", "replay/prioritized", "on_policy")
#: the line prefix under which the subprocess prints its JSON result (anything else on stdout is ignored)
_MARK = "CONDUIT-CROSSPROCESS-RESULT "
#: the signals on which the subprocess prints the stacks of its threads (``faulthandler``'s)
_CRASHES = {getattr(signal, n) for n in ("SIGSEGV", "SIGFPE", "SIGABRT", "SIGBUS", "SIGILL") if hasattr(signal, n)}
#: the string whose ``hash()`` the subprocess reports from itself and from the Ray workers of its job
_HASH_PROBE = "conduit-crossprocess"


# -- the script: the calls of the in-process determinism tests --------------------------------------------------
def fill_replay(ep: ReplayEndpoint) -> ReplayEndpoint:
    """Insert the determinism checks' items into ``ep``: ids ``0..49``, then ``50..99``, in two calls."""
    ep.insert(np.arange(50))
    ep.insert(np.arange(50, 100))
    return ep


def replay_call(ep: ReplayEndpoint, *, prioritized: bool) -> list[int]:
    """One of the determinism checks' sample calls on ``ep``: the ids of a draw of 32. A prioritized endpoint that
    declares ``priority_staleness`` 0 then gets the drawn items' priorities set to ``id % 7 + 1``, so the later
    draws follow priorities the updates set (an endpoint that prefetches draws ahead of the updates is left out:
    which draw sees an update may follow its worker's timing)."""
    d = draw(ep, REPLAY_DRAW)
    if prioritized and staleness(ep) == 0:
        ep.update_priorities(d.handles, (d.ids % 7 + 1).astype(np.float64))
    return [int(i) for i in d.ids.tolist()]


def replay_draws(make_replay: Callable[..., ReplayEndpoint], *, prioritized: bool,
                 seed: int = REPLAY_SEED) -> list[int]:
    """The ids a new endpoint ``make_replay(capacity=64, prioritized=..., seed=...)`` draws in 5 calls of
    :func:`replay_call` after :func:`fill_replay`, in draw order (the endpoint is closed afterwards)."""
    ep = make_replay(capacity=64, prioritized=prioritized, seed=seed)
    try:
        fill_replay(ep)
        return [i for _ in range(REPLAY_CALLS) for i in replay_call(ep, prioritized=prioritized)]
    finally:
        ep.close()


def deliver_rollout(ep: OnPolicyEndpoint, v: int) -> list[tuple[int, list[int]]]:
    """Set the policy to version ``v``, ingest ids ``100 v .. 100 v + 39`` as version ``v``'s rollout, end it and
    consume it: ``(epoch, ids)`` of each minibatch, in delivery order."""
    ep.set_policy_version(v)
    ep.ingest(np.arange(100 * v, 100 * v + 40), version=v)
    ep.end_rollout()
    return [(int(mb.epoch), [int(i) for i in mb.ids.tolist()]) for mb in ep.consume()]


def on_policy_deliveries(make_on_policy: Callable[..., OnPolicyEndpoint], *,
                         seed: int = ON_POLICY_SEED) -> list[tuple[int, list[int]]]:
    """The minibatches a new endpoint ``make_on_policy(num_minibatches=4, num_epochs=3, seed=...)`` delivers for
    the rollouts of versions 0 and 1 (:func:`deliver_rollout`), in delivery order (closed afterwards)."""
    ep = make_on_policy(num_minibatches=4, num_epochs=3, seed=seed)
    try:
        return deliver_rollout(ep, 0) + deliver_rollout(ep, 1)
    finally:
        ep.close()


def resolve_factory(spec: str) -> EndpointFactory:
    """The :class:`EndpointFactory` named by ``spec``: ``"module:attribute"`` (imported), or the name a factory is
    registered under in the ``conduit.conformance`` entry-point group (only the entry point of that name is loaded
    when it holds the factory; otherwise every registered factory is, through ``discover_endpoints``).

    Raises:
        LookupError: no registered factory has that name (the message lists the names there are).
        TypeError: ``module:attribute`` is not an :class:`EndpointFactory`.
    """
    if ":" in spec:
        module, _, attr = spec.partition(":")
        obj: Any = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
        if not isinstance(obj, EndpointFactory):
            raise TypeError(f"{spec} is of type {type(obj).__name__}, not a conduit.testing.EndpointFactory: name the "
                            f"factory object (module:attribute) or a registered factory's name")
        return obj
    from importlib.metadata import entry_points

    from conduit.testing.endpoints import discover_endpoints

    for ep in entry_points(group="conduit.conformance", name=spec):
        factory = ep.load()
        if isinstance(factory, EndpointFactory) and factory.name == spec:
            return factory
    found = discover_endpoints()
    for factory in found:
        if factory.name == spec:
            return factory
    raise LookupError(f"no EndpointFactory named {spec!r} is registered under 'conduit.conformance' (registered: "
                      f"{sorted(f.name for f in found)}); install the adapter, or name the factory as "
                      f"'module:attribute'")


def _script(spec: str) -> dict[str, Any]:
    """Run the determinism calls on the factory ``spec`` names: its name, and per entry the draws or the error."""
    factory = resolve_factory(spec)
    out: dict[str, Any] = {"factory": factory.name, "draws": {}, "errors": {}}

    def attempt(entry: str, run: Callable[[], Any]) -> None:
        try:
            out["draws"][entry] = run()
        except Exception as e:  # noqa: BLE001 - reported to the parent, which fails the test with it
            traceback.print_exc()
            out["errors"][entry] = f"{type(e).__name__}: {e}"

    make_replay, make_on_policy = factory.make_replay, factory.make_on_policy
    if make_replay is not None:
        attempt("replay/uniform", lambda: replay_draws(make_replay, prioritized=False))

        def prioritized() -> list[int] | None:
            probe = make_replay(capacity=64, prioritized=True, seed=REPLAY_SEED)
            try:
                caps: frozenset[str] = getattr(probe, "capabilities", frozenset())
            finally:
                probe.close()
            return replay_draws(make_replay, prioritized=True) if CAP_PRIORITIZED in caps else None

        attempt("replay/prioritized", prioritized)
        if out["draws"].get("replay/prioritized", ()) is None:
            del out["draws"]["replay/prioritized"]
    if make_on_policy is not None:
        attempt("on_policy", lambda: on_policy_deliveries(make_on_policy))
    out["hashes"] = _hashes()
    return out


def _probe_hash() -> int:
    return hash(_HASH_PROBE)


def _hashes() -> dict[str, int]:
    """``hash()`` of a fixed string in this process and, when the endpoints connected it to Ray, in a task of its
    Ray job (the job's workers, e.g. shard servers, draw with that hash seed)."""
    out = {"process": _probe_hash()}
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        out["ray worker"] = int(ray.get(ray.remote(num_cpus=0)(_probe_hash).remote(), timeout=120))
    return out


def _main(argv: Sequence[str]) -> int:
    """The subprocess's entry: ``argv == [spec]``; prints the result line; exit status 0 once it printed it."""
    (spec,) = argv
    result = _script(spec)
    sys.stdout.write(_MARK + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


# -- the parent: start, collect, compare ------------------------------------------------------------------------
@dataclass
class ProcessDraws:
    """What one subprocess drew: per entry (``replay/uniform``, ``replay/prioritized``, ``on_policy``) the draws,
    or the error the entry raised there."""

    #: the factory as the caller named it, and the ``EndpointFactory.name`` it resolved to
    spec: str
    factory: str
    hash_seed: str
    draws: dict[str, Any] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    #: the end of the subprocess's stderr (tracebacks of the errors among it)
    stderr_tail: str = ""
    #: ``hash()`` of one string in the subprocess (``"process"``) and, when its endpoints connected it to Ray, in a
    #: worker of its Ray job (``"ray worker"``)
    hashes: dict[str, int] = field(default_factory=dict)

    def check_hash_seed(self) -> None:
        """The subprocess's Ray workers hash as the subprocess does; ``AssertionError`` otherwise.

        Workers started with another ``PYTHONHASHSEED`` (e.g. those of a cluster the subprocess joined, when the
        job does not pass its seed on through ``runtime_env``) would make the comparison of two processes compare
        workers that share one hash seed, and miss what the check is for.
        """
        own = self.hashes.get("process")
        for where, h in self.hashes.items():
            assert h == own, (
                f"adapter {self.factory!r} ({self.spec}): in the subprocess with PYTHONHASHSEED={self.hash_seed}, "
                f"hash() in its {where} differs from the subprocess's own: that {where} runs with another "
                f"PYTHONHASHSEED, so the check across processes cannot see what depends on it there. Start or join "
                f"the cluster with the process's seed (ray.init(runtime_env={{'env_vars': {{'PYTHONHASHSEED': "
                f"os.environ['PYTHONHASHSEED']}}}}))")

    def get(self, entry: str) -> Any:
        """The draws of ``entry``; ``AssertionError`` with the subprocess's error and stderr tail when it failed."""
        if entry in self.errors:
            raise AssertionError(
                f"adapter {self.factory!r} ({self.spec}), {entry}: the determinism calls failed in a subprocess with "
                f"PYTHONHASHSEED={self.hash_seed}: {self.errors[entry]}\n--- stderr tail ---\n{self.stderr_tail}")
        return self.draws[entry]

    def entries(self, kind: str) -> list[str]:
        """The entries of ``kind`` (``"replay"`` or ``"on_policy"``) the subprocess made, drawn or failed."""
        return [e for e in ENTRIES if e.split("/")[0] == kind and (e in self.draws or e in self.errors)]


@dataclass
class _Started:
    spec: str
    hash_seed: str
    proc: subprocess.Popen[bytes]
    stdout: IO[bytes]
    stderr: IO[bytes]


def _import_root(spec: str) -> str | None:
    """For ``module:attribute``, the directory this process imports ``module``'s top level from (so a test module
    that is importable here through a ``sys.path`` entry added at run time is importable in the subprocess)."""
    if ":" not in spec:
        return None
    top = spec.partition(":")[0].split(".")[0]
    try:
        found = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if found is None or not found.origin or not found.has_location:
        return None
    origin = Path(found.origin).resolve()
    return str(origin.parent.parent if found.submodule_search_locations is not None else origin.parent)


#: the subprocess's first statements: it dies with its parent (process ``{parent}``). On Linux the kernel sends it
#: SIGKILL when the parent (the thread that started it, which waits for it) ends; elsewhere on posix a daemon thread
#: checks every half second whether it was re-parented, then kills its process group. Either way a parent that died
#: before this ran is noticed at once (the subprocess was re-parented already)
_PARENT_DEATH = (
    "import os as _os, signal as _signal, sys as _sys, threading as _threading, time as _time\n"
    "if _sys.platform.startswith('linux'):\n"
    "    import ctypes as _ctypes\n"
    "    _ctypes.CDLL(None, use_errno=True).prctl(1, _signal.SIGKILL)  # PR_SET_PDEATHSIG\n"
    "elif _os.name == 'posix':\n"
    "    def _watch():\n"
    "        while _os.getppid() == {parent}:\n"
    "            _time.sleep(0.5)\n"
    "        _os.killpg(_os.getpgrp(), _signal.SIGKILL)\n"
    "    _threading.Thread(target=_watch, name='conduit-parent-watch', daemon=True).start()\n"
    "if _os.name == 'posix' and _os.getppid() != {parent}:\n"
    "    _os._exit(1)\n"
)


def _start(spec: str, hash_seed: int | str) -> _Started:
    env = dict(os.environ, PYTHONHASHSEED=str(hash_seed))
    root = _import_root(spec)
    if root is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    # it dies with this process first (see _PARENT_DEATH; its own session would otherwise outlive a killed parent);
    # a crash (a signal) prints the Python stack of every thread; on posix SIGUSR1 prints them too (sent at a
    # timeout), registered before anything slow is imported
    code = (_PARENT_DEATH.format(parent=os.getpid()) + "import faulthandler, signal, sys; faulthandler.enable(); "
            "hasattr(signal, 'SIGUSR1') and faulthandler.register(signal.SIGUSR1, all_threads=True); "
            "from conduit.testing.crossprocess import _main; sys.exit(_main(sys.argv[1:]))")
    out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    try:
        proc = subprocess.Popen([sys.executable, "-c", code, spec], stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                env=env, start_new_session=True)
    except BaseException:
        out.close()
        err.close()
        raise
    return _Started(spec, str(hash_seed), proc, out, err)


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """End the subprocess and what it started (a Ray cluster's processes share its session)."""
    try:
        if os.name == "posix":
            os.killpg(proc.pid, signal.SIGKILL)
        else:  # pragma: no cover - no process groups
            proc.kill()
    except ProcessLookupError:
        pass
    proc.wait()


def _reported(stdout: IO[bytes]) -> bool:
    """Whether the subprocess printed its result line (to ``stdout``, the file it writes its stdout to). Read with
    ``pread``, which leaves the file offset it shares with the running subprocess alone (always ``False`` where
    there is none)."""
    if not hasattr(os, "pread"):  # pragma: no cover - posix has it
        return False
    fd = stdout.fileno()
    return _MARK.encode() in os.pread(fd, os.fstat(fd).st_size, 0)


def _wait(s: _Started, deadline: float) -> tuple[int | None, bool]:
    """Wait for the subprocess to exit, until ``deadline``, or :data:`EXIT_GRACE_S` after it reported its draws:
    its exit status (``None``: it did not exit, and was killed, with what it started) and whether it reported.
    At a timeout it first prints the stacks of its threads (SIGUSR1, see :func:`_start`)."""
    grace_end = None
    while True:
        now = time.monotonic()
        end = deadline if grace_end is None else min(deadline, grace_end)
        try:
            return s.proc.wait(timeout=max(0.0, min(end - now, 0.5))), _reported(s.stdout)
        except subprocess.TimeoutExpired:
            pass
        if grace_end is None and _reported(s.stdout):
            grace_end = time.monotonic() + EXIT_GRACE_S
        if time.monotonic() >= end:
            break
    if hasattr(signal, "SIGUSR1"):
        try:
            os.kill(s.proc.pid, signal.SIGUSR1)
            s.proc.wait(timeout=1)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    _kill(s.proc)
    return None, _reported(s.stdout)


def _collect(s: _Started, deadline: float) -> ProcessDraws:
    try:
        try:
            rc, reported = _wait(s, deadline)
        except BaseException:
            _kill(s.proc)
            raise
        s.stdout.seek(0)
        s.stderr.seek(0)
        stdout = s.stdout.read().decode(errors="replace")
        tail = s.stderr.read().decode(errors="replace")[-STDERR_TAIL:]
    finally:
        s.stdout.close()
        s.stderr.close()
    what = f"the determinism calls on {s.spec!r} in a subprocess with PYTHONHASHSEED={s.hash_seed}"
    stacks = "the stacks of its Python threads just before the kill end the stderr tail"
    if rc is None and reported:
        raise AssertionError(
            f"{what} reported its draws, then did not exit (killed after EXIT_GRACE_S = {EXIT_GRACE_S:g} s, or at the "
            f"timeout): something its endpoints started outlives their close() (a non-daemon thread, a child process, "
            f"a Ray job that does not end); {stacks}\n--- stderr tail ---\n{tail}")
    if rc is None:
        raise AssertionError(f"{what} did not finish within the timeout (killed); {stacks}. If the endpoint is "
                             f"that slow to build, raise conduit.testing.crossprocess.TIMEOUT_S"
                             f"\n--- stderr tail ---\n{tail}")
    lines = [ln for ln in stdout.splitlines() if ln.startswith(_MARK)]
    if rc != 0 or not lines:
        how = f"exit status {rc}"
        if rc < 0:
            try:
                sig = signal.Signals(-rc)
            except ValueError:
                sig = None
            if sig is not None:
                how = f"killed by signal {sig.name}" + (
                    "; the stacks of its threads at the crash are in the stderr tail" if sig in _CRASHES else "")
        raise AssertionError(f"{what} failed ({how}) before reporting its draws"
                             f"\n--- stderr tail ---\n{tail}")
    result = json.loads(lines[-1][len(_MARK):])
    return ProcessDraws(s.spec, result["factory"], s.hash_seed, result["draws"], result["errors"], tail,
                        result.get("hashes", {}))


def draws_in_subprocess(factory: str, *, hash_seed: int | str, timeout: float | None = None) -> ProcessDraws:
    """Run the determinism calls (see the module docstring) on a fresh endpoint of ``factory`` (a registered
    factory name, or ``"module:attribute"``) in a new ``sys.executable`` process with ``PYTHONHASHSEED=hash_seed``.

    The subprocess inherits this process's environment; for ``module:attribute`` the directory this process
    imports the module from is put first on its ``PYTHONPATH``. An entry that raised there is reported in
    :attr:`ProcessDraws.errors` (and raises on :meth:`ProcessDraws.get`).

    Raises:
        AssertionError: the subprocess did not finish within ``timeout`` seconds (default :data:`TIMEOUT_S`), or
            did not exit within :data:`EXIT_GRACE_S` of reporting its draws (it is killed, with what it started,
            after printing the stacks of its threads), or exited without reporting (e.g. the factory could not be
            resolved, or it crashed: the stacks at the crash are printed); the message quotes the end of its
            stderr.
    """
    return _collect(_start(factory, hash_seed), time.monotonic() + (TIMEOUT_S if timeout is None else timeout))


def _runs(factory: str, hash_seeds: Sequence[int | str], timeout: float | None) -> list[ProcessDraws]:
    """:func:`draws_in_subprocess` for each of ``hash_seeds``, the processes run at once (the first failure raises,
    once every process ended)."""
    started: list[_Started] = []
    try:
        for h in hash_seeds:
            started.append(_start(factory, h))
    except BaseException:
        for s in started:
            _kill(s.proc)
        raise
    deadline = time.monotonic() + (TIMEOUT_S if timeout is None else timeout)
    results: list[ProcessDraws] = []
    failure: AssertionError | None = None
    try:
        for s in started:
            try:
                results.append(_collect(s, deadline))
            except AssertionError as e:
                failure = failure or e
    except BaseException:  # interrupted: end the processes not collected yet
        for s in started:
            if s.proc.poll() is None:
                _kill(s.proc)
        raise
    if failure is not None:
        raise failure
    return results


def _first_difference(a: Any, b: Any, path: tuple[int, ...] = ()) -> tuple[tuple[int, ...], Any, Any] | None:
    """Where two JSON values first differ: the index path and the two values there (``None`` when equal)."""
    if isinstance(a, list) and isinstance(b, list):
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            d = _first_difference(x, y, (*path, i))
            if d is not None:
                return d
        if len(a) != len(b):
            return (*path, min(len(a), len(b))), f"{len(a)} elements", f"{len(b)} elements"
        return None
    return None if a == b else (path, a, b)


def _where(entry: str, path: tuple[int, ...], draws: Any) -> str:
    """``path`` (from :func:`_first_difference`) in words."""
    if entry.startswith("replay") and len(path) == 1:
        i = path[0]
        return f"position {i} (sample call {i // REPLAY_DRAW}, row {i % REPLAY_DRAW})"
    if entry == "on_policy" and path:
        k = path[0]
        mb = draws[k] if k < len(draws) else None
        head = f"minibatch {k}" + (f" (epoch {mb[0]})" if isinstance(mb, list) and mb else "")
        if len(path) == 3:
            return f"{head}, position {path[2]}"
        return head + (", its epoch" if path[1:] == (0,) else "")
    return f"position {list(path)}"


def assert_deterministic_across_processes(factory: str, kind: str | None = None, *,
                                          hash_seeds: Sequence[int | str] = HASH_SEEDS,
                                          timeout: float | None = None) -> None:
    """The determinism calls draw the same in fresh processes with the ``hash_seeds`` (``PYTHONHASHSEED``) as each
    other: those of ``kind`` (``"replay"``: uniform and, when declared, prioritized; ``"on_policy"``), or with
    ``kind`` None those of every kind the factory builds. The processes run at once, one per hash seed.

    Raises:
        AssertionError: the draws differ (the message names the adapter, the entry, the first differing position
            and the values there), the processes made different entries (e.g. one declared ``CAP_PRIORITIZED``,
            the other not), the factory builds no endpoint of ``kind``, a subprocess's Ray workers run with
            another hash seed than the subprocess (:meth:`ProcessDraws.check_hash_seed`), or a subprocess failed
            (see :func:`draws_in_subprocess`).
        ValueError: ``kind`` is none of the kinds, or ``hash_seeds`` holds fewer than two different seeds.
    """
    if kind not in (None, "replay", "on_policy"):
        raise ValueError(f"kind={kind!r}: pass 'replay', 'on_policy' or None (every kind)")
    if len({str(h) for h in hash_seeds}) < 2:
        raise ValueError(f"hash_seeds={tuple(hash_seeds)!r}: pass at least two different PYTHONHASHSEED values (one "
                         f"process, or processes with one seed, compare nothing that hash() changes)")
    runs = _runs(factory, hash_seeds, timeout)
    for run in runs:
        run.check_hash_seed()
    first = runs[0]

    def made(run: ProcessDraws) -> list[str]:
        return run.entries(kind) if kind is not None else run.entries("replay") + run.entries("on_policy")

    entries = made(first)
    what = f"{kind} endpoint (its EndpointFactory.make_{kind} is None)" if kind else "endpoint"
    assert entries, f"adapter {first.factory!r} ({factory}) builds no {what}: nothing to compare across processes"
    for other in runs[1:]:
        assert made(other) == entries, (
            f"adapter {first.factory!r}: the process with PYTHONHASHSEED={first.hash_seed} made {entries}, the one "
            f"with PYTHONHASHSEED={other.hash_seed} {made(other)}: the endpoints declare other capabilities (e.g. "
            f"CAP_PRIORITIZED) in another process; derive them from nothing that hash() changes")
    for entry in entries:
        a = first.get(entry)
        for other in runs[1:]:
            b = other.get(entry)
            d = _first_difference(a, b)
            if d is None:
                continue
            path, x, y = d
            raise AssertionError(
                f"adapter {first.factory!r}, {entry}: the same seed and calls drew differently in two processes "
                f"(PYTHONHASHSEED={first.hash_seed} and {other.hash_seed}), first at {_where(entry, path, a)}: "
                f"{x!r} vs {y!r}. Python randomises hash() of str and bytes per process: derive no seed from "
                f"hash() of a string (use zlib.crc32 or hashlib), and no order from iterating a set of strings "
                f"(sort it)")
