"""A sweep of "bad input gets a typed error and leaves the buffer unchanged" over the SRL buffer.

For ``put``, ``put_batch``, ``get``, ``update_priorities``, ``set_policy_version`` and ``seal``,
under each semantics (queue, replay, prioritized, on-policy) and with Conduit's scheduler
sequential (``overlap=False``) or prefetching (``overlap=True``), each bad input of a catalogue
must raise a :class:`conduit.ConduitError` subclass with a message (never a raw
TypeError/ValueError/...), and afterwards the buffer must deliver exactly what a twin that never
saw the call delivers, with the same counters and the same Experience Data Plane state.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from conduit import ConduitError
from conduit_srl import ConduitBuffer
from conduit_srl.testing import Record, entry_ids, make_sample

KINDS = ("queue", "replay", "prioritized", "on_policy")
OVERLAP = (False, True)
CAP = 12


def args(kind: str, overlap: bool) -> dict[str, Any]:
    base: dict[str, Any] = {"semantics": kind, "capacity": CAP, "overlap": overlap, "seed": 5}
    if kind == "on_policy":
        return {**base, "num_minibatches": 2, "num_epochs": 2, "rollout_size": 4}
    return {**base, "batch_size": 3}


def build(kind: str, overlap: bool) -> ConduitBuffer:
    b = ConduitBuffer(**args(kind, overlap))
    version = 0
    for i in range(CAP if kind == "queue" else 8):  # the queue delivers each sample once: 4 batches of 3
        if kind == "on_policy" and i == 4:
            version = 1
        b.put(make_sample([i], version=version))
    b.flush()
    return b


def entry(b: ConduitBuffer) -> dict[str, Any]:
    e = b.get()
    return {"ids": entry_ids(e).tolist(), "indices": np.asarray(e.sampling_indices).tolist(),
            "weights": None if e.weights is None else np.asarray(e.weights).tolist(), "reuses": e.reuses,
            "obs": e.sample.obs.tolist()}


def same_state(a: ConduitBuffer, b: ConduitBuffer) -> list[str]:
    out = []
    if a.stats() != b.stats():
        out.append(f"stats {a.stats()} != {b.stats()}")
    sa, sb = a.edp.state_dict(), b.edp.state_dict()  # type: ignore[union-attr]
    if repr(sa) != repr(sb):
        out.append("state_dict differs")
    return out


@dataclass(frozen=True)
class Bad:
    name: str
    kinds: tuple[str, ...]
    call: Callable[[ConduitBuffer], Any]


def _with(**changes: Any) -> Record:
    s = make_sample([100], version=1)
    d = dict(s.items())
    for k, v in changes.items():
        if v is _DROP:
            del d[k]
        else:
            d[k] = v
    return Record(**d)


_DROP = object()
ALL = KINDS
REPLAY = ("replay", "prioritized")


def _catalogue() -> list[Bad]:
    c: list[Bad] = []

    def add(name: str, kinds: tuple[str, ...], call: Callable[[ConduitBuffer], Any]) -> None:
        c.append(Bad(name, kinds, call))

    # put
    for name, x in [("None", None), ("an-int", 3), ("a-string", "obs"), ("a-list", [1, 2]),
                    ("a-bare-array", np.zeros((4, 3)))]:
        add(f"put-{name}", ALL, lambda b, x=x: b.put(x))
    for name, ch in [("missing-field", {"obs": _DROP}), ("extra-field", {"extra": np.zeros((4, 1))}),
                     ("wrong-dtype", {"obs": np.zeros((4, 3), dtype=np.float64)}),
                     ("wrong-shape", {"obs": np.zeros((4, 2), dtype=np.float32)}),
                     ("wrong-T", {"obs": np.zeros((5, 3), dtype=np.float32)}),
                     ("None-field", {"obs": None}), ("string-field", {"obs": "abc"}),
                     ("object-field", {"obs": np.array([object()] * 4)}),
                     ("nested-record-None", {"policy_state": None}),
                     ("version-float", {"policy_version_steps": np.full((4, 1), 1.5)})]:
        add(f"put-{name}", ALL, lambda b, ch=ch: b.put(_with(**ch)))
    add("put-batch-too-large", ALL,
        lambda b: b.put_batch(make_sample(np.arange(CAP + 1), version=1, batched=True)))
    add("put-batch-unbatched-sample", ALL, lambda b: b.put_batch(make_sample([1], version=1).obs))
    # get
    for name, n in [("zero", 0), ("negative", -1), ("float", 1.5), ("string", "3"), ("bool-true", True),
                    ("nan", math.nan), ("too-many-queue", 100)]:
        kinds = ("queue",) if name == "too-many-queue" else ALL
        add(f"get-{name}", kinds, lambda b, n=n: b.get(n))
    # update_priorities
    add("update-priorities-not-prioritized", ("queue", "replay", "on_policy"),
        lambda b: b.update_priorities([0], [1.0]))
    for name, h, p in [("nan", [0, 1], [1.0, math.nan]), ("inf", [0, 1], [math.inf, 1.0]),
                       ("negative", [0, 1], [1.0, -1.0]), ("length-mismatch", [0, 1, 2], [1.0, 1.0]),
                       ("string-priorities", [0, 1], ["a", "b"]), ("None-priorities", [0], None),
                       ("None-handles", None, [1.0]), ("float-handles", [0.5, 1.5], [1.0, 2.0]),
                       ("string-handles", ["a"], [1.0]), ("nested-priorities", [0, 1], [[1.0], [2.0, 3.0]])]:
        add(f"update-priorities-{name}", ("prioritized",), lambda b, h=h, p=p: b.update_priorities(h, p))
    # set_policy_version and seal
    add("set-policy-version-not-on-policy", ("queue", "replay", "prioritized"), lambda b: b.set_policy_version(1))
    for name, v in [("string", "1"), ("float", 1.5), ("None", None), ("bool", True), ("nan", math.nan),
                    ("array-of-two", np.array([1, 2]))]:
        add(f"set-policy-version-{name}", ("on_policy",), lambda b, v=v: b.set_policy_version(v))
    add("seal-not-on-policy", ("queue", "replay", "prioritized"), lambda b: b.seal())
    return c


CASES = [pytest.param(bad, kind, overlap, id=f"{bad.name}[{kind}-{'overlap' if overlap else 'sequential'}]")
         for bad in _catalogue() for kind in bad.kinds for overlap in OVERLAP]


def _refused(b: ConduitBuffer, bad: Bad) -> None:
    try:
        bad.call(b)
    except ConduitError as e:
        assert str(e).strip(), f"{bad.name}: {type(e).__name__} without a message"
        return
    except Exception as e:  # noqa: BLE001 - the point of the sweep
        pytest.fail(f"{bad.name}: raised a raw {type(e).__name__} ({e}); expected a conduit.ConduitError "
                    f"subclass that says what to do")
    pytest.fail(f"{bad.name}: accepted (no error)")


@pytest.mark.parametrize("bad, kind, overlap", CASES)
def test_bad_input_to_the_srl_buffer_is_refused_typed_and_changes_nothing(bad: Bad, kind: str, overlap: bool) -> None:
    b, twin = build(kind, overlap), build(kind, overlap)
    try:
        assert entry(b) == entry(twin)  # entries are then assembled ahead in both
        _refused(b, bad)
        b.flush()
        twin.flush()
        for i in range(3):
            got, want = entry(b), entry(twin)
            assert got == want, f"{bad.name}: entry {i} after the refused call differs from the twin's"
        diff = same_state(b, twin)
        assert not diff, f"{bad.name}: {diff}"
    finally:
        b.close()
        twin.close()
