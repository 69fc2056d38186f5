"""The cross-process determinism check looks at the hash seed of the Ray workers a subprocess's endpoints use.

Two subprocesses with PYTHONHASHSEED 1 and 2 only compare hash-dependent draws if their Ray workers (a joined
cluster's shard servers, say) hash as they do; a job that joins a cluster without passing its seed on would pass
the check while comparing workers with one seed. Here such an endpoint is built in a subprocess and the check
must say so.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")

from conduit.testing import EndpointFactory, draws_in_subprocess  # noqa: E402
from conduit.testing.reference import CoreReplayEndpoint  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))  # the subprocess imports this module by name (see ANOTHER_SEED)

#: the address of the running cluster the subprocess joins (set by the test)
JOIN_ENV = "CONDUIT_TEST_JOIN_ADDRESS"


def _joined_with_seed_0(**kwargs: Any) -> CoreReplayEndpoint:
    """Core's replay endpoint, in a process that joined the cluster with its workers' hash seed fixed to 0."""
    if not ray.is_initialized():
        ray.init(address=os.environ[JOIN_ENV], log_to_driver=False, configure_logging=False,
                 runtime_env={"env_vars": {"PYTHONHASHSEED": "0"}})
    return CoreReplayEndpoint(**kwargs)


#: ``test_crossprocess_ray_hash_seed:ANOTHER_SEED``
ANOTHER_SEED = EndpointFactory("joined-with-another-seed", make_replay=_joined_with_seed_0)


def test_workers_with_another_hash_seed_fail_the_check(cluster: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(JOIN_ENV, cluster.cluster.address)
    got = draws_in_subprocess(f"{Path(__file__).stem}:ANOTHER_SEED", hash_seed=1)
    assert got.get("replay/uniform"), got  # the endpoint itself drew
    assert set(got.hashes) == {"process", "ray worker"}, got.hashes
    assert got.hashes["process"] != got.hashes["ray worker"]
    with pytest.raises(AssertionError, match=r"adapter 'joined-with-another-seed' .*PYTHONHASHSEED=1, hash\(\) in "
                                             r"its ray worker differs from the subprocess's own.*runtime_env"):
        got.check_hash_seed()
    # the subprocess's own hash agrees with a process of that seed: the probe is what the check says it is
    assert got.hashes["process"] == _hash_with_seed(1)


def _hash_with_seed(seed: int) -> int:
    import subprocess

    from conduit.testing.crossprocess import _HASH_PROBE

    out = subprocess.run([sys.executable, "-c", f"print(hash({_HASH_PROBE!r}))"], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONHASHSEED=str(seed)), check=True)
    return int(out.stdout)
