"""SRL adapter: samples/s and ``get`` latency through SRL's call pattern, Conduit buffer vs a plain FIFO buffer.

Both buffers have the same queue semantics (batches of ``BATCH`` samples in arrival order, each
delivered once) and sit in the same driver (:class:`conduit_srl.testing.driver.SrlDriver`): two
actor threads post ``[T, d]`` samples over ZMQ PUSH/PULL on 127.0.0.1 and flush every poll, the
trainer's main thread runs ``consume_to(buffer, max_iter=1024)``, and a training thread runs
``empty()``/``get()`` with a simulated ``STEP_S`` learner step after each entry.

* ``fifo``: :class:`conduit_srl.testing.fifo.FifoBuffer`, SRL's queue buffer behaviour made
  thread-safe: ``put`` stacks a batch (``[T, B, d]``) in the consuming thread once ``BATCH``
  samples wait, ``get`` pops it.
* ``conduit``: :class:`conduit_srl.ConduitBuffer` (``semantics="queue"``, defaults: each put stored in
  ``put``, ``g_ing=1``; one entry assembled ahead by the assembler thread).
* ``... +coalesce8``: the same buffer behind a claimed stream: each actor's Conduit producer sends
  8 samples per message (``StreamPolicy(coalesce=8, max_delay_s=0.05)``); the Conduit consumer
  hands a message to the Conduit buffer as one ``put_batch``, to the FIFO as 8 ``put`` calls.

``test_put_path`` times the consuming thread's part alone: one thread puts ``SAMPLES`` samples and takes each
batch with ``get()``, no transport (table ``benchmarks/results/srl_put_path.md``, ratios to ``fifo``).

Per run: ``SAMPLES`` samples end to end (the benchmarked call), ``get`` latency (median, p95, as
the training thread measured it), and the consuming thread's time inside ``consume_to`` per
sample. Tables go to ``benchmarks/results/srl_driver.md``; nothing here asserts a speed.
Run: ``.venv/bin/python -m pytest benchmarks/test_bench_srl.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conduit_srl import ConduitBuffer, StreamPolicy
from conduit_srl.testing.driver import DriverReport, SrlDriver
from conduit_srl.testing.fifo import FifoBuffer
from conduit_srl.testing.records import make_sample

RESULTS = Path(__file__).parent / "results"
DIMS = (128, 5000)
BUFFERS = ("fifo", "conduit", "fifo+coalesce8", "conduit+coalesce8")
T = 8
BATCH = 32
ACTORS = 2
SAMPLES = 256
STEP_S = 0.002
ROUNDS = 5


def make(kind: str, **conduit_args: Any) -> Any:
    """The buffer of ``kind`` (``fifo...`` or ``conduit...``); ``conduit_args`` go to the ConduitBuffer."""
    if kind.startswith("fifo"):
        return FifoBuffer(batch_size=BATCH)
    return ConduitBuffer(batch_size=BATCH, capacity=SAMPLES, **conduit_args)


def close(buffer: Any) -> None:
    """Close ``buffer`` where it can be (the FIFO has nothing to close)."""
    done = getattr(buffer, "close", None)
    if done is not None:
        done()


_ROWS: dict[tuple[int, str], dict[str, float]] = {}


def drive(buffer: Any, d: int, policy: StreamPolicy | None = None) -> DriverReport:
    """One driver run of ``SAMPLES`` samples through ``buffer`` (closed afterwards), checked: a broken run is not a
    measurement."""
    try:
        r = SrlDriver(buffer, actors=ACTORS, samples_per_actor=SAMPLES // ACTORS, per_poll=4, time_steps=T, dim=d,
                      step_seconds=STEP_S, stream_policy=policy).run(timeout_s=300)
    finally:
        close(buffer)
    # every posted sample delivered exactly once (queue semantics), not merely as many deliveries as samples (a lost
    # sample and a repeated one would make up the count)
    assert r.received == SAMPLES and len(r.posted) == SAMPLES
    assert sorted(r.delivered_ids.tolist()) == sorted(r.posted), f"{buffer!r}: delivered ids are not the posted ids"
    return r


def run_once(kind: str, d: int, reports: list[DriverReport]) -> None:
    policy = StreamPolicy(coalesce=8, max_delay_s=0.05) if kind.endswith("coalesce8") else None
    reports.append(drive(make(kind), d, policy))


@pytest.mark.parametrize("kind", BUFFERS)
@pytest.mark.parametrize("d", DIMS, ids=lambda d: f"d{d}")
def test_driver_samples_per_second_and_get_latency(benchmark, kind: str, d: int) -> None:  # noqa: ANN001
    reports: list[DriverReport] = []
    benchmark.group = f"srl-driver-d{d}"
    benchmark.pedantic(run_once, args=(kind, d, reports), rounds=ROUNDS, iterations=1)
    stats = getattr(benchmark, "stats", None)
    if stats is None or not getattr(stats, "stats", None) or not stats.stats.data:
        return  # --benchmark-disable: a smoke run, no figures
    lat = np.concatenate([r.get_latencies for r in reports])
    consume = np.median([r.consume_seconds / SAMPLES for r in reports])
    row = {"run_s": stats.stats.median, "samples_per_s": SAMPLES / stats.stats.median,
           "get_median_ms": float(np.median(lat) * 1e3), "get_p95_ms": float(np.percentile(lat, 95) * 1e3),
           "consume_us_per_sample": float(consume * 1e6)}
    benchmark.extra_info.update(row)
    _ROWS[(d, kind)] = row


#: the put path alone: one thread puts, as SRL's consuming thread does, and takes each batch once it is complete;
#: the ConduitBuffer arguments of each Conduit kind (``conduit``: the defaults)
PUT_KINDS: dict[str, dict[str, Any]] = {"fifo": {}, "conduit": {}, "conduit-overlap": {"overlap": True},
                                        "conduit-sync": {"prefetch": 0}}


def _put_buffer(kind: str, d: int) -> Any:
    """A buffer for the put-path case, its storage built and one batch put and taken (a first put sizes it)."""
    buffer = make(kind, **PUT_KINDS[kind])
    for i in range(BATCH):
        buffer.put(make_sample([-1 - i], time_steps=T, dim=d))
    buffer.get()
    return buffer


@pytest.mark.parametrize("kind", list(PUT_KINDS))
@pytest.mark.parametrize("d", DIMS, ids=lambda d: f"d{d}")
def test_put_path(benchmark, ratios, kind: str, d: int) -> None:  # noqa: ANN001
    """``SAMPLES`` puts of one ``[T, d]`` sample each from one thread, with a ``get()`` after every ``BATCH`` of
    them: the work SRL's consuming thread does per sample, without the transport. Per put; the buffers' own
    first-put sizing is done before the timed calls."""
    samples = [make_sample([i], time_steps=T, dim=d) for i in range(SAMPLES)]
    buffers: list[Any] = []  # the last round's is closed at the end (pytest-benchmark runs no teardown without
    # statistics)

    def close_all() -> None:
        while buffers:
            close(buffers.pop())

    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        close_all()  # (the previous round's, outside the timed call)
        buffers.append(_put_buffer(kind, d))
        return (buffers[-1],), {}

    def run(buffer: Any) -> None:
        ids = []
        for i, sample in enumerate(samples):
            buffer.put(sample)
            if (i + 1) % BATCH == 0:
                ids.append(np.asarray(buffer.get().sample.id)[0])
        # queue semantics: every sample once, in put order
        assert np.concatenate(ids).tolist() == list(range(SAMPLES)), f"{kind}: delivered ids are not the put ids"

    benchmark.group = f"srl-put-d{d}"
    try:
        benchmark.pedantic(run, setup=setup, rounds=ROUNDS, iterations=1)
    finally:
        close_all()
    ratios.add("srl_put_path", f"d={d}", kind, benchmark, baseline="fifo",
               note=f"One thread puts {SAMPLES} `[T={T}, d]` samples and takes each batch of {BATCH} with `get()` "
                    f"(no transport). `conduit`: `ConduitBuffer` defaults (stored in `put`, one entry assembled "
                    f"ahead); `conduit-overlap`: `overlap=True` (puts stored by a background worker); "
                    f"`conduit-sync`: `prefetch=0` (stored in `put`, assembled in `get`).")


@pytest.fixture(scope="module", autouse=True)
def _write_table():  # noqa: ANN202
    yield
    if not _ROWS:
        return
    lines = ["# SRL adapter through SRL's call pattern", "",
             f"{ACTORS} actors -> ZMQ (127.0.0.1) -> consume_to -> buffer -> training thread (empty/get, "
             f"{STEP_S * 1e3:.0f} ms step); T = {T}, batch {BATCH}, {SAMPLES} samples per run, median of "
             f"{ROUNDS} runs; ratio = row / plain `fifo` of the same d, same run.", "",
             "| d | buffer | samples/s | get median | get p95 | consume_to per sample |",
             "|---|---|---|---|---|---|"]
    for d in DIMS:
        base = _ROWS.get((d, "fifo"))
        for kind in BUFFERS:
            row = _ROWS.get((d, kind))
            if row is None:
                continue
            cells = []
            for key, fmt in (("samples_per_s", "{:.0f}"), ("get_median_ms", "{:.3f} ms"), ("get_p95_ms", "{:.3f} ms"),
                             ("consume_us_per_sample", "{:.1f} us")):
                cell = fmt.format(row[key])
                if base and kind != "fifo" and base[key]:
                    cell += f" ({row[key] / base[key]:.2f}x)"
                cells.append(cell)
            lines.append(f"| {d} | {kind} | " + " | ".join(cells) + " |")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "srl_driver.md").write_text("\n".join(lines) + "\n")
