"""Bring your own task: a user's jsonl + a reward file + a YAML of their own, through the launcher.

Preflight tests start nothing and must fail in under 3 s naming the key; the end-to-end runs
(integration) train the tiny model a few steps with GRPO (two weighted rewards, one of which
raises on one row in eight) and with SFT on chat `messages`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
from _launch import local_launch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

REWARDS = """
def exact(prompt, completions, prompt_ids, completion_ids, answer=None, points=1.0, **row):
    return points * float(completions.strip() == str(answer))


def short(prompt, completions, prompt_ids, completion_ids, query_id="", **row):
    if query_id.endswith("0"):  # one row in eight (ids end in 0 for rows 0, 10, 20...)
        raise ValueError("my reward has a bug on " + query_id)
    return 1.0 / (1 + len(completion_ids))
"""

GRPO_YAML = """
experiment_name: byot
trial_name: grpo
allocation_mode: local.d1p1t1+d1p1t1
total_train_steps: 3
actor: {{path: {model}, dtype: float32, fsdp: {{param_dtype: float32}}}}
server: {{dtype: float32}}
gconfig: {{n_samples: 2, max_new_tokens: 4}}
rollout: {{max_head_offpolicyness: 1, reward_workers: 1}}
train_dataset:
  path: {data}
  batch_size: 4
  columns: {{prompt: question, answer: solution, query_id: id}}
  prompt_template: "{{prompt}}="
reward: [{rewards}:exact, {rewards}:short]
reward_weights: [1.0, 0.5]
cluster: {{fileroot: {root}}}
"""


def write_task(tmp_path, model: str, n_rows: int = 32) -> tuple[str, str]:
    """(yaml path, run dir) of a user's own task in `tmp_path`."""
    with open(tmp_path / "my_data.jsonl", "w") as f:
        for i in range(n_rows):
            a, b = i % 7, (3 * i) % 5
            row = {"id": f"row-{i}", "question": f"{a}+{b}", "solution": str(a + b), "points": 2}
            f.write(json.dumps(row) + "\n")
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    yaml = GRPO_YAML.format(
        model=model,
        data=tmp_path / "my_data.jsonl",
        rewards=tmp_path / "my_rewards.py",
        root=tmp_path / "runs",
    )
    (tmp_path / "my.yaml").write_text(yaml)
    return str(tmp_path / "my.yaml"), str(tmp_path / "runs" / "byot" / "grpo")


def launch(script: str, yaml: str, *overrides: str, timeout: float = 400, env=None):
    """(exit code, output, seconds) of the local launcher, which may fail."""
    start = time.monotonic()
    p = local_launch(script, yaml, *overrides, ok=False, timeout=timeout, env=env)
    return p.returncode, p.stdout + p.stderr, time.monotonic() - start


# ----------------------------------------------------------------------------- preflight


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "train_dataset.columns.prompt=problem",
            "train_dataset.path=.*columns.prompt='problem' but",
        ),
        (
            "reward=[no_such_pkg.rewards:score] reward_weights=null",
            "reward: reward 'no_such_pkg.rewards:score': import",
        ),
        (
            "reward=[{rewards}:nothing] reward_weights=null",
            "reward: reward .*my_rewards.py:nothing.* no function",
        ),
        (
            "eval_reward={rewards}:nothing",
            "eval_reward: reward .*my_rewards.py:nothing.* no function",
        ),
        ("train_dataset.path={tmp}/absent.jsonl", "train_dataset.path=.*absent.jsonl.*no such"),
        (
            "actor.path={tmp}/not_a_model",
            r"actor.path='.*not_a_model': the folder has no config.json.*point it at the folder",
        ),
        (
            "rollout.consumer_batch_size=8",
            r"rollout.consumer_batch_size.*set train_dataset.batch_size instead",
        ),
        (
            "reward=null reward_weights=null",
            "reward is not set and train_dataset.path=.* is not a built-in task",
        ),
    ],
)
def test_preflight_fails_fast_naming_the_key(tmp_path, tiny_model_dir, override, message):
    import re

    yaml, run_dir = write_task(tmp_path, tiny_model_dir)
    (tmp_path / "not_a_model").mkdir()  # a folder without config.json
    override = override.format(rewards=tmp_path / "my_rewards.py", tmp=tmp_path)
    rc, out, _ = launch("grpo.py", yaml, *override.split(), timeout=60)
    assert rc != 0 and re.search(message, out), out[-3000:]
    assert not os.path.exists(os.path.join(run_dir, "logs", "server0.log"))  # nothing started


def test_preflight_checks_reward_signature(tmp_path, tiny_model_dir):
    yaml, _ = write_task(tmp_path, tiny_model_dir)
    (tmp_path / "bad.py").write_text("def score(prompt, completions):\n    return 1.0\n")
    bad = [f"reward={tmp_path / 'bad.py'}:score", "reward_weights=null"]
    rc, out, _ = launch("grpo.py", yaml, *bad, timeout=60)
    assert rc != 0 and "lacks the arguments prompt_ids, completion_ids" in out, out[-3000:]


# ----------------------------------------------------------------------------- end to end


