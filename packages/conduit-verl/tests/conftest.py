"""Shared fixtures: a tiny model built in code, verl's config for a CPU, a gloo process group."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A random-init 2-layer Llama (hidden 32), a BPE tokenizer trained in code, and toy prompts."""
    from conduit_verl.tiny import build

    return build(tmp_path_factory.mktemp("tiny"), train_size=16, val_size=4)


@pytest.fixture
def gloo() -> Iterator[None]:
    """A one-rank gloo process group in this process (what verl's in-process worker needs)."""
    import torch.distributed as dist

    port = free_port()
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
