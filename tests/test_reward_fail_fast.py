"""A reward that fails: each kind of failure logged once (then by count), and a reward that is
plainly broken stops the run (the first N calls all failed, or too many in a window)."""

from __future__ import annotations

import asyncio
import logging

import pytest
import workflow_rewards

from arealite.api.cli_args import ConfigError, InferenceEngineConfig
from arealite.reward.pool import RewardPool
from arealite.utils.reward_errors import FailFast, RewardErrors, RewardFailFastError


def _boom(i: int) -> ValueError:
    try:
        raise ValueError(f"bad row {i}")
    except ValueError as e:
        return e


def test_first_calls_all_failing_stop_with_the_counts_and_first_traceback(caplog):
    errors = RewardErrors("my.py:score", FailFast(first_calls=4, max_error_rate=1.0, window=8))
    with caplog.at_level(logging.WARNING, logger="arealite.reward"):
        for i in range(3):
            errors.failed("ValueError", _boom(i))
        with pytest.raises(RewardFailFastError) as e:
            errors.failed("timeout after 1s")
    text = str(e.value)
    assert "reward my.py:score is broken: its first 4 calls all failed" in text
    assert "ValueError x3, timeout after 1s x1" in text
    assert "Traceback" in text and "ValueError: bad row 0" in text  # the first one
    assert caplog.text.count("bad row") == 1  # once per kind, not per call
    with pytest.raises(RewardFailFastError):  # and every later failure stops too
        errors.failed("ValueError", _boom(9))


def test_error_rate_over_a_window_and_occasional_errors_run_on(caplog):
    policy = FailFast(first_calls=4, max_error_rate=0.5, window=8)
    errors = RewardErrors("r", policy)
    with caplog.at_level(logging.WARNING, logger="arealite.reward"):
        for i in range(100):  # one call in four fails: below the rate, and not the first 4
            errors.failed("KeyError", KeyError("x")) if i % 4 == 0 else errors.ok()
    assert errors.kinds["KeyError"] == 25 and errors.tripped is None
    assert "KeyError 10 times so far" in caplog.text and "11 times" not in caplog.text
    for _ in range(4):
        errors.ok()
    with pytest.raises(RewardFailFastError, match=r"5 of its last 8 calls failed \(over "):
        for _ in range(5):
            errors.failed("KeyError", KeyError("x"))


def test_a_real_pool_stops_on_a_reward_that_always_raises(caplog):
    pool = RewardPool(workflow_rewards.raises, max_workers=1, timeout=30,
                      fail_fast=FailFast(first_calls=3))  # fmt: skip

    async def call(n):
        return [await pool("p", "c", [1], [2]) for _ in range(n)]

    try:
        with caplog.at_level(logging.WARNING, logger="arealite.reward"):
            assert asyncio.run(call(2)) == [0.0, 0.0]  # scored 0, the run goes on
            with pytest.raises(RewardFailFastError) as e:
                asyncio.run(call(1))
        assert "its first 3 calls all failed" in str(e.value)
        assert "reward exploded on purpose" in str(e.value)  # the worker's traceback
        assert caplog.text.count("reward exploded on purpose") == 1
        assert pool.stats["errors"] == 3
    finally:
        pool.close()


def test_config_knobs_are_validated():
    cfg = InferenceEngineConfig(reward_fail_fast_calls=8, max_reward_error_rate=0.25)
    assert cfg.reward_fail_fast() == FailFast(8, 0.25, 256)
    for bad in ({"max_reward_error_rate": 1.5}, {"reward_error_window": 0},
                {"reward_fail_fast_calls": -1}, {"no_signal_steps": -1}):  # fmt: skip
        with pytest.raises(ConfigError, match="rollout."):
            InferenceEngineConfig(**bad)
