"""A ``num_epochs`` that is no int, through RLlib's real PPO torch learner (no Ray cluster): RLlib's
``MiniBatchCyclicIterator`` cuts minibatches while some row was covered fewer than ``num_epochs`` times, so it
makes ceil(num_epochs) passes; Conduit cut int(num_epochs) (2.5 -> 2, and 0.5 was refused), training fewer
minibatches than the stock learner for the same config. A non-finite count is refused typed, changing nothing."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from conduit_rllib import UnsupportedConfigError
from ray.rllib.core.learner.training_data import TrainingData

sys.path.insert(0, str(Path(__file__).parent))
from test_on_policy_learner_state_and_refusals import (  # noqa: E402, I001  (sibling test helpers)
    build_learner,
    conduit_update,
    rllib_minibatches,
    train_batch,
)


@pytest.fixture(scope="module")
def learner() -> Any:
    learner = build_learner()
    yield learner
    learner.conduit_feed.close()


@pytest.mark.parametrize(("rows", "minibatch_size", "num_epochs"), [
    (100, 30, 2.5),   # RLlib: 3 passes, ceil(300 / 30) = 10 minibatches (int() made 7)
    (100, 30, 1.5),   # RLlib: 2 passes, 7 minibatches (int() made 4)
    (100, 30, 0.5),   # RLlib: 1 pass, 4 minibatches (int() refused it as "no minibatch")
])
def test_a_fractional_num_epochs_cuts_rllibs_minibatches(learner: Any, rows: int, minibatch_size: int,
                                                         num_epochs: float) -> None:
    mbs, _, _ = conduit_update(learner, rows, minibatch_size=minibatch_size, num_epochs=num_epochs,  # type: ignore
                               shuffle=False)
    rllib = rllib_minibatches(rows, minibatch_size, num_epochs)  # type: ignore[arg-type]
    assert mbs == rllib, f"{len(mbs)} minibatches, RLlib's iterator cuts {len(rllib)}"


@pytest.mark.parametrize("num_epochs", [float("inf"), float("nan"), "3", None])
def test_a_num_epochs_that_is_no_finite_number_is_refused_typed_and_changes_nothing(learner: Any,
                                                                                    num_epochs: Any) -> None:
    version = learner.conduit_version
    with pytest.raises(UnsupportedConfigError, match="num_epochs"):
        learner._create_iterator_if_necessary(training_data=TrainingData(batch=train_batch(20)), num_epochs=num_epochs,
                                              minibatch_size=8, shuffle_batch_per_epoch=False)
    assert learner.conduit_version == version
    mbs, _, _ = conduit_update(learner, 20, minibatch_size=8, num_epochs=1, shuffle=False)
    assert mbs == rllib_minibatches(20, 8, 1)
