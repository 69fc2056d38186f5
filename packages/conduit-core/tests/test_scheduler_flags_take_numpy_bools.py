"""The schedulers' flags take NumPy bools, as the semantics' flags and Field's ``ragged`` do: one public check,
:func:`conduit.checks.is_bool`, which adapters use too (conduit-srl's config had its own copy of it).

Before: ``Overlapped(overlap=np.bool_(False))``, ``Automatic(overlap=np.bool_(True))`` and
``safe_ranges(on_policy=np.bool_(False))`` were refused ("must be True or False, got False") -- a flag read from
a NumPy config array -- while ``OnPolicy(shuffle=np.bool_(False))`` was taken.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conduit import ExperienceDataPlane, ExperienceSchema, Field, Replay
from conduit.errors import ConfigurationError
from conduit.scheduling import Automatic, Overlapped, safe_ranges


def test_overlapped_takes_numpy_bool_flags_as_python_bools() -> None:
    s = Overlapped(overlap=np.bool_(False), background_ingest=np.bool_(True), copy_on_ingest=np.bool_(True))
    assert (s.overlap, s.background_ingest, s.copy_on_ingest) == (False, True, True)
    assert all(type(v) is bool for v in (s.overlap, s.background_ingest, s.copy_on_ingest))
    buf = ExperienceDataPlane(ExperienceSchema({"x": Field((2,))}), capacity=8, semantics=Replay(seed=0),
                              scheduler=s)
    try:
        buf.ingest({"x": torch.ones(4, 2)})
        buf.flush()
        batch, _ = buf.deliver(3)
        assert batch["x"].shape == (3, 2)
    finally:
        buf.close()


def test_automatic_and_safe_ranges_take_numpy_bools() -> None:
    a = Automatic(overlap=np.bool_(True))
    assert a.force_overlap is True
    assert safe_ranges(on_policy=np.bool_(False), g_ing_max=2, g_del_max=2).describe() == \
        safe_ranges(on_policy=False, g_ing_max=2, g_del_max=2).describe()
    assert safe_ranges(on_policy=np.bool_(True), num_minibatches=2).on_policy


@pytest.mark.parametrize("flag", ["no", 0, 1, None])
def test_scheduler_flags_that_are_no_bool_are_still_refused(flag: object) -> None:
    with pytest.raises(ConfigurationError, match="overlap must be True or False"):
        Overlapped(overlap=flag)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="copy_on_ingest must be True or False"):
        Overlapped(copy_on_ingest=flag)  # type: ignore[arg-type]
    if flag is not None:  # (None: let the measurement decide)
        with pytest.raises(ConfigurationError, match="overlap must be True, False or None"):
            Automatic(overlap=flag)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="on_policy must be True or False"):
        safe_ranges(on_policy=flag)  # type: ignore[arg-type]


def test_the_bool_check_is_public() -> None:
    import conduit.checks as checks

    assert set(checks.__all__) >= {"is_bool", "is_int"}
    assert checks.is_bool(np.bool_(True)) and checks.is_bool(False) and not checks.is_bool(1)
    assert checks.is_int(np.int64(3)) and not checks.is_int(True)
