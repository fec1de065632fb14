"""End to end through the local launcher on the tiny model and the arithmetic task: the path a
user takes (`python -m arealite.launcher.local examples/... --config ...`), checked by its files.

Three runs (~2 min on 2 cores): asynchronous GRPO (1 embedded server + 2 FSDP ranks; weight
updates in place, in-flight requests kept), SFT over 2 ranks (ended by `total_train_secs`),
then synchronous GRPO (eta = 0) starting from the SFT export, as a user would chain them.
"""

from __future__ import annotations

import json
import math
import os
import re

import pytest
import torch
from _launch import local_launch, read_metrics

pytestmark = pytest.mark.integration

ETA = 2  # staleness bound of the async run
PROMPTS, SAMPLES = 4, 2  # prompts per step, samples per prompt
SFT_MAX_STEPS, SFT_SECS = 300, 3.0  # the SFT run stops by the clock, after some steps
SYNC_MAX_STEPS, SYNC_SECS = 20, 1.0  # so does the synchronous GRPO run


def read_rollouts(run_dir: str) -> dict[int, list[dict]]:
    """Rank 0's rollout dumps by the version under which each episode started."""
    out = {}
    for name in os.listdir(os.path.join(run_dir, "rollouts")):
        m = re.fullmatch(r"rollouts_v(\d+)\.jsonl", name)
        if m:
            with open(os.path.join(run_dir, "rollouts", name)) as f:
                out[int(m.group(1))] = [json.loads(line) for line in f if line.strip()]
    return out


def grpo_overrides(fileroot: str, trial: str, model: str, steps: int) -> list[str]:
    """Small, fast settings; fp32 on both sides so trainer and server logprobs agree exactly."""
    return [
        f"cluster.fileroot={fileroot}",
        "experiment_name=e2e-grpo",
        f"trial_name={trial}",
        f"actor.path={model}",
        f"total_train_steps={steps}",
        f"train_dataset.batch_size={PROMPTS}",
        "rollout.max_concurrent_rollouts=16",
        f"gconfig.n_samples={SAMPLES}",
        "gconfig.max_new_tokens=4",
        "valid_dataset.options.size=16",
        "valid_dataset.batch_size=16",
        "evaluator.freq_steps=2",
        "actor.fsdp.param_dtype=float32",
        "server.dtype=float32",
        "stats_logger.print_every=1",
        "rollout.dynamic_sampling=false",  # an untrained model scores 0: every group would drop
    ]


def load_checkpoint(path: str):
    """An exported checkpoint loads like any HF model and produces finite logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok("1+2=", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()
    return model


def server_versions(run_dir: str) -> list[int]:
    text = open(os.path.join(run_dir, "logs", "server0.log")).read()
    return [int(v) for v in re.findall(r"weights updated to version (\d+)", text)]


# --------------------------------------------------------------------------- runs (one each)


@pytest.fixture(scope="module")
def async_run(tmp_path_factory, tiny_model_dir):
    root = str(tmp_path_factory.mktemp("e2e_async"))
    args = grpo_overrides(root, "async", tiny_model_dir, steps=3)
    args += [
        "allocation_mode=local.d1p1t1+d2p1t1",
        f"rollout.max_head_offpolicyness={ETA}",
        "rollout.pause_mode=in_place",
        "saver.freq_steps=2",
    ]
    p = local_launch("grpo.py", "arith_grpo.yaml", *args)
    out = p.stdout + p.stderr
    return os.path.join(root, "e2e-grpo", "async"), out


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory, tiny_model_dir):
    root = str(tmp_path_factory.mktemp("e2e_sft"))
    args = [
        f"cluster.fileroot={root}",
        "experiment_name=e2e-sft",
        "trial_name=t",
        f"model.path={tiny_model_dir}",
        "allocation_mode=d2p1t1",
        f"total_train_steps={SFT_MAX_STEPS}",
        f"total_train_secs={SFT_SECS}",  # ends it first: both ranks stop at rank 0's step
        "train_dataset.batch_size=16",
        "model.optimizer.warmup_steps_proportion=0",
    ]
    local_launch("sft.py", "arith_sft.yaml", *args)
    return os.path.join(root, "e2e-sft", "t")


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory, sft_run):
    """Synchronous GRPO from the SFT export: the user's SFT -> RL pipeline."""
    root = str(tmp_path_factory.mktemp("e2e_sync"))
    (name,) = os.listdir(os.path.join(sft_run, "checkpoints", "final"))
    model = os.path.join(sft_run, "checkpoints", "final", name)
    args = grpo_overrides(root, "sync", model, steps=SYNC_MAX_STEPS)
    args += [
        "allocation_mode=local.d1p1t1+d1p1t1",
        "rollout.max_head_offpolicyness=0",
        f"total_train_secs={SYNC_SECS}",  # ends it after a step or two
        "evaluator.freq_steps=null",  # so only the last step evaluates
    ]
    local_launch("grpo.py", "arith_grpo.yaml", *args)
    return os.path.join(root, "e2e-grpo", "sync")


# --------------------------------------------------------------------------- async GRPO


