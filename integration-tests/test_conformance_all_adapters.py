"""The conformance suites over every adapter registered in ``conduit.conformance``.

Each registered factory gets its own test classes, generated here, so a failure names the
adapter. Core registers itself too, so this module always runs something. A factory that
cannot build one kind of endpoint gets a skipped test saying so, and a package under
``packages/`` that registers nothing (or is not installed) fails here instead of going untested.
Each adapter's seeded draws are also compared across two fresh processes with other
``PYTHONHASHSEED`` values (the suites' determinism tests can only look inside one).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conduit.testing import (
    CAP_CHECKPOINT,
    CAP_CHECKPOINT_BETWEEN_ROLLOUTS,
    CAP_CONCURRENT_INGEST,
    CAP_PRIORITIZED,
    ConcurrencySuite,
    EndpointFactory,
    FreshnessSuite,
    ReplaySuite,
    assert_deterministic_across_processes,
    discover_endpoints,
)

ROOT = Path(__file__).resolve().parents[1]
FACTORIES = discover_endpoints()


def _bind(make: Any) -> Any:
    def method(self: object, **kwargs: Any) -> Any:
        return make(**kwargs)
    return method


def _not_provided(name: str, kind: str) -> type:
    def test_not_provided(self: object) -> None:
        pytest.skip(f"adapter {name!r} registers no {kind} endpoint (its EndpointFactory.make_{kind} is None)")
    return type(f"Test{kind.title().replace('_', '')}_{name}", (), {"test_not_provided": test_not_provided})


def suite_classes(factories: Iterable[EndpointFactory]) -> dict[str, type]:
    """The test classes for ``factories``: the replay, concurrency and freshness suites bound to each
    factory's endpoints, or, for a kind a factory leaves ``None``, a class whose one test skips with
    that reason (so the report shows what was not tested)."""
    out: dict[str, type] = {}
    for f in factories:
        if f.make_replay is not None:
            for suite, label in ((ReplaySuite, "Replay"), (ConcurrencySuite, "Concurrency")):
                out[f"Test{label}_{f.name}"] = type(f"Test{label}_{f.name}", (suite,),
                                                    {"make_replay": _bind(f.make_replay)})
        else:
            out[f"TestReplay_{f.name}"] = _not_provided(f.name, "replay")
        if f.make_on_policy is not None:
            out[f"TestFreshness_{f.name}"] = type(f"TestFreshness_{f.name}", (FreshnessSuite,),
                                                  {"make_on_policy": _bind(f.make_on_policy)})
        else:
            out[f"TestOnPolicy_{f.name}"] = _not_provided(f.name, "on_policy")
    return out


def _conformance_names(pyproject: str) -> set[str]:
    """The entry-point names a ``pyproject.toml`` registers under ``conduit.conformance`` (a plain
    reading of that one table: ``tomllib`` needs Python 3.11)."""
    table = re.search(r'^\[project\.entry-points\."conduit\.conformance"\][ \t]*\n(.*?)(?=^\[|\Z)', pyproject,
                      re.M | re.S)
    if table is None:
        return set()
    return {m.group(1).strip('"\'') for m in re.finditer(r'^\s*("[^"]+"|\'[^\']+\'|[\w.-]+)\s*=', table.group(1), re.M)}


def unregistered_packages(packages: Path, discovered: Iterable[str]) -> list[str]:
    """What is wrong with the conformance registration of each package under ``packages`` (one
    ``pyproject.toml`` per package): it registers nothing under ``conduit.conformance``, or its
    registrations are not among the ``discovered`` factory names (the package is not installed)."""
    found = set(discovered)
    problems = []
    for pp in sorted(packages.glob("*/pyproject.toml")):
        names = _conformance_names(pp.read_text())
        if not names:
            problems.append(f"{pp.parent.name} registers no endpoints under the 'conduit.conformance' entry-point "
                            f"group, so no conformance suite runs over it: add [project.entry-points."
                            f"\"conduit.conformance\"] with its EndpointFactory to {pp.relative_to(packages.parent)}")
        elif missing := sorted(names - found):
            problems.append(f"{pp.parent.name} registers {missing} under 'conduit.conformance', but they were "
                            f"not discovered: install it (pip install -e {pp.parent.relative_to(packages.parent)})")
    return problems


globals().update(suite_classes(FACTORIES))


def test_core_is_registered() -> None:
    """Discovery works: conduit-core registers its reference endpoints."""
    assert "core" in [f.name for f in FACTORIES], [f.name for f in FACTORIES]


def test_every_package_is_registered_and_discovered() -> None:
    """Every package of the repository is run through the suites: none is left out silently."""
    problems = unregistered_packages(ROOT / "packages", [f.name for f in FACTORIES])
    assert not problems, "\n".join(problems)


#: an on-policy endpoint that does not declare CAP_CHECKPOINT: its restore with rollouts waiting is not tested (an
#: endpoint declaring CAP_CHECKPOINT_BETWEEN_ROLLOUTS is checked to refuse that save instead)
ON_POLICY_CHECKPOINT = f"on_policy:{CAP_CHECKPOINT}"
#: an on-policy endpoint that declares neither checkpoint capability: the on-policy checkpoint tests skip
ON_POLICY_CHECKPOINT_BETWEEN_ROLLOUTS = f"on_policy:{CAP_CHECKPOINT_BETWEEN_ROLLOUTS}"

#: what an adapter is known not to provide, so the suites skip it: an endpoint kind ("replay", "on_policy"), a
#: replay capability (CAP_*) or an on-policy checkpoint capability (ON_POLICY_*). Anything else missing fails below
#: instead of turning into skipped conformance tests. Each entry says why.
#: verl: its ``replay`` module (``ConduitReplayBuffer``) is verl's V1 group sampler, a staleness-gated selection of
#: finished prompt groups from TransferQueue, not a buffer of uniform or prioritized draws with FIFO capacity, so
#: ReplaySuite's semantics do not apply (its staleness rule is tested in packages/conduit-verl/tests/test_replay.py and
#: test_sync_sample_staleness.py). Its on-policy ``MinibatchDelivery`` has no checkpoint: verl builds one per
#: ``make_iterator`` call (one step's batch, seeded by verl each call) and checkpoints between training steps, when it
#: is gone, so there is nothing to restore.
#: rllib: the PPO learner's ``MinibatchFeed`` checkpoints between updates only (its ``state_dict`` refuses while a
#: rollout waits, which the suite checks); the restore between rollouts is tested.
KNOWN_GAPS: dict[str, set[str]] = {"verl": {"replay", ON_POLICY_CHECKPOINT, ON_POLICY_CHECKPOINT_BETWEEN_ROLLOUTS},
                                   "rllib": {ON_POLICY_CHECKPOINT}}


def untested(f: EndpointFactory) -> set[str]:
    """What the suites skip for ``f``: the endpoint kinds it does not build, the replay capabilities its
    replay endpoint does not declare (the tests that need them skip), and the on-policy checkpoint capabilities its
    on-policy endpoint does not declare (:data:`ON_POLICY_CHECKPOINT`, :data:`ON_POLICY_CHECKPOINT_BETWEEN_ROLLOUTS`).
    The suites build uniform and prioritized endpoints and check each one's capabilities, so a capability counts
    only if both declare it (a checkpoint declared by the uniform endpoint alone would skip the prioritized half of
    the checkpoint tests)."""
    gaps = {kind for kind, make in (("replay", f.make_replay), ("on_policy", f.make_on_policy)) if make is None}
    if f.make_replay is not None:
        caps = {CAP_PRIORITIZED, CAP_CHECKPOINT, CAP_CONCURRENT_INGEST}
        for prioritized in (False, True):
            ep = f.make_replay(capacity=8, prioritized=prioritized)
            try:
                caps &= set(getattr(ep, "capabilities", frozenset()))
            finally:
                ep.close()
        gaps |= {CAP_PRIORITIZED, CAP_CHECKPOINT, CAP_CONCURRENT_INGEST} - caps
    if f.make_on_policy is not None:
        ep = f.make_on_policy(num_minibatches=2, num_epochs=1)
        try:
            caps = set(getattr(ep, "capabilities", frozenset()))
        finally:
            ep.close()
        if CAP_CHECKPOINT not in caps:
            gaps.add(ON_POLICY_CHECKPOINT)
            if CAP_CHECKPOINT_BETWEEN_ROLLOUTS not in caps:
                gaps.add(ON_POLICY_CHECKPOINT_BETWEEN_ROLLOUTS)
    return gaps


@pytest.mark.parametrize("factory", FACTORIES, ids=lambda f: f.name)
def test_no_conformance_test_is_skipped_unannounced(factory: EndpointFactory) -> None:
    """Every adapter runs every suite test, except the gaps listed in :data:`KNOWN_GAPS`: an adapter that stops
    building an endpoint kind or declaring a capability (e.g. the multi-node buffer where Ray is missing) fails
    here, not as a few skipped tests in a green run."""
    gaps = untested(factory)
    known = KNOWN_GAPS.get(factory.name, set())
    assert gaps <= known, (
        f"adapter {factory.name!r} leaves {sorted(gaps - known)} untested (the conformance tests that need them "
        f"skip): provide the endpoint / declare the capability, or list it in KNOWN_GAPS with the reason")


def _replay_scenario(f: EndpointFactory) -> tuple[int, list[int]]:
    assert f.make_replay is not None
    ep = f.make_replay(capacity=12, seed=0)
    try:
        for s in range(0, 30, 6):
            ep.insert(np.arange(s, s + 6))
        return len(ep), sorted(ep.contents().tolist())
    finally:
        ep.close()


def _on_policy_scenario(f: EndpointFactory) -> list[tuple[int, int, list[int]]]:
    assert f.make_on_policy is not None
    ep = f.make_on_policy(num_minibatches=3, num_epochs=2, max_staleness=0, seed=0)
    try:
        out = []
        for v in range(2):
            ep.set_policy_version(v)
            ep.ingest(np.arange(100 * v, 100 * v + 20), version=v)
            ep.end_rollout()
            mbs = ep.consume()
            for epoch in range(2):
                ids = sorted(np.concatenate([m.ids for m in mbs if m.epoch == epoch]).tolist())
                out.append((v, sum(m.epoch == epoch for m in mbs), ids))
        return out
    finally:
        ep.close()


@pytest.mark.parametrize("factory", [f for f in FACTORIES if f.make_replay], ids=lambda f: f.name)
def test_same_replay_contents_as_core(factory: EndpointFactory) -> None:
    """The same insertions leave the same live items (FIFO, capacity) in every adapter as in core."""
    core = next(f for f in FACTORIES if f.name == "core")
    assert _replay_scenario(factory) == _replay_scenario(core)


@pytest.mark.parametrize("factory", [f for f in FACTORIES if f.make_on_policy], ids=lambda f: f.name)
def test_same_on_policy_epochs_as_core(factory: EndpointFactory) -> None:
    """The same rollouts give the same per-epoch contents and minibatch counts in every adapter as in core."""
    core = next(f for f in FACTORIES if f.name == "core")
    assert _on_policy_scenario(factory) == _on_policy_scenario(core)


@pytest.mark.parametrize("factory", FACTORIES, ids=lambda f: f.name)
def test_seeded_draws_are_the_same_in_every_process(factory: EndpointFactory) -> None:
    """The calls of the suites' ``test_deterministic_under_seed`` (replay: uniform and, when declared,
    prioritized; on-policy) draw the same items in two fresh processes with PYTHONHASHSEED 1 and 2, the
    endpoints rebuilt there from the adapter's registered factory: a new run of the same seeded job
    draws what the last one drew. The multi-node endpoint's processes join this process's shared cluster as
    jobs of their own (``SHARED_CLUSTER_ENV``), their workers with their hash seeds, instead of each starting one."""
    if factory.name == "distributed":
        from conduit.distributed.testing import shared_servers

        shared_servers()
    assert_deterministic_across_processes(factory.name)  # every kind the factory builds, one pair of processes
