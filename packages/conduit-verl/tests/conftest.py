"""Shared fixtures: a tiny model built in code, verl's config for a CPU, a gloo process group."""

from __future__ import annotations

import itertools
import os
import signal
import socket
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


#: environment variable every Ray worker a test starts carries, so leftovers can be found by id
MARKER = "CONDUIT_TEST_RUN"


def marked_pids(marker: str) -> list[int]:
    """Processes whose environment carries ``MARKER=marker`` (started by one test run)."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if f"{MARKER}={marker}".encode() in (d / "environ").read_bytes():
                    pids.append(int(d.name))
            except OSError:
                continue
    return pids


def kill_marked(marker: str) -> None:
    """End, by id, every process a test run left behind (Ray workers outliving their raylet)."""
    for pid in marked_pids(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture
def reaper() -> Callable[[str], None]:
    """``reaper(marker)`` ends the processes a run tagged with ``CONDUIT_TEST_RUN=marker`` left behind."""
    return kill_marked


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


@pytest.fixture(scope="module")
def ray_local(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A local one-node Ray for this module (never someone else's cluster); yields the delivery trace directory.

    The node is kept running for the next module (``kept_cluster``): each module is a Ray job of its own, whose
    workers carry the module's environment."""
    from conduit.distributed.testing import kept_cluster

    trace = tmp_path_factory.mktemp("conduit-trace")
    marker = uuid.uuid4().hex
    env = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "RAY_AUTH_MODE": "disabled", "CONDUIT_VERL_TRACE_DIR": str(trace), MARKER: marker}
    try:
        with kept_cluster(1, num_cpus=8, object_store_memory=512 << 20, fast_failure_detection=False,
                          runtime_env={"env_vars": env}):
            yield trace
    finally:
        kill_marked(marker)


def _tq_init(backend: str, **cfg: Any) -> Any:
    """``tq.init`` on the local Ray with ``backend``: SimpleStorage (one unit), or Conduit configured by ``cfg``."""
    import transfer_queue as tq
    from omegaconf import OmegaConf

    conf: dict[str, Any] = {"backend": {"storage_backend": backend,
                                        "SimpleStorage": {"num_data_storage_units": 1, "total_storage_size": 4096}}}
    if backend == "Conduit":
        conf["backend"]["Conduit"] = cfg
    return tq.init(OmegaConf.create(conf))


@pytest.fixture
def tq_session(ray_local: Path) -> Iterator[Callable[..., Any]]:
    """``start(backend, **backend_cfg)``: a TransferQueue on the local Ray, closed afterwards."""
    import transfer_queue as tq

    started = []

    def start(backend: str, **cfg: Any) -> Any:
        started.append(True)
        return _tq_init(backend, **cfg)

    try:
        yield start
    finally:
        if started:
            tq.close()


@contextmanager
def _tq_running(backend: str, **cfg: Any) -> Iterator[None]:
    import transfer_queue as tq

    _tq_init(backend, **cfg)
    try:
        yield
    finally:
        tq.close()


@pytest.fixture(scope="module")
def tq_module(ray_local: Path) -> Callable[..., AbstractContextManager[None]]:
    """``with tq_module(backend, **backend_cfg):`` a TransferQueue on the local Ray, closed when the block ends: for a
    module-scoped fixture (``tq_session`` is per test), e.g. one computing references once before a class's
    ``tq_shared`` starts (one TransferQueue runs at a time in a process)."""
    return _tq_running


@pytest.fixture(scope="class")
def tq_shared(request: pytest.FixtureRequest, ray_local: Path) -> Iterator[Callable[[str], str]]:
    """One TransferQueue for every test of a class, started with the class's ``TQ_BACKEND = (backend, cfg)`` before
    its first test and closed after its last: for tests that each need only an empty store of one configuration
    (each start costs a controller and its units, seconds of CPU apiece).

    Yields ``fresh(name)``: ``name`` with a suffix no other test of the class got, for the test's partition ids,
    keys and field names (a field keeps its kind on every unit, whatever partition a sample is in). Keeping to its
    own names, a test sees an empty store and passes alone and in any order. A test that kills or restores units,
    or checks a start or a close, starts its own (``tq_session``)."""
    backend, cfg = request.cls.TQ_BACKEND
    if backend == "Conduit":
        import verl  # noqa: F401  (verl loads its plugins: conduit-verl registers the "Conduit" backend)
    count = itertools.count()
    with _tq_running(backend, **cfg):
        yield lambda name: f"{name}{next(count)}"
