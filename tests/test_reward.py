"""Reward functions on right, wrong and garbage completions, in threads and worker processes."""

from __future__ import annotations

import logging
import multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

import pytest

from arealite.api.reward_api import RewardSpecError
from arealite.reward.resolve import resolve_reward
from arealite.tasks.arith import arith_reward_fn
from arealite.tasks.clevr_count import clevr_count_reward_fn
from arealite.tasks.gsm8k import math_reward_fn


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
    assert _call(math_reward_fn, completion, answer, query_id="q0") == expected


def test_math_reward_is_symbolic():
    assert _call(math_reward_fn, "so x = \\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert _call(math_reward_fn, "so x = \\boxed{\\frac{1}{3}}", "0.5") == 0.0
    with pytest.raises(ValueError, match="answer"):
        math_reward_fn("p", "\\boxed{1}", [], [])


def test_math_reward_works_off_the_main_thread():
    """math-verify's signal.alarm timeout only works in the main thread; ours must not raise."""
    with ThreadPoolExecutor(2) as pool:
        futs = [pool.submit(_call, math_reward_fn, c, a) for c, a, _ in GSM8K_CASES]
        assert [f.result() for f in futs] == [e for _, _, e in GSM8K_CASES]


def test_rewards_run_in_a_spawned_process_pool():
    """The RLVR workflow's reward pool: functions and rows must pickle, timeouts stay on."""
    cases = GSM8K_CASES[:5]
    with ProcessPoolExecutor(2, mp_context=mp.get_context("spawn")) as pool:
        futs = [
            pool.submit(math_reward_fn, "p", c, [1], [2], answer=a, messages=[], query_id="q")
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


def test_builtin_rewards_by_short_name_are_the_tasks_rewards():
    """One table (arealite/tasks/registry.py): a short name is a built-in task's reward."""
    from arealite.tasks.registry import TASKS, default_reward

    assert resolve_reward("gsm8k") is math_reward_fn
    assert resolve_reward("clevr_count") is clevr_count_reward_fn
    for name, task in TASKS.items():
        assert resolve_reward(default_reward(name)) is task.reward
    with pytest.raises(
        RewardSpecError, match=r"'arith', 'clevr_count', 'gsm8k', 'long_sums', 'math_verify'"
    ):
        resolve_reward("nope")


# ----------------------------------------------------------------------------- reward from config

USER_REWARDS = """
import asyncio


def exact(prompt, completions, prompt_ids, completion_ids, answer=None, bonus=0, **row):
    return float(completions.strip() == str(answer)) + bonus


async def slow_ok(prompt, completions, prompt_ids, completion_ids, **row):
    await asyncio.sleep(0)
    return 0.5


def flaky(prompt, completions, prompt_ids, completion_ids, query_id="", **row):
    if query_id.endswith("-0"):
        raise RuntimeError("flaky reward fails on row 0")
    return 1.0


def no_row(prompt, completions):
    return 1.0
"""


@pytest.fixture
def rewards_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(USER_REWARDS)
    return str(path)


def test_reward_specs_resolve_builtins_files_and_import_paths(rewards_file):
    assert resolve_reward("arith") is arith_reward_fn
    assert resolve_reward("math_verify") is math_reward_fn
    assert resolve_reward("arealite.tasks.clevr_count:clevr_count_reward_fn") is (
        clevr_count_reward_fn
    )
    fn = resolve_reward(f"{rewards_file}:exact")
    assert fn("p", " 4 ", [], [], answer="4", bonus=1, query_id="x") == 2.0


@pytest.mark.parametrize(
    "spec, message",
    [
        ("nope", r"reward 'nope': expected a built-in name"),
        ("no_such_pkg.rewards:score", r"reward 'no_such_pkg.rewards:score': importing .* failed"),
        ("missing.py:score", r"reward 'missing.py:score': no such file 'missing.py'"),
        ("{file}:absent", r"has no function 'absent'"),
        ("{file}:no_row", r"no_row\(prompt, completions\) lacks the arguments prompt_ids"),
    ],
)
def test_reward_spec_errors_name_the_spec(rewards_file, spec, message):
    with pytest.raises(RewardSpecError, match=message):
        resolve_reward(spec.format(file=rewards_file))


def test_reward_weights_must_match():
    from arealite.api.cli_args import ConfigError, GRPOConfig, load_expr_config

    with pytest.raises(ConfigError, match="reward_weights has 1 entries for 2 rewards"):
        load_expr_config(
            [
                "experiment_name=x",
                "trial_name=y",
                "actor.path=m",
                "reward=[arith,math_verify]",
                "reward_weights=[1.0]",
            ],
            GRPOConfig,
        )


def test_contract_reward_in_worker_processes_async_and_errors_counted(rewards_file, caplog):
    """A file reward resolves in each worker (pickled by spec); async works; an exception in one
    sample gives 0, is counted, and its traceback reaches the log."""
    import asyncio

    from arealite.reward import make_reward_pool

    pool = make_reward_pool(
        [f"{rewards_file}:exact", f"{rewards_file}:slow_ok", f"{rewards_file}:flaky"],
        [1.0, 2.0, 10.0],
        workers=1,
        timeout=20,
    )

    async def score_all():
        return await asyncio.gather(
            *(pool("p", "4", [1], [2], answer="4", bonus=0, query_id=f"q-{i}") for i in range(8))
        )

    try:
        with caplog.at_level(logging.WARNING, logger="arealite.reward"):
            values = asyncio.run(score_all())
        # exact 1 + 2 * 0.5 + 10 * flaky (0 on row q-0, which raised)
        assert sorted(values) == [2.0] + [12.0] * 7
        assert pool.stats["errors"] == 1 and pool.stats["calls"] == 24
        assert "flaky reward fails on row 0" in caplog.text
        comps = pool.component_stats()
        assert comps[f"reward/{rewards_file}:exact"] == 1.0
        assert comps[f"reward/{rewards_file}:slow_ok"] == 0.5
        assert comps[f"reward/{rewards_file}:flaky"] == pytest.approx(7 / 8)
    finally:
        pool.close()