def test_async_grpo_metrics_every_step(async_run):
    run_dir, _ = async_run
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records:
        assert r["loss"] is not None and math.isfinite(r["loss"]), r
        assert r["n_seqs"] == PROMPTS * SAMPLES  # the global batch, summed over the 2 ranks
        assert 0 <= r["staleness_max"] <= ETA, r  # the staleness bound holds
    # same weights, same tokens: the trainer reproduces the server's logprobs (fp32 both sides)
    assert records[0]["staleness_max"] == 0
    assert records[0]["behave_logp_absdiff_max"] < 1e-3, records[0]
    # rollouts started under version 0 were consumed after an update: generation overlapped
    assert max(r["staleness_max"] for r in records) >= 1
    assert "eval/accuracy_before_training" in records[0]
    assert all(0.0 <= records[s]["eval/accuracy"] <= 1.0 for s in (1, 2))
    # what each evaluation cost the wall clock, logged on the steps that evaluated
    assert all(records[s]["timeperf/eval"] > 0 for s in (1, 2))


def test_async_grpo_logs_the_regime(async_run):
    """Output lengths, old-policy tokens, resumed sequences and the server's batch occupancy."""
    records = read_metrics(async_run[0])
    for r in records:
        assert 1 <= r["gen_len_p50"] <= r["gen_len_p90"] <= r["gen_len_max"] <= 4, r
        assert 0.0 <= r["off_policy_token_frac"] <= 1.0 and 0.0 <= r["resumed_seq_frac"] <= 1.0
        assert r["rollout/server_batch_rows"] >= 1 and 0 < r["rollout/server_busy_frac"] <= 1, r
        assert r["rollout/interrupted_requests"] == 0  # in place: updates abort nothing
    assert records[0]["off_policy_token_frac"] == 0.0  # step 0 trains on version 0's tokens
    # Staleness >= 1 somewhere means some trained tokens came from an older policy.
    stale = [r for r in records if r["staleness_max"] >= 1]
    assert all(r["off_policy_token_frac"] > 0 for r in stale)


def test_async_grpo_server_served_new_weights(async_run):
    run_dir, _ = async_run
    assert server_versions(run_dir) == [1, 2, 3]
    dumps = read_rollouts(run_dir)
    assert 0 in dumps
    for version, rows in dumps.items():  # no token predates the weights its episode started on
        assert all(min(row["output_versions"]) >= version for row in rows), version
    # tokens generated by updated weights came back from the server
    assert max(v for rows in dumps.values() for row in rows for v in row["output_versions"]) >= 1


def test_async_grpo_artifacts(async_run):
    run_dir, out = async_run
    ckpts = os.path.join(run_dir, "checkpoints")
    assert os.path.isdir(os.path.join(ckpts, "epoch0globalstep1"))  # saver.freq_steps=2
    load_checkpoint(os.path.join(ckpts, "final", "epoch0globalstep3"))
    assert os.path.getsize(os.path.join(run_dir, "curves.png")) > 0
    events = os.listdir(os.path.join(run_dir, "tensorboard"))
    assert any(name.startswith("events.out.tfevents") for name in events), events
    for log in ("trainer.log", "server0.log"):
        assert os.path.getsize(os.path.join(run_dir, "logs", log)) > 0
    assert "held-out accuracy:" in out


# --------------------------------------------------------------------------- SFT, sync GRPO


def test_sft_two_ranks_stops_by_the_clock_and_exports_a_trained_model(sft_run, tiny_model_dir):
    records = read_metrics(sft_run)
    n = len(records)
    assert [r["step"] for r in records] == list(range(n))
    assert 2 <= n < SFT_MAX_STEPS, n  # total_train_secs ended it, on a step boundary
    assert records[-1]["wall_time"] >= SFT_SECS
    assert all(r["n_seqs"] == 16 for r in records)
    assert all(math.isfinite(r["loss"]) for r in records)
    assert records[-1]["loss"] < records[0]["loss"]
    # The final export is named by the steps trained, not the steps planned.
    assert os.listdir(os.path.join(sft_run, "checkpoints", "final")) == [f"epoch0globalstep{n}"]
    trained = load_checkpoint(os.path.join(sft_run, "checkpoints", "final", f"epoch0globalstep{n}"))
    initial = load_checkpoint(tiny_model_dir)
    changed = [
        name
        for (name, a), b in zip(trained.state_dict().items(), initial.state_dict().values())
        if not torch.equal(a, b)
    ]
    assert changed, "SFT export equals the initial weights"


def test_sync_grpo_is_on_policy(sync_run):
    records = read_metrics(sync_run)
    n = len(records)
    assert [r["step"] for r in records] == list(range(n)) and 1 <= n < SYNC_MAX_STEPS
    # The step that ran out of time evaluated as the last one (and no other step did).
    assert ["eval/accuracy" in r for r in records] == [False] * (n - 1) + [True], records
    for r in records:
        assert r["n_seqs"] == PROMPTS * SAMPLES and math.isfinite(r["loss"])
        assert r["staleness_max"] == 0, r  # eta = 0: every token from the current weights
        assert r["behave_logp_absdiff_max"] < 1e-3, r
    assert server_versions(sync_run) == list(range(1, n + 1))
    dumps = read_rollouts(sync_run)
    assert sorted(dumps) == list(range(n))
    for version, rows in dumps.items():
        assert len(rows) == PROMPTS * SAMPLES
        assert all(set(row["output_versions"]) == {version} for row in rows)
    load_checkpoint(os.path.join(sync_run, "checkpoints", "final", f"epoch0globalstep{n}"))
