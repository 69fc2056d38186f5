"""Conduit's Experience Data Plane under RLlib: DQN, SAC and PPO, with one call.

    config = conduit_rllib.enable(DQNConfig().environment("CartPole-v1"))
    algo = config.build_algo()

See :func:`conduit_rllib.enable`. Importing this package imports RLlib (a few seconds).
"""

from conduit_rllib.delivery import ConduitMultiAgentSample, ConduitSampledEpisodes
from conduit_rllib.enable import SUPPORTED_ALGORITHMS, enable, is_enabled
from conduit_rllib.errors import UnsupportedAlgorithmError, UnsupportedConfigError
from conduit_rllib.learner import (
    ConduitDQNTorchLearner,
    ConduitOffPolicyLearner,
    ConduitOnPolicyLearner,
    ConduitPPOTorchLearner,
    ConduitSACTorchLearner,
)
from conduit_rllib.multi_agent import (
    ConduitMultiAgentEpisodeReplayBuffer,
    ConduitMultiAgentPrioritizedEpisodeReplayBuffer,
)
from conduit_rllib.on_policy import MinibatchFeed
from conduit_rllib.replay import ConduitEpisodeReplayBuffer, ConduitPrioritizedEpisodeReplayBuffer

__version__ = "0.1.0"

__all__ = [
    "enable",
    "is_enabled",
    "SUPPORTED_ALGORITHMS",
    "ConduitEpisodeReplayBuffer",
    "ConduitPrioritizedEpisodeReplayBuffer",
    "ConduitMultiAgentEpisodeReplayBuffer",
    "ConduitMultiAgentPrioritizedEpisodeReplayBuffer",
    "ConduitSampledEpisodes",
    "ConduitMultiAgentSample",
    "MinibatchFeed",
    "ConduitOffPolicyLearner",
    "ConduitOnPolicyLearner",
    "ConduitDQNTorchLearner",
    "ConduitSACTorchLearner",
    "ConduitPPOTorchLearner",
    "UnsupportedAlgorithmError",
    "UnsupportedConfigError",
    "__version__",
]
