"""The semantics' options take the types the rest of the API does. OnPolicy's counts (M, minibatch size, E): a NumPy
integer (e.g. read from a config array) is an int, a bool is none (``num_epochs=True`` silently meant one epoch).
Flags (OnPolicy's ``shuffle``, a replay delivery's ``replace``) are bools: ``"no"`` is truthy, and shuffled or drew
with replacement."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from conduit import ConfigurationError, ExperienceDataPlane, ExperienceSchema, Field, OnPolicy, Replay

SCHEMA = ExperienceSchema(a=Field((), torch.int64))


@pytest.mark.parametrize("kw", [{"num_minibatches": True}, {"minibatch_size": True},
                                {"num_minibatches": 2, "num_epochs": True}, {"num_minibatches": np.bool_(True)}])
def test_a_bool_count_is_refused(kw: dict[str, object]) -> None:
    with pytest.raises(ConfigurationError, match="must be a positive int"):
        OnPolicy(**kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("kw", [{"num_minibatches": np.int64(2), "num_epochs": np.int32(2)},
                                {"minibatch_size": np.int16(2), "num_epochs": np.uint8(2)}])
def test_numpy_integer_counts_deliver_m_minibatches_for_e_epochs(kw: dict[str, object]) -> None:
    edp = ExperienceDataPlane(SCHEMA, capacity=8, semantics=OnPolicy(**kw))  # type: ignore[arg-type]
    edp.ingest({"a": torch.arange(4)}, version=0)
    edp.seal()
    seen: dict[int, list[int]] = {0: [], 1: []}
    for _ in range(4):
        batch, info = edp.deliver()
        assert info.num_minibatches == 2 and batch.batch_size == 2
        seen[info.epoch].extend(batch["a"].tolist())
    assert sorted(seen[0]) == sorted(seen[1]) == [0, 1, 2, 3]
    assert info.last and len(edp) == 0
    buf = io.BytesIO()
    torch.save(edp.state_dict(), buf)
    buf.seek(0)
    torch.load(buf)  # (weights_only=True: plain ints only)


@pytest.mark.parametrize("flag", ["no", 0, None, 1.0])
def test_a_flag_that_is_no_bool_is_refused(flag: object) -> None:
    """A replay delivery's ``replace`` and OnPolicy's ``shuffle`` are refused unless bools; the refused delivery
    draws nothing (the sampler's state is unchanged)."""
    with pytest.raises(ConfigurationError, match="shuffle must be True or False"):
        OnPolicy(num_minibatches=2, shuffle=flag)  # type: ignore[arg-type]
    edp = ExperienceDataPlane(SCHEMA, capacity=8, semantics=Replay(seed=3))
    edp.ingest({"a": torch.arange(4)})
    before = edp.state_dict()
    with pytest.raises(ConfigurationError, match="replace must be True or False"):
        edp.deliver(4, replace=flag)
    after = edp.state_dict()
    assert torch.equal(before["semantics"]["sampler"]["rng"], after["semantics"]["sampler"]["rng"])
    edp.close()


@pytest.mark.parametrize("flag", [False, np.bool_(False)])
def test_bool_flags_of_python_or_numpy_are_taken(flag: object) -> None:
    """``replace=False`` (also NumPy's) draws distinct items; ``shuffle=False`` keeps the ingestion order."""
    edp = ExperienceDataPlane(SCHEMA, capacity=8, semantics=Replay(seed=3))
    edp.ingest({"a": torch.arange(4)})
    batch, _ = edp.deliver(4, replace=flag)
    assert sorted(batch["a"].tolist()) == [0, 1, 2, 3]
    edp.close()
    edp = ExperienceDataPlane(SCHEMA, capacity=8, semantics=OnPolicy(num_minibatches=1, shuffle=flag))
    edp.ingest({"a": torch.arange(4)}, version=0)
    edp.seal()
    batch, _ = edp.deliver()
    assert batch["a"].tolist() == [0, 1, 2, 3]
    edp.close()
