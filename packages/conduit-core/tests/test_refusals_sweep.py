"""A systematic sweep of the rule "bad input gets a typed error that says what to do, and leaves
the buffer unchanged" (``ExperienceDataPlane``'s class docstring).

For every public mutating method (ingest, deliver, update_priorities, set_policy_version, seal,
load_state_dict, migrate), under each semantics (uniform replay, prioritized replay, on-policy)
and each scheduler (Synchronous, Overlapped(overlap=False), Overlapped(g_del=2) with prefetch),
each bad input of a catalogue must:

1. raise a :class:`conduit.ConduitError` subclass with a message (never a raw
   TypeError/ValueError/KeyError/IndexError/RuntimeError/AttributeError/AssertionError);
2. leave ``state_dict()`` exactly as it was (tensors compared exactly; the sum tree's leaves
   for prioritized replay);
3. leave what comes next unchanged: after the refused call (made while prefetched batches are
   waiting), the next deliveries and the state are exactly those of a twin buffer that never
   saw it.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from conduit import (
    ConduitError,
    ExperienceBatch,
    ExperienceDataPlane,
    ExperienceSchema,
    Field,
    HostPlacement,
    OnPolicy,
    Overlapped,
    PrioritizedSampler,
    Ragged,
    Replay,
    Synchronous,
)
from conduit.placement.base import DevicePlacement

SCHEMA = ExperienceSchema(obs=Field((4,), torch.float32), action=Field((), torch.int64))
GROWN = ExperienceSchema(obs=Field((5,), torch.float32), action=Field((), torch.int64))
CAP = 10

KINDS = ("uniform", "prioritized", "on_policy")
SCHEDULERS = ("sync", "sequential", "prefetch")


def good(n: int, start: int = 0) -> dict[str, torch.Tensor]:
    return {"obs": torch.arange(start, start + n, dtype=torch.float32)[:, None].expand(n, 4).contiguous() / 7,
            "action": torch.arange(start, start + n)}


def semantics(kind: str) -> Any:
    if kind == "uniform":
        return Replay(seed=3)
    if kind == "prioritized":
        return Replay(PrioritizedSampler(alpha=0.7, beta=0.5), seed=3)
    return OnPolicy(num_minibatches=2, num_epochs=2, seed=3)


def scheduler(name: str, kind: str) -> Any:
    if name == "sync":
        return Synchronous()
    if name == "sequential":
        return Overlapped(overlap=False, g_del=1 if kind == "on_policy" else 2)
    # on-policy delivery granularity is fixed at 1/M: prefetch one minibatch ahead
    return Overlapped(g_del=1) if kind == "on_policy" else Overlapped(g_del=2)


def build(kind: str, sched: str = "sync") -> ExperienceDataPlane:
    """A buffer with contents: a wrapped ring (replay), a sealed and an open rollout (on-policy)."""
    edp = ExperienceDataPlane(SCHEMA, capacity=CAP, semantics=semantics(kind), scheduler=scheduler(sched, kind))
    if kind == "on_policy":
        edp.ingest(good(4), version=0)
        edp.ingest(good(3, 50), version=1)  # seals version 0; version 1 stays open
    elif kind == "prioritized":
        edp.ingest(good(6), priorities=torch.linspace(0.5, 3.0, 6))
        edp.ingest(good(7, 50))  # wraps the ring, evicting three
        edp.flush()
        edp.update_priorities(torch.tensor([5, 6, 3]), torch.tensor([2.0, 0.25, 9.0]))
    else:
        edp.ingest(good(6))
        edp.ingest(good(7, 50))
    edp.flush()
    return edp


def deliver(edp: ExperienceDataPlane) -> tuple[ExperienceBatch, Any]:
    if isinstance(edp.semantics, OnPolicy):
        return edp.deliver()
    return edp.deliver(4)


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Where ``a`` and ``b`` differ (tensors and arrays exactly, NaN equal to NaN)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dtype != b.dtype \
                or a.shape != b.shape or not torch.equal(a.cpu(), b.cpu()):
            return [f"{path}: {a!r} != {b!r}"]
        return []
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)) or a.dtype != b.dtype \
                or not np.array_equal(a, b, equal_nan=a.dtype.kind == "f"):
            return [f"{path}: {a!r} != {b!r}"]
        return []
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{path}: keys {sorted(a)} != {sorted(b)}"]
        return [d for k in a for d in differences(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            return [f"{path}: {a!r} != {b!r}"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in differences(x, y, f"{path}[{i}]")]
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return []
    return [] if a == b and type(a) is type(b) else [f"{path}: {a!r} != {b!r}"]


def delivered(edp: ExperienceDataPlane) -> dict[str, Any]:
    batch, info = deliver(edp)
    return {"batch": {k: (v.values.clone(), v.lengths.clone()) if isinstance(v, Ragged) else v.clone()
                      for k, v in batch.items()},
            "info": {f.name: getattr(info, f.name) for f in dataclasses.fields(info)}}


# -- the catalogue -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Bad:
    name: str
    kinds: tuple[str, ...]
    call: Callable[[ExperienceDataPlane], Any]


REPLAY = ("uniform", "prioritized")
ALL = KINDS


def _v(edp: ExperienceDataPlane) -> dict[str, Any]:
    """The version keyword a valid ingestion into ``edp`` takes."""
    return {"version": 1} if isinstance(edp.semantics, OnPolicy) else {}


def _ingest(batch: Any) -> Callable[[ExperienceDataPlane], Any]:
    return lambda edp: edp.ingest(batch() if callable(batch) else batch, **_v(edp))


def _damaged(kind: str, damage: Callable[[dict[str, Any]], Any]) -> Callable[[ExperienceDataPlane], Any]:
    """Load a checkpoint of a buffer like this one (a separate donor), damaged by ``damage``."""
    def call(edp: ExperienceDataPlane) -> Any:
        state = copy.deepcopy(build(kind).state_dict())
        damage(state)
        return edp.load_state_dict(state)
    return call


def _set(path: tuple[str, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def damage(state: dict[str, Any]) -> None:
        d = state
        for k in path[:-1]:
            d = d[k]
        d[path[-1]] = value
    return damage


def _delete(path: tuple[str, ...]) -> Callable[[dict[str, Any]], None]:
    def damage(state: dict[str, Any]) -> None:
        d = state
        for k in path[:-1]:
            d = d[k]
        del d[path[-1]]
    return damage


def _pad(b: ExperienceBatch) -> dict[str, torch.Tensor]:
    return {"obs": torch.nn.functional.pad(b.tensor("obs"), (0, 1)), "action": b.tensor("action")}


def _raising_transform(b: ExperienceBatch) -> dict[str, torch.Tensor]:
    raise ValueError("this transform cannot pad")


def _catalogue() -> list[Bad]:
    c: list[Bad] = []

    def add(name: str, kinds: Iterable[str], call: Callable[[ExperienceDataPlane], Any]) -> None:
        c.append(Bad(name, tuple(kinds), call))

    # ingest: the batch
    add("ingest-None", ALL, _ingest(None))
    add("ingest-a-list-of-batches", ALL, _ingest(lambda: [good(2)]))
    add("ingest-a-bare-tensor", ALL, _ingest(lambda: torch.zeros(2, 4)))
    add("ingest-a-string", ALL, _ingest("obs"))
    add("ingest-an-int", ALL, _ingest(3))
    add("ingest-empty-dict", ALL, _ingest(lambda: {}))
    add("ingest-missing-field", ALL, _ingest(lambda: {"obs": torch.zeros(2, 4)}))
    add("ingest-extra-field", ALL, _ingest(lambda: {**good(2), "extra": torch.zeros(2)}))
    add("ingest-wrong-dtype", ALL, _ingest(lambda: {**good(2), "obs": torch.zeros(2, 4, dtype=torch.float64)}))
    add("ingest-wrong-dtype-int", ALL, _ingest(lambda: {**good(2), "action": torch.zeros(2)}))
    add("ingest-wrong-numpy-dtype", ALL, _ingest(lambda: {**good(2), "obs": np.zeros((2, 4))}))
    add("ingest-wrong-shape", ALL, _ingest(lambda: {**good(2), "obs": torch.zeros(2, 3)}))
    add("ingest-scalar-column", ALL, _ingest(lambda: {"obs": torch.zeros(1, 4), "action": torch.tensor(1)}))
    add("ingest-mismatched-lengths", ALL, _ingest(lambda: {**good(3), "action": torch.arange(2)}))
    add("ingest-None-column", ALL, _ingest(lambda: {**good(2), "obs": None}))
    add("ingest-string-column", ALL, _ingest(lambda: {**good(2), "action": "ab"}))
    add("ingest-nested-lists-for-a-fixed-field", ALL, _ingest(lambda: {**good(2), "obs": [[1.0], [2.0, 3.0]]}))
    add("ingest-object-array", ALL, _ingest(lambda: {**good(2), "action": np.array([object(), object()])}))
    add("ingest-batch-size-lies", ALL, _ingest(lambda: ExperienceBatch(good(3), 5)))
    add("ingest-too-large", ALL, _ingest(lambda: good(CAP + 1)))
    # ingest: priorities
    add("priorities-on-uniform", ("uniform",), lambda e: e.ingest(good(2), priorities=torch.ones(2)))
    add("priorities-on-policy", ("on_policy",), lambda e: e.ingest(good(2), version=1, priorities=torch.ones(2)))
    for name, p in [("nan", torch.tensor([1.0, math.nan])), ("inf", torch.tensor([1.0, math.inf])),
                    ("negative", torch.tensor([1.0, -1.0])), ("too-few", torch.tensor([1.0])),
                    ("too-many", torch.ones(3)), ("empty", torch.ones(0)), ("strings", ["a", "b"]),
                    ("a-string", "1.0"), ("objects", [object(), object()]), ("a-dict", {"a": 1.0})]:
        add(f"ingest-priorities-{name}", ("prioritized",), lambda e, p=p: e.ingest(good(2), priorities=p))
    # ingest: version (on-policy)
    for name, v in [("missing", None), ("string", "1"), ("float", 1.5), ("nan", math.nan), ("bool", True),
                    ("backwards", 0), ("tensor-of-two", torch.tensor([1, 2])), ("inf", math.inf)]:
        add(f"ingest-version-{name}", ("on_policy",), lambda e, v=v: e.ingest(good(2), version=v))

    # deliver
    for name, kw in [("n-None", {"n": None}), ("n-zero", {"n": 0}), ("n-negative", {"n": -1}),
                     ("n-float", {"n": 1.5}), ("n-string", {"n": "4"}), ("n-bool", {"n": True}),
                     ("n-nan", {"n": math.nan}), ("n-tensor-of-two", {"n": torch.tensor([2, 2])}),
                     ("without-replacement-too-many", {"n": 100, "replace": False})]:
        add(f"deliver-{name}", REPLAY, lambda e, kw=kw: e.deliver(**kw))
    add("deliver-without-replacement-prioritized", ("prioritized",), lambda e: e.deliver(2, replace=False))
    for name, beta in [("nan", math.nan), ("inf", math.inf), ("negative", -1.0), ("string", "x"),
                       ("list", [0.5])]:
        add(f"deliver-beta-{name}", ("prioritized",), lambda e, beta=beta: e.deliver(4, beta=beta))
    add("deliver-n-on-policy", ("on_policy",), lambda e: e.deliver(4))
    add("deliver-n-zero-on-policy", ("on_policy",), lambda e: e.deliver(0))

    # update_priorities
    add("update-priorities-not-prioritized", ("uniform", "on_policy"),
        lambda e: e.update_priorities(torch.tensor([5]), torch.tensor([1.0])))
    for name, h, p in [
        ("nan", [5, 6], [1.0, math.nan]), ("inf", [5, 6], [math.inf, 1.0]), ("negative", [5, 6], [1.0, -0.5]),
        ("length-mismatch", [5, 6, 7], [1.0, 2.0]), ("float-handles", [5.0, 6.0], [1.0, 2.0]),
        ("handles-None", None, [1.0]), ("priorities-None", [5], None), ("string-priorities", [5, 6], ["a", "b"]),
        ("string-handles", ["5", "6"], [1.0, 2.0]), ("nan-for-an-evicted-handle", [0, 6], [math.nan, 1.0]),
        ("bool-handles", [True, False], [1.0, 2.0]), ("object-priorities", [5], [object()]),
        ("complex-priorities", [5], [1 + 2j]), ("dict-priorities", [5], {"a": 1.0}),
    ]:
        def up(e: ExperienceDataPlane, h: Any = h, p: Any = p) -> Any:
            hh = torch.tensor(h) if isinstance(h, list) and h and not isinstance(h[0], str) else h
            pp = torch.tensor(p, dtype=torch.float64) if isinstance(p, list) and p and isinstance(p[0], float) else p
            return e.update_priorities(hh, pp)
        add(f"update-priorities-{name}", ("prioritized",), up)

    # set_policy_version and seal
    add("set-policy-version-on-replay", REPLAY, lambda e: e.set_policy_version(1))
    for name, v in [("string", "1"), ("float", 1.5), ("None", None), ("bool", True), ("nan", math.nan),
                    ("tensor-of-two", torch.tensor([1, 2]))]:
        add(f"set-policy-version-{name}", ("on_policy",), lambda e, v=v: e.set_policy_version(v))
    add("seal-on-replay", REPLAY, lambda e: e.seal())

    # load_state_dict
    for kind in KINDS:
        k = (kind,)
        add(f"load-None-{kind}", k, lambda e: e.load_state_dict(None))  # type: ignore[arg-type]
        add(f"load-empty-{kind}", k, lambda e: e.load_state_dict({}))
        add(f"load-a-list-{kind}", k, lambda e: e.load_state_dict([1, 2]))  # type: ignore[arg-type]
        add(f"load-format-2-{kind}", k, _damaged(kind, _set(("format",), 2)))
        add(f"load-storage-missing-{kind}", k, _damaged(kind, _delete(("storage",))))
        add(f"load-semantics-missing-{kind}", k, _damaged(kind, _delete(("semantics",))))
        add(f"load-storage-capacity-{kind}", k, _damaged(kind, _set(("storage", "capacity"), CAP + 1)))
        add(f"load-storage-schema-{kind}", k, _damaged(kind, _set(("storage", "schema"), GROWN.to_dict())))
        add(f"load-storage-schema-garbage-{kind}", k, _damaged(kind, _set(("storage", "schema"), "obs")))
        add(f"load-storage-oldest-string-{kind}", k, _damaged(kind, _set(("storage", "oldest"), "x")))
        add(f"load-storage-oldest-negative-{kind}", k, _damaged(kind, _set(("storage", "oldest"), -3)))
        add(f"load-storage-range-too-long-{kind}", k, _damaged(kind, _set(("storage", "next"), 10 * CAP)))
        add(f"load-storage-data-missing-{kind}", k, _damaged(kind, _delete(("storage", "data"))))
        add(f"load-storage-data-wrong-dtype-{kind}", k,
            _damaged(kind, lambda s: s["storage"]["data"].update(obs=s["storage"]["data"]["obs"].double())))
        add(f"load-storage-data-short-{kind}", k,
            _damaged(kind, lambda s: s["storage"]["data"].update(action=s["storage"]["data"]["action"][:1])))
        add(f"load-storage-data-field-missing-{kind}", k, _damaged(kind, _delete(("storage", "data", "obs"))))
        add(f"load-storage-data-None-{kind}", k, _damaged(kind, _set(("storage", "data", "obs"), None)))
        add(f"load-semantics-empty-{kind}", k, _damaged(kind, _set(("semantics",), {})))
        other = "on_policy" if kind != "on_policy" else "uniform"
        add(f"load-semantics-of-{other}-into-{kind}", k,
            _damaged(kind, lambda s, other=other: s.update(semantics=build(other).state_dict()["semantics"])))
    add("load-uniform-rng-garbage", ("uniform",), _damaged("uniform", _set(("semantics", "sampler", "rng"), "x")))
    for name, leaves in [("nan", lambda n: np.full(n, np.nan)), ("negative", lambda n: -np.ones(n)),
                         ("inf", lambda n: np.full(n, np.inf)), ("too-short", lambda n: np.ones(n - 1)),
                         ("too-long", lambda n: np.ones(n + 1)), ("strings", lambda n: np.array(["a"] * n)),
                         ("None", lambda n: None)]:
        add(f"load-prioritized-leaves-{name}", ("prioritized",),
            _damaged("prioritized", _set(("semantics", "sampler", "leaves"), leaves(CAP))))
    for name, mp in [("string", "x"), ("nan", math.nan), ("negative", -1.0), ("inf", math.inf), ("None", None)]:
        add(f"load-prioritized-max-priority-{name}", ("prioritized",),
            _damaged("prioritized", _set(("semantics", "sampler", "max_priority"), mp)))
    add("load-prioritized-rng-garbage", ("prioritized",),
        _damaged("prioritized", _set(("semantics", "sampler", "rng"), {"state": 1})))
    for key, value in [("policy_version", "x"), ("policy_version", None), ("dropped_items", "x"),
                       ("open", "abc"), ("open", (1, 2)), ("sealed", [(0, 0)]), ("sealed", 5), ("cur", "abc"),
                       ("rng", "x"), ("epoch", "x"), ("k", None), ("perm", "x"), ("bounds", None)]:
        add(f"load-on-policy-{key}-{value!r}", ("on_policy",), _damaged("on_policy", _set(("semantics", key), value)))

    # migrate
    add("migrate-placement-None", ALL, lambda e: e.migrate(None))  # type: ignore[arg-type]
    add("migrate-placement-string", ALL, lambda e: e.migrate("host"))  # type: ignore[arg-type]
    add("migrate-placement-class", ALL, lambda e: e.migrate(HostPlacement))  # type: ignore[arg-type]
    add("migrate-absent-device", ALL, lambda e: e.migrate(DevicePlacement("cuda:7")))
    add("migrate-new-schema-without-transform", ALL, lambda e: e.migrate(HostPlacement(), schema=GROWN))
    add("migrate-schema-not-a-schema", ALL,
        lambda e: e.migrate(HostPlacement(), schema={"obs": (5,)}, transform=_pad))  # type: ignore[arg-type]
    add("migrate-transform-not-callable", ALL,
        lambda e: e.migrate(HostPlacement(), schema=GROWN, transform=5))  # type: ignore[arg-type]
    add("migrate-transform-raises", ALL,
        lambda e: e.migrate(HostPlacement(), schema=GROWN, transform=_raising_transform))
    add("migrate-transform-wrong-count", ALL,
        lambda e: e.migrate(HostPlacement(), schema=GROWN, transform=lambda b: _pad(b.select(slice(0, 1)))))
    add("migrate-transform-wrong-schema", ALL,
        lambda e: e.migrate(HostPlacement(), schema=GROWN, transform=lambda b: dict(b)))
    add("migrate-transform-returns-None", ALL,
        lambda e: e.migrate(HostPlacement(), schema=GROWN, transform=lambda b: None))
    return c


CATALOGUE = _catalogue()
CASES = [pytest.param(bad, kind, sched, id=f"{bad.name}[{kind}-{sched}]")
         for bad in CATALOGUE for kind in bad.kinds for sched in SCHEDULERS]


def _refused(edp: ExperienceDataPlane, bad: Bad) -> ConduitError:
    try:
        bad.call(edp)
    except ConduitError as e:
        assert str(e).strip(), f"{bad.name}: {type(e).__name__} without a message"
        return e
    except Exception as e:  # noqa: BLE001 - the point of the sweep
        pytest.fail(f"{bad.name}: raised a raw {type(e).__name__} ({e}); expected a conduit.ConduitError "
                    f"subclass that says what to do")
    pytest.fail(f"{bad.name}: accepted (no error)")


@pytest.mark.parametrize("bad, kind, sched", CASES)
def test_bad_input_is_refused_typed_and_changes_nothing(bad: Bad, kind: str, sched: str) -> None:
    _sweep(bad, lambda: build(kind, sched))


def _sweep(bad: Bad, make: Callable[[], ExperienceDataPlane]) -> None:
    edp, twin = make(), make()
    try:
        # (2) state_dict() before and after the refused call are equal
        before = edp.state_dict()
        twin.state_dict()  # (the twin takes the same calls, so that prefetch state matches)
        _refused(edp, bad)
        after = edp.state_dict()
        twin.state_dict()
        diff = differences(before, after)
        assert not diff, f"{bad.name}: the refused call changed the state: {diff[:5]}"
        # (3) with prefetched batches waiting: refused again, then the same deliveries and state as the twin
        assert not differences(delivered(edp), delivered(twin))
        _refused(edp, bad)
        for i in range(3):
            diff = differences(delivered(edp), delivered(twin))
            assert not diff, f"{bad.name}: delivery {i} after the refused call differs from the twin's: {diff[:5]}"
        diff = differences(edp.state_dict(), twin.state_dict())
        assert not diff, f"{bad.name}: the state after the refused call differs from the twin's: {diff[:5]}"
    finally:
        edp.close()
        twin.close()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("sched", SCHEDULERS)
def test_delivering_from_an_empty_buffer_is_refused_typed_and_changes_nothing(kind: str, sched: str) -> None:
    edp = ExperienceDataPlane(SCHEMA, capacity=CAP, semantics=semantics(kind), scheduler=scheduler(sched, kind))
    twin = build(kind, sched)
    try:
        before = edp.state_dict()
        with pytest.raises(ConduitError):
            deliver(edp)
        assert not differences(before, edp.state_dict())
        # filled afterwards, it delivers what a buffer that was never asked delivers
        edp.load_state_dict(build(kind).state_dict())
        twin.load_state_dict(build(kind).state_dict())
        for _ in range(3):
            assert not differences(delivered(edp), delivered(twin))
    finally:
        edp.close()
        twin.close()


# -- ragged fields ---------------------------------------------------------------------------------
RAGGED = ExperienceSchema(tok=Field((), torch.int64, ragged=True), r=Field(()))
POOL = 24


def good_ragged(lengths: list[int], start: int = 0) -> dict[str, Any]:
    return {"tok": [torch.arange(start + i, start + i + k) for i, k in enumerate(lengths)],
            "r": torch.arange(start, start + len(lengths), dtype=torch.float32)}


def build_ragged(kind: str, sched: str) -> ExperienceDataPlane:
    """Ragged contents whose pool has wrapped (replay) or holds two rollouts (on-policy)."""
    edp = ExperienceDataPlane(RAGGED, capacity=CAP, ragged_capacity=POOL, semantics=semantics(kind),
                              scheduler=scheduler(sched, kind))
    if kind == "on_policy":
        edp.ingest(good_ragged([3, 1, 2, 2]), version=0)
        edp.ingest(good_ragged([2, 0, 4], 40), version=1)
    else:
        edp.ingest(good_ragged([3, 1, 2, 2, 5]))
        edp.ingest(good_ragged([4, 0, 3, 2], 40))
        edp.ingest(good_ragged([6, 1], 80))  # the pool wraps
    edp.flush()
    return edp


def _ragged_catalogue() -> list[Bad]:
    r2 = torch.zeros(2)
    items = [
        ("lengths-a-list", lambda: {"tok": Ragged(torch.arange(3), [2, 1]), "r": r2}),  # type: ignore[arg-type]
        ("values-a-list", lambda: {"tok": Ragged([1, 2, 3], torch.tensor([2, 1])), "r": r2}),  # type: ignore[arg-type]
        ("lengths-an-int", lambda: {"tok": Ragged(torch.arange(3), 3), "r": r2}),  # type: ignore[arg-type]
        ("negative-length", lambda: {"tok": Ragged(torch.arange(3), torch.tensor([4, -1])), "r": r2}),
        ("lengths-not-summing", lambda: {"tok": Ragged(torch.arange(3), torch.tensor([1, 1])), "r": r2}),
        ("int32-lengths", lambda: {"tok": Ragged(torch.arange(3), torch.tensor([2, 1], dtype=torch.int32)), "r": r2}),
        ("2d-lengths", lambda: {"tok": Ragged(torch.arange(3), torch.tensor([[2, 1]])), "r": r2}),
        ("wrong-dtype", lambda: {"tok": [[1.0, 2.0], [3.0]], "r": r2}),
        ("wrong-element-shape", lambda: {"tok": [torch.zeros(2, 2, dtype=torch.int64),
                                                 torch.zeros(1, 2, dtype=torch.int64)], "r": r2}),
        ("a-dense-tensor", lambda: {"tok": torch.zeros(2, 3, dtype=torch.int64), "r": r2}),
        ("None-items", lambda: {"tok": [None, None], "r": r2}),
        ("string-items", lambda: {"tok": ["ab", "c"], "r": r2}),
        ("scalar-items", lambda: {"tok": [torch.tensor([1]), 2], "r": r2}),
        ("more-than-the-pool", lambda: {"tok": [list(range(POOL + 1))], "r": torch.zeros(1)}),
        ("mismatched-lengths", lambda: {"tok": [[1], [2], [3]], "r": r2}),
        ("a-fixed-field-given-ragged", lambda: {"tok": [[1], [2]],
                                                "r": Ragged(torch.zeros(2), torch.ones(2, dtype=torch.int64))}),
        ("an-ExperienceBatch-with-a-str-column", lambda: ExperienceBatch(
            {"tok": Ragged(torch.arange(3), torch.tensor([2, 1])), "r": "ab"}, 2)),  # type: ignore[dict-item]
        ("an-ExperienceBatch-with-a-numpy-column", lambda: ExperienceBatch(
            {"tok": Ragged(torch.arange(3), torch.tensor([2, 1])), "r": np.zeros(2, np.float32)}, 2)),  # type: ignore[dict-item]
        ("an-ExperienceBatch-with-a-list-ragged", lambda: ExperienceBatch(
            {"tok": [[1, 2], [3]], "r": r2}, 2)),  # type: ignore[dict-item]
    ]
    return [Bad(f"ingest-ragged-{name}", ALL, _ingest(make)) for name, make in items]


RAGGED_CASES = [pytest.param(bad, kind, sched, id=f"{bad.name}[{kind}-{sched}]")
                for bad in _ragged_catalogue() for kind in bad.kinds for sched in SCHEDULERS]


@pytest.mark.parametrize("bad, kind, sched", RAGGED_CASES)
def test_bad_ragged_input_is_refused_typed_and_changes_nothing(bad: Bad, kind: str, sched: str) -> None:
    _sweep(bad, lambda: build_ragged(kind, sched))
