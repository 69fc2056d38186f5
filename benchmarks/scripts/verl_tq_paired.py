"""verl's TransferQueue get and put, paired: Conduit vs SimpleStorage in alternating rounds (outside CI).

``benchmarks/test_bench_verl.py`` runs one backend after the other in one session (SimpleStorage first), so a
drift of the machine, or what the first backend left behind (Ray's object store, the allocator), lands on one of
them. Here each round starts both backends afresh in a shuffled order (``tq.init`` ... ``tq.close``) and times
``--calls`` gets and puts of the same 256 GRPO trajectories (``test_bench_verl.trajectories``) on each; the ratio
Conduit / SimpleStorage is taken within the round. Each cell: the median of the per-round ratios with its 95%
bootstrap interval, and the two medians in ms. Every get is checked to return what was put, and the last put of
each timing to have stored it.

For Conduit the round also splits the get (medians, ms): the unit's gather (its telemetry), the unit call's round
trip (gather, then Ray's copy of the reply into the object store and back), and the reader's rebuild (the
copy into memory it owns and the jagged tensors).

    .venv/bin/python benchmarks/scripts/verl_tq_paired.py [--lengths 1024 4096 8192] [--rounds 6]

Writes ``benchmarks/results/verl_tq_paired.md``.
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from conduit.placement.profile import _median_seconds  # noqa: E402
from config_sweep import bootstrap_ci  # noqa: E402
from test_bench_verl import N, same_back, trajectories  # noqa: E402

BACKENDS = ["SimpleStorage", "Conduit"]
FIELDS = ["input_ids", "responses", "response_mask", "rollout_log_probs", "uid"]
_keys = itertools.count()


def median_ms(fn: Callable[[], Any], calls: int, before: Callable[[], Any] | None = None, warmup: int = 0) -> float:
    """Median wall milliseconds of ``calls`` calls of ``fn`` (``before`` runs untimed before each)."""
    return _median_seconds(fn, reps=calls, warmup=warmup, before=before, min_total=0) * 1e3


def one_backend(backend: str, td: Any, calls: int, split: dict[str, list[float]]) -> tuple[float, float]:
    """(get ms, put ms) of ``backend``, started and closed here; for Conduit, the get's parts into ``split``."""
    import transfer_queue as tq
    from omegaconf import OmegaConf

    conf = {"backend": {"storage_backend": backend,
                        "SimpleStorage": {"num_data_storage_units": 1, "total_storage_size": 4 * N},
                        "Conduit": {"num_units": 1, "capacity": 4 * N, "mean_length": 4096}}}
    tq.init(OmegaConf.create(conf))
    try:
        keys = [f"k{i}" for i in range(N)]
        tq.kv_batch_put(keys=keys, partition_id="p", fields=td, tags=[{}] * N)
        same_back(tq.kv_batch_get(keys=keys, partition_id="p", select_fields=FIELDS), td)
        get = median_ms(lambda: tq.kv_batch_get(keys=keys, partition_id="p", select_fields=FIELDS), calls)
        if backend == "Conduit":
            conduit_split(keys, calls, split)
        tq.kv_clear(keys=keys, partition_id="p")
        live: list[list[str]] = []

        def fresh() -> None:  # (untimed: the last put's keys cleared, new ones made)
            while live:
                tq.kv_clear(keys=live.pop(), partition_id="p")
            live.append([f"r{next(_keys)}" for _ in range(N)])

        put_ms = median_ms(lambda: tq.kv_batch_put(keys=live[-1], partition_id="p", fields=td, tags=[{}] * N),
                           calls, before=fresh, warmup=1)  # (a first put of fresh keys untimed, as the benchmark's)
        same_back(tq.kv_batch_get(keys=live[-1], partition_id="p", select_fields=FIELDS), td)  # the last put stored it
        while live:
            tq.kv_clear(keys=live.pop(), partition_id="p")
        return get, put_ms
    finally:
        tq.close()


def conduit_split(keys: list[str], calls: int, split: dict[str, list[float]]) -> None:
    import ray
    import transfer_queue.interface as tqi
    from conduit_verl import packing, tq_storage

    unit = tqi._TQ_CLIENT.storage_manager.units[0]
    meta = tqi._TQ_CLIENT.kv_retrieve_meta(keys=keys, partition_id="p", create=False)
    gis = [int(g) for g in meta.global_indexes]
    before = ray.get(unit.stats.remote())["telemetry"]["get"]
    reply: list[Any] = []
    split["unit call"].append(median_ms(lambda: reply.append(ray.get(unit.get.remote(gis, FIELDS))), calls))
    after = ray.get(unit.stats.remote())["telemetry"]["get"]
    split["unit gather"].append((after["seconds"] - before["seconds"]) / (after["calls"] - before["calls"]) * 1e3)
    parts = packing.objects_from_wire(reply[-1])

    def rebuild() -> None:
        for f in FIELDS:
            if isinstance(parts[f], dict):
                packing.unpack_column(tq_storage._owned(packing.from_wire(parts[f])))

    split["reader rebuild"].append(median_ms(rebuild, calls))


def cell(num: list[float], den: list[float], rng: random.Random) -> str:
    ratios = [a / b for a, b in zip(num, den, strict=True)]
    lo, hi = bootstrap_ci(ratios, rng=rng)
    return (f"{statistics.median(num):.0f} / {statistics.median(den):.0f} ms, "
            f"{statistics.median(ratios):.2f}x ({lo:.2f}-{hi:.2f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8192])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--machine", default="(not described)", help="the machine and its load, for the record")
    ap.add_argument("--out", type=Path, default=HERE.parent / "results" / "verl_tq_paired.md")
    args = ap.parse_args()
    import ray
    import verl  # noqa: F401  (loads conduit-verl's plugin: the "Conduit" backend)

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    rng = random.Random(0)
    rows = []
    try:
        for length in args.lengths:
            td = trajectories(N, length)
            got: dict[str, dict[str, list[float]]] = {b: {"get": [], "put": []} for b in BACKENDS}
            split: dict[str, list[float]] = {"unit gather": [], "unit call": [], "reader rebuild": []}
            for _ in range(args.rounds):
                order = list(BACKENDS)
                rng.shuffle(order)
                for backend in order:
                    g, p = one_backend(backend, td, args.calls, split)
                    got[backend]["get"].append(g)
                    got[backend]["put"].append(p)
            c, s = got["Conduit"], got["SimpleStorage"]
            parts = ", ".join(f"{k} {statistics.median(v):.1f}" for k, v in split.items())
            row = (f"| 256 x {length} | {cell(c['get'], s['get'], rng)} | {cell(c['put'], s['put'], rng)} "
                   f"| {parts} |")
            rows.append(row)
            print(row, flush=True)
    finally:
        ray.shutdown()
    lines = ["# verl_tq_paired", "",
             f"Conduit / SimpleStorage, TransferQueue's `kv_batch_get` and `kv_batch_put` (256 GRPO trajectories, "
             f"one storage unit, one local Ray instance), {args.rounds} rounds, each starting both backends afresh "
             f"in a shuffled order, {args.calls} calls each per round. Each cell: the medians (Conduit / "
             "SimpleStorage), then the median of the per-round ratios with its 95% bootstrap interval. "
             "`benchmarks/scripts/verl_tq_paired.py`.", "", f"Machine: {args.machine}", "",
             "| batch | get | put | Conduit's get, split (ms) |", "|---|---|---|---|", *rows, ""]
    args.out.write_text("\n".join(lines))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
