"""Nested train-batch columns through Conduit's on-policy feed: a dict or tuple of arrays (a Dict/Tuple action space,
a Dict observation such as an action-masking module's {"action_mask", "observations"}), nested to any depth, is
stored array by array and every minibatch carries it rebuilt as it came. What cannot be stored is refused typed,
naming the array by its path, and nothing is ingested. No Ray is started."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from conduit import SchemaError
from conduit_rllib import MinibatchFeed, UnsupportedConfigError

N = 10


def _rollout(n: int = N) -> dict[str, Any]:
    """Every array a function of the row id, so each delivered row can be checked against it."""
    row = torch.arange(n)
    return {"row_id": row, "advantages": row.float(),
            "obs": {"action_mask": (row[:, None] + torch.arange(2)) % 2 == 0,
                    "observations": row.float()[:, None] * torch.ones(3)},
            "actions": (row % 3, {"force": row.double()[:, None] / 2, "aim": (row.float()[:, None, None] *
                                                                            torch.ones(2, 2))})}


def _check_row_for_row(mb: dict[str, Any]) -> None:
    row = mb["row_id"]
    assert set(mb) == {"row_id", "advantages", "obs", "actions"}
    obs, actions = mb["obs"], mb["actions"]
    assert type(obs) is dict and list(obs) == ["action_mask", "observations"]
    assert type(actions) is tuple and len(actions) == 2 and type(actions[1]) is dict
    assert list(actions[1]) == ["force", "aim"], "the keys come back in the order they went in"
    want = _rollout(int(row.max()) + 1)
    assert torch.equal(obs["action_mask"], want["obs"]["action_mask"][row])
    assert torch.equal(obs["observations"], want["obs"]["observations"][row])
    assert torch.equal(actions[0], want["actions"][0][row])
    assert torch.equal(actions[1]["force"], want["actions"][1]["force"][row])
    assert torch.equal(actions[1]["aim"], want["actions"][1]["aim"][row])


@pytest.mark.parametrize("prefetch", [False, True])
def test_nested_columns_come_back_in_their_shape_row_for_row_each_row_once_per_epoch(prefetch: bool) -> None:
    feed = MinibatchFeed(minibatch_size=4, num_epochs=2, shuffle=True, seed=1, prefetch=prefetch)
    try:
        feed.ingest("default_policy", _rollout(), version=0)
        feed.seal()
        seen: list[int] = []
        for mab in feed.minibatches():
            mb = mab.policy_batches["default_policy"]
            _check_row_for_row(mb)
            seen += mb["row_id"].tolist()
        assert len(seen) == 20 and sorted(seen[:N]) == sorted(seen[N:]) == list(range(N))
    finally:
        feed.close()


def test_a_rollout_nested_otherwise_waits_until_the_waiting_one_is_delivered() -> None:
    """A tuple where a dict was (same arrays, same field names) is another rollout shape: refused while one waits,
    nothing ingested; taken once it was delivered, and delivered in its own shape."""
    feed = MinibatchFeed(minibatch_size=5, num_epochs=1, shuffle=False, seed=0, prefetch=False)
    try:
        as_dict = {"advantages": torch.zeros(5), "actions": {"0": torch.arange(5), "1": torch.ones(5, 2)}}
        as_tuple = {"advantages": torch.zeros(5), "actions": (torch.arange(5), torch.ones(5, 2))}
        feed.ingest("default_policy", as_dict, version=0)
        feed.seal()
        with pytest.raises(SchemaError, match=r"(?s)arrived while.*waiting; consume it first"):
            feed.ingest("default_policy", as_tuple, version=0)
        assert feed.edp is not None and len(feed.edp) == 5, "the refused rollout was ingested"
        (first,) = [m.policy_batches["default_policy"]["actions"] for m in feed.minibatches()]
        assert type(first) is dict and torch.equal(first["0"], torch.arange(5))
        feed.ingest("default_policy", as_tuple, version=0)
        feed.seal()
        (second,) = [m.policy_batches["default_policy"]["actions"] for m in feed.minibatches()]
        assert type(second) is tuple and torch.equal(second[0], torch.arange(5))
    finally:
        feed.close()


@pytest.mark.parametrize(("column", "error", "match"), [
    ({"obs": [np.zeros(6)]}, UnsupportedConfigError,
     r"(?s)'obs' is a list.*dicts and tuples of them.*without conduit_rllib.enable"),
    ({"obs": {"mask": np.zeros(6), "name": np.array(["x"] * 6)}}, UnsupportedConfigError, r"'obs\[name\]' holds <U1"),
    ({"actions": (np.zeros(6), None)}, UnsupportedConfigError, r"'actions\[1\]' is a NoneType"),
    ({"actions": {}}, UnsupportedConfigError, r"'actions' is a dict"),
    ({"obs": {"a": np.zeros(6)}, "obs[a]": np.ones(6)}, UnsupportedConfigError, r"'obs\[a\]' occurs twice"),
    ({"actions": (np.zeros(6), np.array(1.0, np.float32))}, SchemaError, r"'actions\[1\]' is a single value"),
], ids=["list", "string-leaf", "none-leaf", "empty", "path-collision", "0-d-leaf"])
def test_what_cannot_be_stored_is_refused_naming_its_path_and_nothing_is_ingested(
        column: dict[str, Any], error: type[Exception], match: str) -> None:
    feed = MinibatchFeed(minibatch_size=4, num_epochs=1, shuffle=False, seed=0, prefetch=False)
    try:
        with pytest.raises(error, match=match):
            feed.ingest("default_policy", {"advantages": torch.zeros(6), **column}, version=0)
        assert feed.edp is None, "a data plane was built for a refused rollout"
        feed.ingest("default_policy", {"advantages": torch.arange(6.0)}, version=0)
        feed.seal()
        assert [m.policy_batches["default_policy"]["advantages"].tolist() for m in feed.minibatches()] == \
            [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 0.0, 1.0]], "the next rollout is not delivered as it came (RLlib's cuts)"
    finally:
        feed.close()


def test_nested_arrays_of_another_row_count_are_refused_and_nothing_is_ingested() -> None:
    feed = MinibatchFeed(minibatch_size=4, num_epochs=1, shuffle=False, seed=0, prefetch=False)
    try:
        with pytest.raises(SchemaError):
            feed.ingest("default_policy", {"advantages": torch.zeros(6),
                                           "actions": (torch.zeros(6), torch.zeros(5))}, version=0)
        assert feed.edp is None or len(feed.edp) == 0
    finally:
        feed.close()
