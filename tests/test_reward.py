"""Reward functions on right, wrong and garbage completions, in threads and worker processes."""

from __future__ import annotations

import multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

import pytest

from arealite.reward import (
    arith_reward_fn,
    clevr_count_reward_fn,
    get_reward_fn,
    gsm8k_reward_fn,
    math_reward_fn,
)


def _call(fn, completion: str, answer, **row) -> float:
    return fn("prompt", completion, [1, 2], [3, 4], answer=answer, **row)


GSM8K_CASES = [
    ("Natalia sold 48 + 24 = 72 clips. The final answer is \\boxed{72}.", "72", 1.0),
    ("So the total is 72", "72", 1.0),  # no box: the last number counts
    ("\\boxed{72.0}", "72", 1.0),
    ("The answer is \\boxed{1000}", "1,000", 1.0),  # thousands separator in the reference
    ("The final answer is \\boxed{71}.", "72", 0.0),
    ("I think 72 is wrong, it is \\boxed{70}", "72", 0.0),  # the boxed answer wins
    ("", "72", 0.0),
    ("garbage $$$ \\frac{ }}{{ \\boxed{", "72", 0.0),
    ("\x00\x01 ☃ ∑∑∑ lorem ipsum", "72", 0.0),
]


@pytest.mark.parametrize("completion,answer,expected", GSM8K_CASES)
def test_gsm8k_reward(completion, answer, expected):
    assert _call(gsm8k_reward_fn, completion, answer, query_id="q0") == expected


def test_math_reward_is_symbolic():
    assert _call(math_reward_fn, "so x = \\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert _call(math_reward_fn, "so x = \\boxed{\\frac{1}{3}}", "0.5") == 0.0
    with pytest.raises(ValueError, match="answer"):
        math_reward_fn("p", "\\boxed{1}", [], [])


def test_math_reward_works_off_the_main_thread():
    """math-verify's signal.alarm timeout only works in the main thread; ours must not raise."""
    with ThreadPoolExecutor(2) as pool:
        futs = [pool.submit(_call, gsm8k_reward_fn, c, a) for c, a, _ in GSM8K_CASES]
        assert [f.result() for f in futs] == [e for _, _, e in GSM8K_CASES]


def test_rewards_run_in_a_spawned_process_pool():
    """The RLVR workflow's reward pool: functions and rows must pickle, timeouts stay on."""
    cases = GSM8K_CASES[:5]
    with ProcessPoolExecutor(2, mp_context=mp.get_context("spawn")) as pool:
        futs = [
            pool.submit(gsm8k_reward_fn, "p", c, [1], [2], answer=a, messages=[], query_id="q")
            for c, a, _ in cases
        ]
        futs.append(pool.submit(arith_reward_fn, "p", "12+34=46", [1], [2], answer="46"))
        futs.append(pool.submit(clevr_count_reward_fn, "p", "[3]", [1], [2], answer="3"))
        assert [f.result(timeout=120) for f in futs] == [e for _, _, e in cases] + [1.0, 1.0]


@pytest.mark.parametrize(
    "completion,answer,expected",
    [
        ("46", "46", 1.0),
        ("12+34=46", "46", 1.0),
        ("\\boxed{46}", "46", 1.0),
        ("-12", "-12", 1.0),
        ("5-17=-12", "-12", 1.0),
        ("45", "46", 0.0),
        ("12", "-12", 0.0),
        ("464", "46", 0.0),
        ("", "46", 0.0),
        ("forty six", "46", 0.0),
    ],
)
def test_arith_reward(completion, answer, expected):
    assert _call(arith_reward_fn, completion, answer) == expected


def test_arith_reward_rejects_a_bad_reference():
    with pytest.raises(ValueError, match="not an integer"):
        _call(arith_reward_fn, "46", "4.6")
    with pytest.raises(ValueError, match="answer"):
        arith_reward_fn("p", "46", [], [])


@pytest.mark.parametrize(
    "completion,answer,expected",
    [
        ("There are [4] objects.", "4", 1.0),
        ("I see 3 cubes and 1 sphere, so [4]", "4", 1.0),  # bracket beats the last number
        ("[4] no wait, 5 objects", "4", 1.0),
        ("4", 4, 1.0),
        ("I see 3 cubes, total 5", "4", 0.0),
        ("[3]", "4", 0.0),
        ("no idea", "4", 0.0),
    ],
)
def test_clevr_count_reward(completion, answer, expected):
    assert _call(clevr_count_reward_fn, completion, answer) == expected


def test_get_reward_fn():
    assert get_reward_fn("gsm8k") is gsm8k_reward_fn
    with pytest.raises(ValueError, match="arith"):
        get_reward_fn("nope")
