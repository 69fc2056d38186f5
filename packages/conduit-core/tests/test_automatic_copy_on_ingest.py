"""A producer that reuses one array per env step (the usual env loop) may hand it to a buffer whose scheduler
copies it (``copy_on_ingest=True``). ``Overlapped`` took that setting; ``Automatic``, whose phases coalesce batches at
``g_ing`` and store them on a worker, had none: every batch it still held when the producer overwrote the array was
stored with the later step's values, and nothing could turn that off."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conduit import Automatic, ConfigurationError, ExperienceDataPlane, ExperienceSchema, Field, Replay

SCHEMA = ExperienceSchema(obs=Field((4,), torch.float32), step=Field((), torch.int64))
STEPS, ROWS = 40, 8


@pytest.mark.parametrize("kind", ["torch", "numpy"])
def test_automatic_copy_on_ingest_stores_each_step_of_a_reused_array(kind: str) -> None:
    edp = ExperienceDataPlane(SCHEMA, capacity=STEPS * ROWS, semantics=Replay(seed=0),
                              scheduler=Automatic(copy_on_ingest=True))
    obs: torch.Tensor | np.ndarray = torch.zeros(ROWS, 4) if kind == "torch" else np.zeros((ROWS, 4), np.float32)
    step: torch.Tensor | np.ndarray = (torch.zeros(ROWS, dtype=torch.int64) if kind == "torch"
                                       else np.zeros(ROWS, np.int64))
    for i in range(STEPS):
        obs[:] = i  # the producer's one array, overwritten every step before the buffer has stored the last
        step[:] = i
        edp.ingest({"obs": obs, "step": step})
    edp.flush()
    data = edp.state_dict()["storage"]["data"]
    want = torch.arange(STEPS).repeat_interleave(ROWS)
    assert torch.equal(data["step"], want), "a handed-over batch was stored with a later step's values"
    assert torch.equal(data["obs"], want[:, None].float().expand(-1, 4))
    edp.close()


@pytest.mark.parametrize("bad", ["false", 1, None])
def test_automatic_copy_on_ingest_is_a_bool(bad: object) -> None:
    with pytest.raises(ConfigurationError, match="copy_on_ingest must be True or False"):
        Automatic(copy_on_ingest=bad)  # type: ignore[arg-type]
