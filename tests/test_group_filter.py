"""The informative-group filter (DAPO's dynamic sampling) on its own: which groups pass, the
over-sampling cap, and the per-step counters."""

import pytest
import torch
from tensordict import TensorDict

from arealite.rollout.group_filter import InformativeGroupFilter, is_informative


def group(*rewards: float) -> TensorDict:
    return TensorDict({"rewards": torch.tensor(rewards)}, batch_size=[len(rewards)])


def test_a_group_is_informative_when_its_rewards_differ():
    assert is_informative(group(0.0, 1.0, 0.0))
    assert not is_informative(group(1.0, 1.0, 1.0))
    assert not is_informative(group(0.0, 0.0))
    assert not is_informative(group(0.5))  # one sample: no group-normalised advantage


def test_the_cap_bounds_drops_per_step_then_counters_rearm():
    f = InformativeGroupFilter(batch_size=4, max_oversample=1.5)  # at most 2 drops per step
    decisions = [f(group(1.0, 1.0)) for _ in range(4)] + [f(group(0.0, 1.0))]
    assert decisions == [False, False, True, True, True]
    assert f.take_stats() == {
        "rollout/groups_generated": 5,
        "rollout/groups_dropped": 2,
        "rollout/groups_accepted_uninformative": 2,
    }
    assert f(group(1.0, 1.0)) is False  # a new step may drop again
    assert f.take_stats()["rollout/groups_dropped"] == 1


def test_an_oversample_below_one_is_refused():
    with pytest.raises(ValueError, match="max_oversample must be >= 1"):
        InformativeGroupFilter(batch_size=4, max_oversample=0.5)
