"""Checking one hand-over against the schema: ``ExperienceBatch.checked``, its full path, and tensordict.

Every ``ingest`` checks what a producer hands over before anything is stored. This times that check alone for an
SRL-like sample (six fixed fields; observations of dimension d, action, reward, done, version, log-prob) of 64
rows, given as torch tensors or as NumPy arrays:

* ``checked``: :meth:`ExperienceBatch.checked`, which takes a single pass for a dict of exactly the schema's fields;
* ``full-path``: :meth:`ExperienceBatch.from_mapping` then :meth:`ExperienceBatch.validate` (what ``checked`` does
  for any other input);
* ``tensordict``: ``TensorDict(data, batch_size=[n])``, the batch container a TorchRL user would build (it checks
  the shared batch dimension, not dtypes or per-item shapes against a schema: it does less).

Run: ``.venv/bin/python -m pytest benchmarks/test_bench_batch.py``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from conduit import ExperienceSchema, Field
from conduit.batch import ExperienceBatch

ROWS = 64
DIMS = [128, 5000]
KINDS = ["torch", "numpy"]
CHECKS = ["checked", "full-path", "tensordict"]


def schema(d: int) -> ExperienceSchema:
    return ExperienceSchema({"obs": Field((d,)), "action": Field((), torch.int64), "reward": Field(()),
                             "done": Field((), torch.bool), "version": Field((), torch.int64),
                             "logp": Field(())})


def sample(d: int, kind: str) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    cols: dict[str, Any] = {"obs": rng.standard_normal((ROWS, d), dtype=np.float32),
                            "action": rng.integers(0, 4, ROWS), "reward": rng.standard_normal(ROWS, np.float32),
                            "done": rng.random(ROWS) < 0.1, "version": np.zeros(ROWS, np.int64),
                            "logp": rng.standard_normal(ROWS, np.float32)}
    return {k: torch.from_numpy(v) for k, v in cols.items()} if kind == "torch" else cols


def check_call(check: str, data: dict[str, Any], s: ExperienceSchema) -> Any:
    if check == "checked":
        return lambda: ExperienceBatch.checked(data, s)
    if check == "full-path":
        def full() -> ExperienceBatch:
            b = ExperienceBatch.from_mapping(data)
            b.validate(s)
            return b
        return full
    from tensordict import TensorDict

    return lambda: TensorDict(data, batch_size=[ROWS])


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("d", DIMS, ids=lambda d: f"d{d}")
def test_check_one_handover(benchmark: Any, d: int, kind: str, check: str, ratios: Any) -> None:
    s = schema(d)
    data = sample(d, kind)
    call = check_call(check, data, s)
    got = call()
    # every variant gives the same columns (torch tensors of the given values) before it is timed
    for name in s:
        col = got[name]
        assert isinstance(col, torch.Tensor) and col.shape[0] == ROWS, (check, name)
        assert torch.equal(col, torch.as_tensor(data[name])), (check, name)
    benchmark(call)
    ratios.add("batch_check", f"d={d} {kind}", check, benchmark, baseline="checked",
               note=f"One hand-over of {ROWS} rows, six fixed fields (obs of dimension d), checked against the "
                    "schema. `tensordict` checks only the shared batch dimension.")
