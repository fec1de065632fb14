"""A reward that fails: each kind of failure logged once (then by count), and a reward that is
plainly broken stops the run (every call of a step failed, or too many in a window)."""

from __future__ import annotations

import asyncio
import logging

import pytest
import workflow_rewards

from arealite.api.cli_args import ConfigError, RolloutConfig
from arealite.api.reward_api import FailFast
from arealite.reward.errors import RewardErrors, RewardFailFastError
from arealite.reward.pool import RewardPool


def _boom(i: int) -> ValueError:
    try:
        raise ValueError(f"bad row {i}")
    except ValueError as e:
        return e


def test_a_step_whose_calls_all_failed_stops_with_the_counts_and_first_traceback(caplog):
    errors = RewardErrors("my.py:score", FailFast(steps=1, max_error_rate=1.0, window=8))
    with caplog.at_level(logging.WARNING, logger="arealite.reward"):
        for i in range(3):
            errors.failed("ValueError", _boom(i))
        errors.failed("timeout after 1s")
        with pytest.raises(RewardFailFastError) as e:
            errors.end_step()
    text = str(e.value)
    assert "reward my.py:score is broken: all 4 of its calls in a step failed" in text
    assert "ValueError x3, timeout after 1s x1" in text
    assert "Traceback" in text and "ValueError: bad row 0" in text  # the first one
    assert caplog.text.count("bad row") == 1  # once per kind, not per call
    with pytest.raises(RewardFailFastError):  # and every later failure stops too
        errors.failed("ValueError", _boom(9))


@pytest.mark.parametrize("batch", [1, 16, 1000])
def test_whatever_the_batch_size_the_first_all_failed_step_stops(batch):
    errors = RewardErrors("r", FailFast(max_error_rate=1.0))  # the step rule alone
    for _ in range(batch):
        errors.failed("KeyError", KeyError("x"))
    with pytest.raises(RewardFailFastError, match=f"all {batch} of its calls in a step failed"):
        errors.end_step()


def test_a_step_with_one_success_or_no_calls_runs_on_and_n_steps_in_a_row_stop():
    errors = RewardErrors("r", FailFast(steps=2, max_error_rate=1.0))
    errors.end_step()  # no calls this step (scored earlier): nothing to judge
    for _ in range(7):
        errors.failed("KeyError", KeyError("x"))
    errors.ok()
    errors.end_step()  # 7 of 8 failed: a bad step, not a broken reward
    errors.failed("KeyError", KeyError("x"))
    errors.end_step()  # the first all-failed step of 2 in a row
    errors.end_step()  # no calls: the count holds
    errors.failed("KeyError", KeyError("x"))
    with pytest.raises(RewardFailFastError, match=r"calls in a step failed \(2 steps in a row\)"):
        errors.end_step()
    evaluation = RewardErrors("r", FailFast(max_error_rate=1.0))
    evaluation.failed("KeyError", KeyError("x"))
    with pytest.raises(RewardFailFastError, match="all 1 of its calls in an evaluation failed"):
        evaluation.end_step("evaluation")
    off = RewardErrors("r", FailFast(steps=0, max_error_rate=1.0))
    off.failed("KeyError", KeyError("x"))
    off.end_step()  # 0 = off


def test_error_rate_over_a_window_and_occasional_errors_run_on(caplog):
    policy = FailFast(steps=1, max_error_rate=0.5, window=8)
    errors = RewardErrors("r", policy)
    with caplog.at_level(logging.WARNING, logger="arealite.reward"):
        for i in range(100):  # one call in four fails: below the rate; steps of 4 calls
            errors.failed("KeyError", KeyError("x")) if i % 4 == 0 else errors.ok()
            if i % 4 == 3:
                errors.end_step()
    assert errors.kinds["KeyError"] == 25 and errors.tripped is None
    assert "KeyError 10 times so far" in caplog.text and "11 times" not in caplog.text
    for _ in range(4):
        errors.ok()
    with pytest.raises(RewardFailFastError, match=r"5 of its last 8 calls failed \(over "):
        for _ in range(5):
            errors.failed("KeyError", KeyError("x"))


def test_a_real_pool_stops_at_the_end_of_the_step_on_a_reward_that_always_raises(caplog):
    pool = RewardPool(workflow_rewards.raises, max_workers=1, timeout=30, fail_fast=FailFast())

    async def call(n):
        return [await pool("p", "c", [1], [2]) for _ in range(n)]

    try:
        with caplog.at_level(logging.WARNING, logger="arealite.reward"):
            assert asyncio.run(call(3)) == [0.0, 0.0, 0.0]  # scored 0 until the step ends
            with pytest.raises(RewardFailFastError) as e:
                pool.end_step()
        assert "reward raises is broken: all 3 of its calls in a step failed" in str(e.value)
        assert "reward exploded on purpose" in str(e.value)  # the worker's traceback
        assert caplog.text.count("reward exploded on purpose") == 1
        assert pool.stats["errors"] == 3
    finally:
        pool.close()


def test_config_knobs_are_validated():
    cfg = RolloutConfig(reward_fail_fast_steps=2, max_reward_error_rate=0.25)
    assert cfg.reward_fail_fast() == FailFast(2, 0.25, 256)
    assert RolloutConfig().reward_fail_fast() == FailFast(1, 0.5, 256)
    for bad in (
        {"max_reward_error_rate": 1.5},
        {"reward_error_window": 0},
        {"reward_fail_fast_steps": -1},
        {"no_signal_steps": -1},
    ):
        with pytest.raises(ConfigError, match="rollout."):
            RolloutConfig(**bad)
