"""Host tier: sample-512 and ingestion, Conduit vs cpprb vs TorchRL vs a pure gather floor.

All four hold the same float32 observations of dimension d. The floor is
``torch.index_select(storage, 0, randint(...), out=reused)``: drawing indices plus the
gather itself, nothing else. Run: ``.venv/bin/python -m pytest benchmarks/test_bench_host.py``.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
from conduit import ExperienceDataPlane, ExperienceSchema, Field, Replay

DIMS = [128, 1000, 5000, 20000]
BATCH = 512
LIBS = ["floor", "conduit", "cpprb", "torchrl"]


def capacity_for(d: int) -> int:
    """At most 100k items and about 512 MiB per buffer."""
    return int(min(100_000, (512 << 20) // (4 * d)))


def build(lib: str, d: int, cap: int, data: torch.Tensor):  # noqa: ANN201 - returns (ingest1, ingest256, sample)
    """Fill a buffer of ``lib`` with ``cap`` items; return its (ingest one, ingest 256, sample 512) calls."""
    if lib in ("floor", "conduit"):
        edp = ExperienceDataPlane(ExperienceSchema(obs=Field((d,))), capacity=cap, semantics=Replay(seed=0))
        for s in range(0, cap, 1024):
            edp.ingest({"obs": data[: min(1024, cap - s)]})
        if lib == "conduit":
            one, chunk = data[:1], data[:256]
            return (lambda: edp.ingest({"obs": one}), lambda: edp.ingest({"obs": chunk}),
                    lambda: edp.deliver(BATCH))
        store = edp.storage._cols["obs"]  # the same memory Conduit gathers from
        out = torch.empty(BATCH, d)
        gen = torch.Generator().manual_seed(0)
        ring = torch.empty(cap, d).fill_(1.0)  # touch every page, as a filled buffer has
        pos = [0]

        def copy_into(src: torch.Tensor) -> None:  # memcpy floor for ingestion: one copy_ into a ring
            n = src.shape[0]
            p = pos[0] if pos[0] + n <= cap else 0
            ring[p:p + n].copy_(src)
            pos[0] = p + n

        one, chunk = data[:1], data[:256]
        return (lambda: copy_into(one), lambda: copy_into(chunk),
                lambda: torch.index_select(store, 0, torch.randint(cap, (BATCH,), generator=gen), out=out))
    if lib == "cpprb":
        import cpprb

        rb = cpprb.ReplayBuffer(cap, env_dict={"obs": {"shape": d, "dtype": np.float32}})
        arr = data.numpy()
        for s in range(0, cap, 1024):
            rb.add(obs=arr[: min(1024, cap - s)])
        one, chunk = arr[:1], arr[:256]
        return lambda: rb.add(obs=one), lambda: rb.add(obs=chunk), lambda: rb.sample(BATCH)
    if lib == "torchrl":
        from tensordict import TensorDict
        from torchrl.data import LazyTensorStorage, ReplayBuffer

        rb = ReplayBuffer(storage=LazyTensorStorage(cap), batch_size=BATCH)
        for s in range(0, cap, 1024):
            n = min(1024, cap - s)
            rb.extend(TensorDict({"obs": data[:n]}, batch_size=[n]))
        one = TensorDict({"obs": data[:1]}, batch_size=[1])
        chunk = TensorDict({"obs": data[:256]}, batch_size=[256])
        return lambda: rb.extend(one), lambda: rb.extend(chunk), lambda: rb.sample()
    raise ValueError(lib)


@pytest.fixture(scope="module", params=DIMS, ids=lambda d: f"d{d}")
def buffers(request: pytest.FixtureRequest):  # noqa: ANN201
    torch.set_num_threads(1)
    d = request.param
    cap = capacity_for(d)
    data = torch.randn(1024, d)
    made = {lib: build(lib, d, cap, data) for lib in LIBS}
    yield d, made
    made.clear()
    gc.collect()


@pytest.mark.parametrize("lib", LIBS)
def test_sample_512(benchmark, buffers, lib: str, ratios) -> None:  # noqa: ANN001
    d, made = buffers
    sample = made[lib][2]
    benchmark.group = f"sample512-d{d}"
    benchmark(sample)
    ratios.add("host_sample512", f"d={d}", lib, benchmark, baseline="floor",
               note=f"Sample {BATCH} float32 observations (host tier, 1 thread).")


@pytest.mark.parametrize("chunk", [1, 256])
@pytest.mark.parametrize("lib", LIBS)
def test_ingest(benchmark, buffers, lib: str, chunk: int, ratios) -> None:  # noqa: ANN001
    d, made = buffers
    fn = made[lib][0 if chunk == 1 else 1]
    benchmark.group = f"ingest{chunk}-d{d}"
    benchmark(fn)
    ratios.add(f"host_ingest{chunk}", f"d={d}", lib, benchmark, baseline="floor",
               note=f"Ingest chunks of {chunk} float32 observations; floor = one copy_ into a preallocated ring.")


# -- sample 512 without replacement: the cost must not grow with the buffer ----------------------------------------
NO_REPEAT_CAPS = [10_000, 100_000, 1_000_000]
NO_REPEAT_D = 16


@pytest.fixture(scope="module", params=NO_REPEAT_CAPS, ids=lambda c: f"cap{c}")
def no_repeat(request: pytest.FixtureRequest):  # noqa: ANN201
    """A full buffer of ``cap`` items (d = 16) and three ways to draw 512 of them: Conduit's ``replace=False``
    delivery; ``permutation``: what one writes with torch alone (the head of ``randperm(cap)``, gathered into a
    reused buffer); ``floor``: a draw *with* replacement gathered the same way (the cost of any 512-row draw)."""
    torch.set_num_threads(1)
    cap = request.param
    edp = ExperienceDataPlane(ExperienceSchema(obs=Field((NO_REPEAT_D,))), capacity=cap, semantics=Replay(seed=0))
    data = torch.randn(min(cap, 65536), NO_REPEAT_D)
    for s in range(0, cap, data.shape[0]):
        edp.ingest({"obs": data[: min(data.shape[0], cap - s)]})
    store = edp.storage._cols["obs"]
    out = torch.empty(BATCH, NO_REPEAT_D)
    gen = torch.Generator().manual_seed(0)
    calls = {
        "conduit": lambda: edp.deliver(BATCH, replace=False),
        "permutation": lambda: torch.index_select(store, 0, torch.randperm(cap, generator=gen)[:BATCH], out=out),
        "floor": lambda: torch.index_select(store, 0, torch.randint(cap, (BATCH,), generator=gen), out=out),
    }
    yield cap, calls
    edp.close()
    calls.clear()
    gc.collect()


@pytest.mark.parametrize("lib", ["floor", "conduit", "permutation"])
def test_sample_512_without_replacement(benchmark, no_repeat, lib: str, ratios) -> None:  # noqa: ANN001
    cap, calls = no_repeat
    benchmark.group = f"sample512-norepeat-cap{cap}"
    benchmark(calls[lib])
    ratios.add("host_sample512_no_repeat", f"cap={cap}", lib, benchmark, baseline="floor",
               note=f"Sample {BATCH} distinct items of d = {NO_REPEAT_D} (host tier, 1 thread); floor = a draw with "
                    f"replacement gathered into a reused buffer.")
