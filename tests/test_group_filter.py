"""The informative-group filter (DAPO's dynamic sampling) on its own: which groups pass, the
over-sampling cap, and the per-step counters."""

import pytest
import torch
from tensordict import TensorDict

from arealite.rollout.group_filter import InformativeGroupFilter, is_informative, prompt_key


def group(*rewards: float) -> TensorDict:
    return TensorDict({"rewards": torch.tensor(rewards)}, batch_size=[len(rewards)])


def test_a_group_is_informative_when_its_rewards_differ():
    assert is_informative(group(0.0, 1.0, 0.0))
    assert not is_informative(group(1.0, 1.0, 1.0))
    assert not is_informative(group(0.0, 0.0))
    assert not is_informative(group(0.5))  # one sample: no group-normalised advantage


def test_the_cap_bounds_drops_per_step_then_counters_rearm():
    f = InformativeGroupFilter(batch_size=4, max_oversample=1.5)  # at most 2 drops per step
    row = {"question": "1+1="}
    decisions = [f.should_accept(row, group(1.0, 1.0)) for _ in range(4)]
    decisions.append(f.should_accept(row, group(0.0, 1.0)))
    assert decisions == [False, False, True, True, True]
    assert f.take_stats() == {
        "rollout/groups_generated": 5,
        "rollout/groups_dropped": 2,
        "rollout/groups_accepted_uninformative": 2,
        "rollout/groups_all_solved": 4,
    }
    assert f.should_accept(row, group(1.0, 1.0)) is False  # a new step may drop again
    assert f.take_stats()["rollout/groups_dropped"] == 1


def test_equal_reward_groups_are_told_apart_as_all_solved_or_all_failed():
    f = InformativeGroupFilter(batch_size=4, max_oversample=3.0)
    for rewards in [(0.0, 1.0), (1.0, 1.0), (0.0, 0.0), (0.0, 0.0), (1.0, 1.0)]:
        f.should_accept({"question": "1+1="}, group(*rewards))
    stats = f.take_stats()
    assert stats["rollout/groups_generated"] - stats["rollout/groups_dropped"] == 1
    assert stats["rollout/groups_all_solved"] == 2  # the all-zero groups failed: best reward is 1


def test_an_oversample_below_one_is_refused():
    with pytest.raises(ValueError, match="max_oversample must be >= 1"):
        InformativeGroupFilter(batch_size=4, max_oversample=0.5)


def arith_row(expression: str, query_id: str) -> dict:
    return {
        "messages": [{"role": "user", "content": expression}],
        "answer": "0",
        "query_id": query_id,
    }


def test_rows_of_one_prompt_share_a_key_whatever_their_ids():
    assert prompt_key(arith_row("1+2+3=", "a-1")) == prompt_key(arith_row("1+2+3=", "a-7"))
    assert prompt_key(arith_row("1+2+3=", "a-1")) != prompt_key(arith_row("1+2+4=", "a-1"))
    long = torch.arange(5000)  # tensors keyed whole: repr would elide the middle of these
    other = long.clone()
    other[2500] = -1
    assert prompt_key({"input_ids": long}) != prompt_key({"input_ids": other})
    assert prompt_key({"text": "x", "id": 1}) == prompt_key({"text": "x", "id": 2})


def test_solved_prompts_are_skipped_ever_more_often_up_to_the_cap():
    f = InformativeGroupFilter(batch_size=4, max_oversample=3.0, skip_max_prob=0.9, seed=0)
    solved, mixed = arith_row("1+1+1=", "q1"), arith_row("9+9+9=", "q2")
    assert f.history.skip_prob(prompt_key(solved)) == 0.0
    assert f.should_start(solved) and f.should_start(mixed)  # no history: always generated
    for streak, expected in [(1, 0.5), (2, 0.75), (3, 0.875), (4, 0.9), (9, 0.9)]:
        while f.history._streak.get(prompt_key(solved), 0) < streak:
            f.should_accept(solved, group(1.0, 1.0))
        assert f.history.skip_prob(prompt_key(solved)) == pytest.approx(expected)
    assert f.should_accept(mixed, group(0.0, 1.0)) is True
    assert f.history.skip_prob(prompt_key(mixed)) == 0.0
    failed = arith_row("8+8+8=", "q3")  # every sample wrong: still generated every time
    for _ in range(5):
        f.should_accept(failed, group(0.0, 0.0))
    assert f.history.skip_prob(prompt_key(failed)) == 0.0
    starts = [f.should_start(solved) for _ in range(2000)]
    assert 1700 < 2000 - sum(starts) < 1900  # skipped about 90% of the time, never always
    assert all(f.should_start(mixed) for _ in range(100))
    assert f.take_stats()["rollout/groups_skipped"] == 2000 - sum(starts)
    f.should_accept(solved, group(0.0, 1.0))  # informative again: generated every time
    assert f.history.skip_prob(prompt_key(solved)) == 0.0


def test_without_a_skip_probability_nothing_is_skipped_or_counted():
    f = InformativeGroupFilter(batch_size=4, max_oversample=3.0)
    row = arith_row("1+1+1=", "q1")
    for _ in range(5):
        f.should_accept(row, group(1.0, 1.0))
    assert all(f.should_start(row) for _ in range(50))
    assert "rollout/groups_skipped" not in f.take_stats()
    with pytest.raises(ValueError, match=r"skip_max_prob must be in \[0, 1\)"):
        InformativeGroupFilter(batch_size=4, max_oversample=3.0, skip_max_prob=1.0)