@pytest.mark.integration
def test_user_jsonl_and_reward_file_train_with_grpo(tmp_path, tiny_model_dir):
    yaml, run_dir = write_task(tmp_path, tiny_model_dir)
    rc, out, _ = launch("grpo.py", yaml)
    assert rc == 0, out[-6000:]
    records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert len(records) == 3
    exact_key = f"reward/{tmp_path / 'my_rewards.py'}:exact"
    short_key = f"reward/{tmp_path / 'my_rewards.py'}:short"
    for r in records:  # each component is logged every step
        assert 0.0 <= r[exact_key] <= 2.0 and 0.0 <= r[short_key] <= 0.5
    last = records[-1]
    assert last["rollout/errors"] > 0  # the buggy rows scored 0 and were counted
    assert last["rollout/ok"] > last["rollout/errors"]  # and the run went on
    assert "my reward has a bug on row-" in out  # its traceback is in the log
    dumps = os.path.join(run_dir, "rollouts")
    prompts = [
        json.loads(line)["prompt"]
        for f in os.listdir(dumps)
        if f.startswith("rollouts_v")
        for line in open(os.path.join(dumps, f))
    ]
    assert prompts and all("=" in p for p in prompts)  # prompt_template applied


@pytest.mark.integration
def test_parquet_data_and_a_hub_model_id_from_the_offline_cache(tmp_path, tiny_model_dir):
    """The same task from a parquet file, with actor.path a hub id: resolved once by the
    launcher, the embedded server and the trainer both load the cached snapshot."""
    import datasets

    yaml, run_dir = write_task(tmp_path, "org/tiny")
    parquet = str(tmp_path / "my_data.parquet")
    datasets.Dataset.from_json(str(tmp_path / "my_data.jsonl")).to_parquet(parquet)
    snap = fake_hub_cache(tmp_path / "hub", "org/tiny", files_from=tiny_model_dir)
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    rc, out, _ = launch(
        "grpo.py", yaml, f"train_dataset.path={parquet}", "total_train_steps=2", env=env
    )
    assert rc == 0, out[-6000:]
    records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert len(records) == 2 and f"reward/{tmp_path / 'my_rewards.py'}:exact" in records[-1]
    written = open(os.path.join(run_dir, "config.yaml")).read()
    assert f"model_path: {snap}" in written and "org/tiny" not in written


@pytest.mark.integration
def test_user_messages_jsonl_trains_with_sft(tmp_path, tiny_model_dir):
    with open(tmp_path / "chat.jsonl", "w") as f:
        for i in range(16):
            chat = [
                {"role": "user", "content": f"{i}+1"},
                {"role": "assistant", "content": str(i + 1)},
            ]
            f.write(json.dumps({"messages": chat}) + "\n")
    (tmp_path / "sft.yaml").write_text(
        f"experiment_name: byot\ntrial_name: sft\nallocation_mode: d1p1t1\ntotal_train_steps: 2\n"
        f"model: {{path: {tiny_model_dir}}}\ncluster: {{fileroot: {tmp_path / 'runs'}}}\n"
        f"train_dataset: {{path: {tmp_path / 'chat.jsonl'}, batch_size: 8}}\n"
    )
    rc, out, _ = launch("sft.py", str(tmp_path / "sft.yaml"))
    assert rc == 0, out[-6000:]
    metrics = os.path.join(tmp_path, "runs", "byot", "sft", "metrics.jsonl")
    assert len(open(metrics).read().splitlines()) == 2


def fake_hub_cache(root, repo_id: str, files_from: str | None = None) -> str:
    """A Hugging Face hub cache under `root` holding `repo_id` (models--org--name/snapshots/<rev>
    + refs/main), as `hf download` leaves it; returns the snapshot directory."""
    repo = os.path.join(str(root), "models--" + repo_id.replace("/", "--"))
    rev = "0123456789abcdef0123456789abcdef01234567"
    snap = os.path.join(repo, "snapshots", rev)
    os.makedirs(os.path.join(repo, "refs"))
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(rev)
    if files_from:
        shutil.copytree(files_from, snap)
    else:
        os.makedirs(snap)
    return snap


RESOLVE = """
import json, sys
from arealite.launcher.preflight import load_and_check
from arealite.api.cli_args import ConfigError
try:
    _, args, config = load_and_check(sys.argv[1:])
    print(json.dumps({"args": args, "server": config.server.model_path, "actor": config.actor.path}))
except ConfigError as e:
    print("ConfigError:", e)
"""


def test_hub_model_id_is_resolved_once_from_the_offline_cache(tmp_path, tiny_model_dir):
    """actor.path=org/tiny resolves to the cached snapshot before anything starts; trainer
    ranks get it as an override and the (embedded) server from the config."""
    yaml, _ = write_task(tmp_path, "org/tiny")
    snap = fake_hub_cache(tmp_path / "hub", "org/tiny", files_from=tiny_model_dir)
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    argv = ["examples/grpo.py", "--config", yaml]
    p = subprocess.run(
        [sys.executable, "-c", RESOLVE, *argv],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["actor"] == out["server"] == snap
    assert f"actor.path={snap}" in out["args"] and f"server.model_path={snap}" in out["args"]
    p = subprocess.run(
        [sys.executable, "-c", RESOLVE, *argv, "actor.path=org/absent"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "ConfigError: actor.path='org/absent': hub model 'org/absent'" in p.stdout, p.stdout
    assert "HF_HUB_OFFLINE=1: not in the hub cache" in p.stdout
