"""``Overlapped``'s settings taken as declared.

Each case was a known defect:

* on-policy ``g_ing = k/M`` wrote one item more than ``k/M`` of the rollout when the float ``k / M`` times the
  rollout's items rounded up past a whole number (9/11 of 77 items: 64, not 63), so a write waited for another
  part of the rollout;
* ``Overlapped(overlap="false")`` (a value read from a config file) ran with overlap on: the on/off settings were
  taken by truthiness, not checked.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conduit import ExperienceDataPlane, OnPolicy, Overlapped
from conduit.errors import ConfigurationError

sys.path.insert(0, str(Path(__file__).parent))
from test_prefetch_retry_and_cli_interrupts import SCHEMA, _rows  # noqa: E402, I001


# -- on-policy g_ing = k/M of a rollout ----------------------------------------------------------------------------


@pytest.mark.parametrize("rollout_size", [77, None])  # given, or learned from a whole rollout
def test_on_policy_g_ing_of_k_over_m_writes_exactly_k_over_m_of_the_rollout(rollout_size: int | None) -> None:
    """9/11 of a 77-item rollout is 63 items, although 9 / 11 * 77 rounds to 63.00000000000001 in floats: the write
    comes with the 9th of 11 parts of 7 items, not with the 10th."""
    sched = Overlapped(g_ing=9 / 11, g_del=1, overlap=False, rollout_size=rollout_size, queue_depth=16)
    edp = ExperienceDataPlane(SCHEMA, capacity=512, semantics=OnPolicy(num_minibatches=11), scheduler=sched)
    try:
        if rollout_size is None:  # one whole rollout teaches the scheduler its size
            for i in range(11):
                edp.ingest(_rows(7 * i, 7 * i + 7), version=0)
            edp.seal()
        before = len(edp.storage)
        for i in range(9):
            assert len(edp.storage) == before, f"a write came with part {i} of 9"
            edp.ingest(_rows(7 * i, 7 * i + 7), version=0)
        assert len(edp.storage) - before == 63, "9/11 of the rollout was not written with its 9th part"
    finally:
        edp.close()


@pytest.mark.parametrize("setting", ["overlap", "background_ingest", "copy_on_ingest"])
@pytest.mark.parametrize("value", ["false", "no", 0, 1.0])
def test_on_off_settings_that_are_not_bools_are_refused(setting: str, value: object) -> None:
    with pytest.raises(ConfigurationError, match=f"{setting} must be True or False"):
        Overlapped(**{setting: value})  # type: ignore[arg-type]


def test_on_off_settings_take_bools_and_background_ingest_none() -> None:
    assert Overlapped(overlap=False, background_ingest=None).background_ingest is False
    assert Overlapped(overlap=True, background_ingest=False, copy_on_ingest=True).background_ingest is False
