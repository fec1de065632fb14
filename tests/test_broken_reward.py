"""A broken reward, through the real launcher: preflight calls each reward once on row
0 and refuses a TypeError, an import error or a non-float before anything starts; a reward that
passes preflight but fails on real samples stops the run in its first step; a run whose groups
all score alike says so once; the user's own column names reach the reward."""

from __future__ import annotations

import json
import os
import re

import pytest
from test_byot import launch, write_task

BROKEN = """
def wrong_name(prompt, completion, prompt_ids, completion_ids, **kw):  # not `completions`
    return 1.0


def lazy_import(prompt, completions, prompt_ids, completion_ids, **kw):
    import no_such_reward_lib
    return 1.0


def forgets_return(prompt, completions, prompt_ids, completion_ids, answer=None, **kw):
    if completions.strip() == answer:
        return 1.0


def weighted(prompt, completions, prompt_ids, completion_ids, answer=None, weight=None, **kw):
    return float(weight) * float(completions.strip() == answer)  # `weight` is on row 0 only


def needs_solution(prompt, completions, prompt_ids, completion_ids, solution=None, **kw):
    if solution is None:  # `columns: {answer: solution}`: the user's own name arrives too
        raise KeyError("solution")
    return 0.0  # the random model is never right: no group has a learning signal
"""
COLUMNS = "['answer', 'id', 'messages', 'points', 'query_id', 'question', 'solution', 'weight']"


def broken_task(tmp_path, model: str) -> tuple[str, str, str]:
    """(yaml, run dir, rewards file) of test_byot's task; row 0 alone has a `weight`."""
    yaml, run_dir = write_task(tmp_path, model)
    rows = [json.loads(line) for line in open(tmp_path / "my_data.jsonl")]
    rows[0]["weight"] = 1.0
    (tmp_path / "my_data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "broken.py").write_text(BROKEN)
    return yaml, run_dir, str(tmp_path / "broken.py")


@pytest.mark.parametrize(
    "fn, message",
    [
        ("wrong_name", r"raised TypeError: wrong_name\(\) missing 1 .* argument: 'completion'"),
        ("lazy_import", "raised ModuleNotFoundError: No module named 'no_such_reward_lib'"),
        ("forgets_return", r"returned None \(NoneType\), not a float"),
    ],
)
def test_preflight_calls_the_reward_on_a_real_row(tmp_path, tiny_model_dir, fn, message):
    yaml, run_dir, rewards = broken_task(tmp_path, tiny_model_dir)
    rc, out, secs = launch(
        "grpo.py", yaml, f"reward={rewards}:{fn}", "reward_weights=null", timeout=60
    )
    head = f"reward: reward '{rewards}:{fn}', called by preflight on row 0 of train_dataset"
    assert rc != 0 and head in out and re.search(message, out), out[-3000:]
    assert COLUMNS in out and "columns arrive as keywords" in out
    assert not os.path.exists(os.path.join(run_dir, "logs", "server0.log"))  # nothing started
    print(f"preflight refused {fn} in {secs:.1f}s")


def test_a_row_specific_error_or_a_timeout_in_preflight_is_printed_not_fatal(tmp_path, capsys):
    """Only errors that fail every sample refuse the launch; the rest the run counts."""
    from arealite.launcher.reward_probe import probe_rewards

    (tmp_path / "r.py").write_text(
        "import time\n"
        "def odd(prompt, completions, prompt_ids, completion_ids, **kw):\n"
        "    raise ValueError('no answer on this row')\n"
        "def hangs(prompt, completions, prompt_ids, completion_ids, **kw):\n"
        "    time.sleep(60)\n"
        "async def ok(prompt, completions, prompt_ids, completion_ids, answer=None, **kw):\n"
        "    return float(completions == answer)\n"
    )
    row = {"messages": [{"role": "user", "content": "6*7="}], "answer": "42", "query_id": "q"}
    specs = [f"{tmp_path / 'r.py'}:{fn}" for fn in ("odd", "hangs", "ok")]
    probe_rewards("reward", specs, row, "row 0", timeout=1.0)
    out = capsys.readouterr().out
    assert "raised ValueError: no answer on this row" in out
    assert "r.py:hangs', called by preflight on row 0 (columns ['answer', 'messages'" in out
    assert "did not return within 1s" in out and out.count("not fatal") == 2


@pytest.mark.integration
def test_a_reward_failing_on_real_samples_stops_the_run_in_its_first_step(tmp_path, tiny_model_dir):
    """Issue 42's shape (4 prompts x 4 samples) and the default rule: the first step in which
    every call failed stops the run before it trains (row 0, the one row it scores, may land in
    an earlier step: at most 1 step trained)."""
    yaml, run_dir, rewards = broken_task(tmp_path, tiny_model_dir)
    rc, out, secs = launch(
        "grpo.py", yaml, f"reward={rewards}:weighted", "reward_weights=null", "gconfig.n_samples=4"
    )
    assert rc != 0, out[-6000:]
    m = re.search(
        rf"reward {re.escape(rewards)}:weighted is broken: all (\d+) of its calls in "
        r"a step failed \((\d+) failed of (\d+) calls: TypeError x(\d+)\)",
        out,
    )
    assert m, out[-6000:]
    step_calls, failed, calls, type_errors = map(int, m.groups())
    assert step_calls >= 16 and failed == type_errors and failed <= calls <= failed + 4
    assert "float() argument must be a string or a real number, not 'NoneType'" in out
    assert out.count("it scores 0. Repeats of this kind") == 1  # logged once, not per call
    metrics = os.path.join(run_dir, "metrics.jsonl")
    lines = open(metrics).read().splitlines() if os.path.exists(metrics) else []
    trained = [line for line in lines if line.strip()]
    assert len(trained) <= 1, trained
    print(f"stopped in {secs:.1f}s after {len(trained)} trained steps, {calls} calls")


@pytest.mark.integration
def test_own_column_names_reach_the_reward_and_no_signal_is_said_once(tmp_path, tiny_model_dir):
    yaml, run_dir, rewards = broken_task(tmp_path, tiny_model_dir)
    rc, out, secs = launch(
        "grpo.py",
        yaml,
        f"reward={rewards}:needs_solution",
        "reward_weights=null",
        "rollout.no_signal_steps=2",
    )
    assert rc == 0, out[-6000:]
    records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert len(records) == 3 and records[-1]["rollout/errors"] == 0  # `solution` arrived
    assert out.count("no learning signal") == 1, out[-6000:]
    assert "no learning signal: in each of steps 0..1 (2 steps, 4 groups of 2" in out
    assert "rewards seen: 0 x16" in out and "gets None for a column" in out
    print(f"3 steps in {secs:.1f}s")
