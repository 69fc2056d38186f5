"""Measure the multi-node tier on a local Ray cluster: ``python -m conduit.distributed.measure``.

Starts a 2-node :func:`~conduit.distributed.testing.local_cluster` (head = learner, one
worker), then prints Markdown tables of:

* the measured links between the nodes (what the shard plan uses), through the object store
  and through a torch.distributed (gloo) group;
* delivery latency of ``deliver(batch)`` from a shard on the learner's node (object store,
  no copy) and from a shard on the other node (one transfer), next to the single-machine
  :class:`~conduit.ExperienceDataPlane` on the host tier, through both transports, as ratios in one run;
* loss detection: the time from killing a node (a crash, no drain) to the loss report.

Needs pytest (for :mod:`conduit.distributed.testing`) and Ray.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from conduit.placement.profile import _median_seconds

__all__ = ["main"]


def _median_ms(fn: Any, repeats: int) -> float:
    return _median_seconds(fn, reps=repeats, warmup=1, min_total=0) * 1e3


def _delivery(lc: Any, servers: Any, dims: Sequence[int], batch: int, repeats: int) -> list[dict[str, Any]]:
    from conduit import ExperienceDataPlane, ExperienceSchema, Field, Replay
    from conduit.distributed.plane import DistributedDataPlane

    rows = []
    for d in dims:
        schema = ExperienceSchema(obs=Field((d,), torch.float32), action=Field((), torch.int64))
        n = 4 * batch
        data = {"obs": torch.randn(n, d), "action": torch.arange(n)}
        row: dict[str, Any] = {"obs_dim": d, "batch": batch, "MB_per_batch": batch * (4 * d + 8) / 1e6}
        host = ExperienceDataPlane(schema, capacity=n, semantics=Replay(seed=0))
        host.ingest(data)
        row["host_tier_ms"] = _median_ms(lambda h=host: h.deliver(batch), repeats)
        for transport, tag in (("object_store", ""), ("torch", "torch_")):
            for where, node in (("same_node_shard_ms", lc.head), ("other_node_shard_ms", lc.workers[0])):
                with DistributedDataPlane(schema, capacity=n, servers=servers, health_period=None,
                                          transport=transport) as p:
                    p.ingest(data, node=node)
                    row[tag + where] = _median_ms(lambda p=p: p.deliver(batch), repeats)
        row["same_vs_host"] = row["same_node_shard_ms"] / row["host_tier_ms"]
        row["other_vs_same"] = row["other_node_shard_ms"] / row["same_node_shard_ms"]
        row["torch_vs_object_store_other"] = row["torch_other_node_shard_ms"] / row["other_node_shard_ms"]
        rows.append(row)
    return rows


def _detection(lc: Any, trials: int) -> list[float]:
    from conduit.distributed.plane import DistributedDataPlane
    from conduit.distributed.servers import ShardServers
    from conduit.testing.reference import ID_SCHEMA, id_batch

    out = []
    for _ in range(trials):
        victim = lc.add_node()
        servers = ShardServers([lc.workers[0], victim])
        with DistributedDataPlane(ID_SCHEMA, capacity=1000, servers=servers, health_period=0.2, timeout=10.0,
                                  measure=False) as p:
            p.ingest(id_batch(np.arange(100)), node=victim)
            t0 = time.monotonic()
            lc.kill_node(victim)
            while not p.losses and time.monotonic() - t0 < 120:
                time.sleep(0.02)
            out.append(time.monotonic() - t0)
        servers.shutdown()
    return out


def _table(rows: list[dict[str, Any]]) -> str:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        lines.append("| " + " | ".join(f"{v:.3g}" if isinstance(v, float) else str(v) for v in r.values()) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m conduit.distributed.measure")
    p.add_argument("--dims", default="128,5000")
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--kills", type=int, default=2)
    p.add_argument("--json", help="also write the results here")
    a = p.parse_args(list(argv) if argv is not None else None)
    from conduit.distributed.servers import ShardServers
    from conduit.distributed.testing import local_cluster

    with local_cluster(2) as lc:
        servers = ShardServers([lc.head, lc.workers[0]])
        links = servers.links(refresh=True)
        torch_links = servers.torch_group().links
        delivery = _delivery(lc, servers, [int(x) for x in a.dims.split(",")], a.batch, a.repeats)
        servers.shutdown()
        names = {lc.head[:8]: "head (learner)", lc.workers[0][:8]: "worker"}
        detect = _detection(lc, a.kills)
    link_rows = [{**r, "src": names.get(r["src"], r["src"]), "dst": names.get(r["dst"], r["dst"])}
                 for r in links.table()]
    torch_rows = [{**r, "src": names.get(r["src"], r["src"]), "dst": names.get(r["dst"], r["dst"])}
                  for r in torch_links.table()]
    print("## Links (measured)\n\n" + _table(link_rows))
    print("\n## torch.distributed (gloo) links, server -> learner (measured)\n\n" + _table(torch_rows))
    print("\n## Delivery, median ms\n\n" + _table(delivery))
    print("\n## Loss detection after a node is killed (s)\n\n" + ", ".join(f"{x:.2f}" for x in detect))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"links": link_rows, "torch_links": torch_rows, "delivery": delivery,
                       "detection_s": detect}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
