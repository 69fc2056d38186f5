"""``transfer_queue.backend.Conduit.unit_num_cpus`` is a finite number of CPUs >= 0.

NaN passed the backend's config check (``cpus < 0`` is false for NaN) and ``tq.init`` then failed inside Ray's actor
options with an untyped ``ValueError: cannot convert float NaN to integer``; ``True`` was taken as one CPU, although
the whole-number keys refuse booleans. Both are now a ``ConfigurationError`` naming the key. So is a share finer than
Ray's step of 0.0001 CPU, which Ray refused at the first unit's start with an untyped ``ValueError``.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from conduit import ConfigurationError
from conduit_verl.tq_storage import DEFAULTS, _validated
from conduit_verl.unit import ConduitStorageUnit


@pytest.mark.parametrize("cpus", [math.nan, True, -1, math.inf])
def test_a_bad_unit_num_cpus_is_a_configuration_error(cpus: object) -> None:
    with pytest.raises(ConfigurationError, match="unit_num_cpus"):
        _validated(dict(DEFAULTS, unit_num_cpus=cpus))


@pytest.mark.parametrize("cpus", [0, 1, 0.5, 2.0, 0.0001])
def test_a_finite_unit_num_cpus_is_kept(cpus: float) -> None:
    assert _validated(dict(DEFAULTS, unit_num_cpus=cpus))["unit_num_cpus"] == cpus
    ConduitStorageUnit.options(num_cpus=float(cpus))  # Ray takes it for a unit


@pytest.mark.parametrize("cpus", [1e-5, 0.00009])
def test_a_unit_num_cpus_finer_than_ray_counts_is_a_configuration_error(cpus: float) -> None:
    """Ray counts CPUs in steps of 0.0001: it refuses a smaller share at the unit's start, with an untyped
    ValueError (the config check had passed it)."""
    with pytest.raises(ValueError, match="cannot go beyond 0.0001"):
        ConduitStorageUnit.options(num_cpus=cpus)
    with pytest.raises(ConfigurationError, match="unit_num_cpus=.*0.0001"):
        _validated(dict(DEFAULTS, unit_num_cpus=cpus))


def test_a_first_pool_beyond_int64_is_refused_at_init() -> None:
    """capacity x mean_length sizes every tensor field's first pool, which a unit allocates whole at the field's
    first put. A size beyond int64 was accepted here, and only that put failed, untyped; it is refused with the keys
    and the bytes it would need. (A pool beyond the memory of a unit's node is refused when the units are placed:
    test_unit_memory_check_on_the_units_node.py.)"""
    from conduit_verl.columns import FieldStore, PoolLadder

    capacity, mean_length = 10**30, 256
    with pytest.raises(TypeError):  # what the first put met (overflow unpacking the size)
        FieldStore("responses", torch.uint8, 1, PoolLadder(capacity, capacity * mean_length))
    with pytest.raises(ConfigurationError, match=rf"capacity={capacity}.*mean_length={mean_length}.*int64") as e:
        _validated(dict(DEFAULTS, capacity=capacity, mean_length=mean_length))
    assert f"{capacity * mean_length + 25 * capacity} bytes" in str(e.value)


def test_a_first_pool_beyond_the_drivers_memory_is_left_to_the_units_nodes() -> None:
    """The machine that runs ``tq.init`` allocates no pool: its memory bounds nothing (before, a pool of 9 TiB was
    refused here by this machine's memory, whatever the nodes the units run on have)."""
    assert 10**13 > os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert _validated(dict(DEFAULTS, capacity=10**6, mean_length=10**7))["capacity"] == 10**6


def test_a_first_pool_that_fits_is_accepted() -> None:
    assert _validated(dict(DEFAULTS, capacity=4096, mean_length=8192))["capacity"] == 4096
