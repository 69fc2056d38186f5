"""The replay plug's ``on_stale="raise"``: a run that catches the error can go on.

A stale group under ``raise`` stayed in TransferQueue (the refusal clears nothing, by contract), and staleness only
grows, so every later ``sample`` raised again: nothing said which groups were stale and nothing public let a caller
drop them and continue. The error is now a :class:`~conduit_verl.replay.StaleGroupsError` naming the groups and
their trajectories, and ``ConduitReplayBuffer.drop_stale`` drops them (cleared, counted in
``conduit/stale_groups/sum``) so sampling goes on. Against a live TransferQueue with the Conduit backend.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_sync_sample_staleness import _buffer, _groups, _listing, _sample  # noqa: E402, I001

pytestmark = pytest.mark.requires("verl")


def _async_raise() -> Any:
    from conduit_verl.replay import ConduitReplayBuffer

    return ConduitReplayBuffer(trainer_mode="separate_async", trainer_config={}, max_off_policy_threshold=2,
                               max_off_policy_strategy="drop", sampler_kwargs={"on_stale": "raise"},
                               poll_interval=0.05)


class TestRaiseAndDropStale:
    """The tests share one live TransferQueue (``tq_shared``, ``_live_tq``'s configuration); each registers its groups
    in a partition of its own. (verl prefixes its own metrics of a partition other than ``train`` with
    ``validation/``; these tests check Conduit's ``conduit/...`` metrics, whose names do not depend on it.)"""

    TQ_BACKEND = ("Conduit", {"num_units": 1, "capacity": 8, "mean_length": 4})

    @pytest.mark.slow
    @pytest.mark.parametrize("mode", ["sync", "separate_async"])
    def test_raise_names_the_stale_groups_and_drop_stale_lets_sampling_go_on(self, tq_shared: Any, mode: str) -> None:
        from conduit import StaleExperienceError
        from conduit_verl.replay import StaleGroupsError

        part = tq_shared("train")  # this test's partition
        step = 2 if mode == "sync" else 4  # sync: threshold 1 (no version behind); async: threshold 2 (one behind)
        _groups({"old": ("finished", 1), "older": ("finished", 0), "new": ("finished", step)}, part)
        buf = _buffer("raise") if mode == "sync" else _async_raise()
        before = _listing(part)
        for _ in range(2):  # refused again and again while nothing drops them, TransferQueue unchanged
            _, err = _sample(buf, step, 1, part)
            assert isinstance(err, StaleGroupsError) and isinstance(err, StaleExperienceError), repr(err)
            assert _listing(part) == before, f"the refused sample changed TransferQueue ({err})"
        assert isinstance(err, StaleGroupsError)
        assert (err.uids, err.trajectories, err.global_steps, err.partition_id) == (["old", "older"], 2, step, part)
        assert "drop_stale" in str(err) and "'old'" in str(err), str(err)
        assert buf.drop_stale(step, part) == 2
        assert sorted(_listing(part)) == ["new", "new_0_0"], f"left in TransferQueue: {sorted(_listing(part))}"
        result, err2 = _sample(buf, step, 1, part)
        assert err2 is None, f"sampling did not go on after drop_stale: {err2!r}"
        batch, metrics = result
        assert list(batch.keys) == ["new_0_0"]
        assert metrics["conduit/stale_groups/sum"] == 2, "the groups drop_stale dropped were not reported"
        assert buf.drop_stale(step, part) == 0  # nothing stale left: a no-op

    @pytest.mark.slow
    def test_drop_stale_drops_nothing_under_wait_or_without_a_threshold(self, tq_shared: Any) -> None:
        """verl's dropless ``wait`` trains stale groups by design, and a null threshold disables the bound."""
        from conduit_verl.replay import ConduitReplayBuffer

        part = tq_shared("train")  # this test's partition
        _groups({"old": ("finished", 1), "new": ("finished", 9)}, part)
        before = _listing(part)
        wait = _buffer("wait")
        assert wait.drop_stale(9, part) == 0
        off = ConduitReplayBuffer(trainer_mode="sync", trainer_config={}, max_off_policy_threshold=None,
                                  max_off_policy_strategy="drop", sampler_kwargs={"on_stale": "raise"})
        assert off.drop_stale(9, part) == 0
        assert _listing(part) == before
