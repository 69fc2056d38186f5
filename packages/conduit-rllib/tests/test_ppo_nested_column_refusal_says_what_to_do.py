"""A PPO train batch whose observations are nested (a Dict observation space, e.g. an action-masking module's
{"action_mask", "observations"}) cannot go through Conduit's on-policy feed: the refusal is typed and says what
to do. No Ray is started."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conduit_rllib import MinibatchFeed, UnsupportedConfigError


def test_a_nested_observation_column_is_refused_naming_the_column_and_what_to_do() -> None:
    """Before: 'Train-batch column 'obs' is a dict; ... (nested observation spaces and RNN states are not
    supported)', naming no way on."""
    feed = MinibatchFeed(minibatch_size=4, num_epochs=1, shuffle=False, seed=0, prefetch=False)
    try:
        with pytest.raises(UnsupportedConfigError, match=r"(?s)'obs'.*FlattenObservations.*without "
                                                         r"conduit_rllib.enable"):
            feed.ingest("default_policy", {"advantages": torch.zeros(6),
                                           "obs": {"action_mask": np.ones((6, 2)), "observations": np.zeros((6, 3))}},
                        version=0)
    finally:
        feed.close()


def test_a_nested_actions_column_is_refused_naming_the_action_space_not_observations() -> None:
    """A Dict/Tuple action space gives a nested 'actions' column (RLlib's stock PPO module on such a space is refused
    when the learner is built, test_ppo_nested_action_space_refused_at_build.py; a module class of your own that
    hands the learner nested actions reaches this refusal in its first update). Before: the refusal told the user to
    flatten observations (FlattenObservations), which
    leaves the actions as they are."""
    feed = MinibatchFeed(minibatch_size=4, num_epochs=1, shuffle=False, seed=0, prefetch=False)
    try:
        with pytest.raises(UnsupportedConfigError, match=r"(?s)'actions'.*action space.*Box, Discrete or "
                                                         r"MultiDiscrete.*without conduit_rllib.enable") as e:
            feed.ingest("default_policy", {"advantages": torch.zeros(6),
                                           "actions": (np.zeros(6, np.int64), np.ones(6, np.int64))}, version=0)
        assert "FlattenObservations" not in str(e.value)
    finally:
        feed.close()
