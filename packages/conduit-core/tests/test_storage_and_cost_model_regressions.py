"""Regressions of storage, schema, batch, and the cost model's charge of ragged pools.

1. ``ShardedStorage`` keeps every ragged pool whole on its first device; the cost model spread the ragged
   bytes over the shards, so the planner accepted sharded placements that overfill device 0 (and priced the
   ragged fields' ingestion and delivery as if they were split over the shards too).
2. A Ragged whose int64 lengths wrap around (near 2**62 each) to the number of packed values passed validation;
   storing it poisoned the buffer: the next gather of it read far outside the pool (a segmentation fault).
3. A list of per-item NumPy scalars led by an np.float64 (a Python float subclass) was promoted by torch
   (int64 2**53 + 1 stored as 2**53), where the same list led by any other NumPy scalar is refused; and a Python
   scalar among NumPy scalars of its own dtype (``[np.int64(1), 2]``) was refused, depending on the order. Now a
   Python scalar takes the NumPy scalars' dtype when it holds exactly that value, and is refused otherwise.
4. ``memmap_allocator`` opened an existing column file instead of making one: two storages given one directory
   shared their columns, and each one's appends overwrote the other's items.
5. ``ExperienceSchema.from_dict`` read ``"ragged"`` with ``bool()``: ``"false"`` (or ``"no"``) made a fixed field
   ragged.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conduit import ConfigurationError, ExperienceSchema, Field, SchemaError
from conduit.batch import ExperienceBatch, Ragged
from conduit.placement import CostModel, PlacementSpec, Planner, Workload, load_topology
from conduit.storage import ColumnarStorage, ShardedStorage, memmap_allocator

#: 8 B id + int64 tokens (ragged)
TOKENS = ExperienceSchema(id=Field((), torch.int64), tok=Field((), torch.int64, ragged=True))


# -- 1. the cost model charges ragged pools to the shard that holds them ----------------------------------------------
def test_the_planner_refuses_sharded_placements_whose_ragged_pools_overfill_the_first_device() -> None:
    topo = load_topology("dgx-a100-80g")
    # 10^6 items of 12,000 tokens: 89.4 GiB of pool, more than one 80 GB GPU; spread over 4 or 8 GPUs it would "fit"
    w = Workload.from_schema(TOKENS, capacity=10**6, batch=512, mean_ragged_length=12_000)
    assert w.ragged == (1,) and w.resized(2 * w.item_bytes).ragged == (1,)
    plan = Planner(topo).plan(w)
    pool_bytes = 10**6 * 12_000 * 8
    sharded = [c for c in plan.candidates if c.spec.tier == "sharded"]
    assert sharded
    for c in sharded:
        assert c.estimate.memory[c.spec.devices[0]] >= pool_bytes
        assert not c.feasible, c.reason
    assert plan.placement.tier in ("host", "pinned")


def test_the_sharded_memory_charge_matches_what_the_storage_allocates() -> None:
    cm = CostModel(load_topology("dgx-a100-80g"))
    w = Workload.from_schema(TOKENS, capacity=10, batch=2, mean_ragged_length=5)
    spec = PlacementSpec("sharded", ("cuda:0", "cuda:1", "cuda:2"))
    st = ShardedStorage(TOKENS, 10, ["cpu"] * 3, ragged_capacity=10 * 5)
    out = cm.output_depth * w.batch * w.item_bytes
    per_shard = [sum(c.numel() * c.element_size() for c in shard.values()) for shard in st._shards]
    pools = st._ragged.nbytes() if st._ragged is not None else 0
    need = cm.memory(spec, w)
    assert need["cuda:0"] == per_shard[0] + pools + out
    assert need["cuda:1"] == per_shard[1]  # its share of the ids only (one learner, on cuda:0)
    assert need["cuda:2"] == per_shard[2]


def test_a_sharded_placement_prices_ragged_fields_on_the_first_device_only() -> None:
    cm = CostModel(load_topology("dgx-a100-80g"))
    w = Workload.from_schema(TOKENS, capacity=1000, batch=64, mean_ragged_length=100)
    spec = PlacementSpec("sharded", ("cuda:0", "cuda:1", "cuda:2", "cuda:3"))
    items = w.ingest_call_items
    steps = cm.ingest_steps(spec, w).steps
    # the pool: one synchronous pageable copy of every item's tokens to cuda:0; then the ids, a quarter per shard
    assert len(steps) == 1 + 4
    pool = cm.profile.link("h2d_pageable", 0).seconds(w.field_bytes[1] * items)
    assert steps[0].resource is None and steps[0].cpu_s == pool
    pinned = cm.profile.link("h2d_pinned", 0)
    assert steps[1].link_s == pinned.seconds(w.field_bytes[0] * items / 4) - pinned.overhead_s
    d = cm.delivery_steps(spec, w, "cuda:0")
    ids_per_shard = cm._gather("cuda:1", w, 0, w.capacity / 4).seconds(w.field_bytes[0] * 16, 16)
    assert all(g == ids_per_shard - cm._gather("cuda:1").overhead_s for _, g, _ in d.shards)
    tokens = cm._gather("cuda:0", w, 1, w.capacity).seconds(w.field_bytes[1] * 64, 64)
    ids_scatter = 4 * cm._gather("cuda:0", w, 0, 64).seconds(w.field_bytes[0] * 16, 16)
    assert d.scatter_s == pytest.approx(tokens + ids_scatter, rel=1e-12)


def _live(st: ColumnarStorage | ShardedStorage) -> list[list[int]]:
    b = st.gather(torch.arange(st.oldest, st.next_handle) % st.capacity)
    tok = b["tok"]
    assert isinstance(tok, Ragged)
    return [tok[i].tolist() for i in range(len(tok))]


# -- 2. lengths whose sum wraps around are refused --------------------------------------------------------------------
@pytest.mark.parametrize("lengths", [[2**62] * 4, [3, 2**62, 2**62, 2**62, 2**62], [2**63 - 1, 2**63 - 1, 2, 3]])
def test_ragged_lengths_whose_int64_sum_wraps_around_are_refused(lengths: list[int]) -> None:
    total = sum(lengths) % 2**64
    schema = ExperienceSchema(tok=Field((), torch.int64, ragged=True))
    st = ColumnarStorage(schema, 8, ragged_capacity=32)
    st.append(ExperienceBatch.checked({"tok": [torch.arange(3)]}, schema))
    bad = Ragged(torch.zeros(total, dtype=torch.int64), torch.tensor(lengths, dtype=torch.int64))
    with pytest.raises(SchemaError, match="sum to the number of packed values"):
        ExperienceBatch.checked({"tok": bad}, schema)
    assert _live(st) == [[0, 1, 2]]
    good = Ragged(torch.arange(5), torch.tensor([2, 3]))
    st.append(ExperienceBatch.checked({"tok": good}, schema))
    assert _live(st) == [[0, 1, 2], [0, 1], [2, 3, 4]]


# -- 3. per-item NumPy scalars are never promoted ---------------------------------------------------------------------
@pytest.mark.parametrize("rows", [[np.float64(1.0), np.int64(2**53 + 1)], [np.float64(0.5), np.float32(0.25)],
                                  [np.float64(1.0), 2**53 + 1], [np.float64(1.0), None]])
def test_per_item_numpy_scalars_led_by_a_float64_are_refused_when_a_value_would_change(rows: list[object]) -> None:
    schema = ExperienceSchema(r=Field((), torch.float64))
    with pytest.raises(SchemaError, match="do not form one column"):
        ExperienceBatch.checked({"r": rows}, schema)
    if rows[1] is not None:  # ([None, ...] is no list of scalars)
        with pytest.raises(SchemaError, match="do not form one column"):
            ExperienceBatch.checked({"r": rows[::-1]}, schema)
    same = ExperienceBatch.checked({"r": [np.float64(0.1), np.float64(2**53 + 1)]}, schema)
    assert same.tensor("r").dtype == torch.float64
    assert same.tensor("r").tolist() == [0.1, float(2**53 + 1)]


@pytest.mark.parametrize(("rows", "dtype"), [([np.float64(1.0), 0.5], torch.float64),
                                             ([np.float64(1.0), 0], torch.float64),
                                             ([np.float32(0.5), 0.25], torch.float32),
                                             ([np.int64(2**53 + 1), 2], torch.int64),
                                             ([np.bool_(False), True], torch.bool)])
def test_python_scalars_among_numpy_scalars_of_their_dtype_are_stored_exactly(rows: list[object],
                                                                           dtype: torch.dtype) -> None:
    schema = ExperienceSchema(r=Field((), dtype))
    for order in (rows, rows[::-1]):
        got = ExperienceBatch.checked({"r": order}, schema).tensor("r")
        assert got.dtype == dtype and got.tolist() == [bool(x) if dtype == torch.bool else x for x in order]


# -- 4. a memory-mapped column is never shared -----------------------------------------------------------------------
def test_memmap_allocator_refuses_a_column_file_that_exists_and_the_first_storage_keeps_its_items(
        tmp_path: Path) -> None:
    schema = ExperienceSchema(x=Field((2,), torch.float32))
    first = ColumnarStorage(schema, 4, allocator=memmap_allocator(tmp_path))
    first.append(ExperienceBatch.checked({"x": torch.ones(1, 2)}, schema))
    with pytest.raises(ConfigurationError, match="already exists"):
        ColumnarStorage(schema, 4, allocator=memmap_allocator(tmp_path))
    first.append(ExperienceBatch.checked({"x": torch.full((1, 2), 2.0)}, schema))
    assert first.gather(torch.arange(2)).tensor("x").tolist() == [[1.0, 1.0], [2.0, 2.0]]
    # its own directory: a second storage works, and the two keep apart
    (tmp_path / "other").mkdir()
    second = ColumnarStorage(schema, 4, allocator=memmap_allocator(tmp_path / "other"))
    second.append(ExperienceBatch.checked({"x": torch.full((1, 2), 7.0)}, schema))
    assert first.gather(torch.arange(2)).tensor("x").tolist() == [[1.0, 1.0], [2.0, 2.0]]
    assert second.gather(torch.arange(1)).tensor("x").tolist() == [[7.0, 7.0]]


# -- 5. a schema description's ragged flag is a bool ------------------------------------------------------------------
@pytest.mark.parametrize("flag", ["false", "no", 1, None])
def test_a_schema_description_whose_ragged_flag_is_no_bool_is_refused(flag: object) -> None:
    with pytest.raises(ConfigurationError, match="ragged must be True or False"):
        ExperienceSchema.from_dict({"a": {"shape": [], "dtype": "int64", "ragged": flag}})
    assert ExperienceSchema.from_dict(TOKENS.to_dict()) == TOKENS
    assert not ExperienceSchema.from_dict({"a": {"shape": [2], "dtype": "float32"}})["a"].ragged


def test_ingesting_a_read_only_array_warns_nothing_and_copies_its_values() -> None:
    """A read-only NumPy array (as Ray hands out from its object store) is ingested without torch's "not writable"
    warning (Conduit only reads it), in a fresh process with every warning an error, and stored by value."""
    import subprocess
    import sys

    code = ("import numpy as np\n"
            "from conduit import ExperienceDataPlane, ExperienceSchema, Field\n"
            "import torch\n"
            "a = np.arange(8, dtype=np.float32).reshape(4, 2); a.flags.writeable = False\n"
            "edp = ExperienceDataPlane(ExperienceSchema({'x': Field((2,), torch.float32)}), capacity=4)\n"
            "edp.ingest({'x': a})\n"
            "assert edp.storage.gather(torch.arange(4))['x'].tolist() == a.tolist()\n"
            "print('stored')\n")
    out = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "stored", out.stderr[-2000:]
