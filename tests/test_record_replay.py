"""Record, replay, train-only (docs/guide.md): `rollout.record` writes the trained batches,
`mode: rollout_only` records without a trainer, `mode: train_only` trains on a recording with
no inference server and reproduces the online run's first update.

Launcher runs (~80 s on 2 cores): one online GRPO step recording its batch, the same step
replayed by train_only, two rollout_only steps, and a rollout_only run ended by the clock.
"""

from __future__ import annotations

import functools
import json
import os
import runpy

import pytest
import torch
from _launch import local_launch

from arealite.api.cli_args import ConfigError, GRPOConfig, load_expr_config
from arealite.launcher.servers import needs_servers
from arealite.rollout.record import EpisodeRecorder, RecordedBatches, check_recording
from arealite.utils.data import concat_padded_tensors, pad_sequences_to_tensors

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
YAML = os.path.join(REPO, "examples", "configs", "arith_grpo.yaml")
PROMPTS, SAMPLES = 4, 4
PARITY_REWARD = (
    "def parity(prompt, completions, prompt_ids, completion_ids, **row):\n"
    "    return float(sum(completion_ids) % 2)\n"
)  # varies within groups: non-zero advantages


def overrides(root: str, trial: str, model: str, *extra: str) -> list[str]:
    """Small, fast, fp32 on both sides, synchronous; one step."""
    return [
        f"cluster.fileroot={root}",
        "experiment_name=rr",
        f"trial_name={trial}",
        f"actor.path={model}",
        "total_train_steps=1",
        f"train_dataset.batch_size={PROMPTS}",
        f"gconfig.n_samples={SAMPLES}",
        "gconfig.max_new_tokens=4",
        "valid_dataset=null",
        "rollout.max_head_offpolicyness=0",
        "rollout.dynamic_sampling=false",
        "actor.fsdp.param_dtype=float32",
        "server.dtype=float32",
        *extra,
    ]


def launch(args: list[str], timeout: float = 150) -> str:
    p = local_launch("grpo.py", "arith_grpo.yaml", *args, timeout=timeout)
    return p.stdout + p.stderr


def metrics(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


# --------------------------------------------------------------------------- config errors


def test_bad_mode_names_the_key(tiny_model_dir):
    with pytest.raises(ConfigError, match="mode='replay'.*train, rollout_only, train_only"):
        load_expr_config(
            ["--config", YAML, f"actor.path={tiny_model_dir}", "mode=replay"], GRPOConfig
        )


@pytest.mark.parametrize("mode", ["rollout_only", "train_only"])
def test_modes_need_a_record_dir(tiny_model_dir, mode):
    with pytest.raises(ConfigError, match=f"mode={mode} needs rollout.record"):
        load_expr_config(
            ["--config", YAML, f"actor.path={tiny_model_dir}", f"mode={mode}"], GRPOConfig
        )


def test_train_only_starts_no_server(tiny_model_dir, tmp_path):
    base = ["--config", YAML, f"actor.path={tiny_model_dir}", f"rollout.record={tmp_path}"]
    assert needs_servers(load_expr_config(base, GRPOConfig))
    assert needs_servers(load_expr_config([*base, "mode=rollout_only"], GRPOConfig))
    assert not needs_servers(load_expr_config([*base, "mode=train_only"], GRPOConfig))


def test_train_only_without_a_recording_names_the_path(tiny_model_dir, tmp_path):
    missing = str(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match=f"rollout.record='{missing}': no such directory"):
        check_recording(missing)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match=f"rollout.record='{empty}': no episodes.*rank0"):
        check_recording(str(empty))
    # The training script checks it first, before building any engine.
    main = runpy.run_path(os.path.join(REPO, "examples", "grpo.py"))["main"]
    argv = [
        "--config",
        YAML,
        *overrides(str(tmp_path), "t", tiny_model_dir),
        "mode=train_only",
        f"rollout.record={empty}",
    ]
    with pytest.raises(ConfigError, match=str(empty)):
        main(argv)


# --------------------------------------------------------------------------- the recording


def test_recording_rebuilds_the_batch_exactly(tmp_path):
    """Episodes of different lengths, concatenated as the executor does: the replayed batch
    equals the recorded one key by key (dtypes and padding included)."""

    def episode(lengths, reward):
        rows = [
            {
                "input_ids": torch.arange(n) + 3,
                "attention_mask": torch.ones(n, dtype=torch.bool),
                "loss_mask": torch.tensor([0] * 2 + [1] * (n - 2), dtype=torch.int32),
                "logprobs": torch.randn(n),
                "versions": torch.full((n,), 1, dtype=torch.int32),
                "rewards": torch.tensor(reward),
                "seq_no_eos_mask": torch.tensor(n > 4),
            }
            for n in lengths
        ]
        return pad_sequences_to_tensors(rows)

    batch = concat_padded_tensors([episode([3, 5], 1.0), episode([6, 4], 0.0)])
    rec = EpisodeRecorder(str(tmp_path), 0, lambda ids: " ".join(map(str, ids)))
    rec.write(0, batch, [{"query_id": "a"}, {"query_id": "b"}])
    rec.write(1, batch[:2], [{"query_id": "a"}])
    rec.write(1, batch[2:], [{"query_id": "b"}])  # step 1 again (a resumed run): last wins
    rec.write(2, batch, [{"query_id": "a"}, {"query_id": "b"}])
    rec.close()
    path = tmp_path / "episodes_rank0.jsonl"
    path.write_text(path.read_text()[:-50])  # a crash while writing step 2: left out
    first = json.loads(open(tmp_path / "episodes_rank0.jsonl").readline())
    assert first["query_id"] == "a" and first["text"] == "3 4 5" and first["rewards"] == 1.0
    replay = RecordedBatches(str(tmp_path), 0)
    assert replay.n_steps == 2 and replay.query_ids(0) == ["a", "a", "b", "b"]
    for step, expected in ((0, batch), (1, batch[2:])):
        got = replay.batch(step)
        assert set(got.keys()) == set(expected.keys())
        for k in expected.keys():
            assert got[k].dtype == expected[k].dtype, k
            assert torch.equal(
                got[k], expected[k][:, : got[k].shape[1]] if got[k].ndim > 1 else expected[k]
            ), k


def _steps_to_train(record_dir: str, rank: int) -> int:
    from arealite.recipes.rollouts import RecordedRollouts

    return RecordedRollouts(RecordedBatches(record_dir, rank, 2)).n_steps


def test_every_rank_trains_the_steps_all_ranks_recorded(tmp_path):
    """Rank 0 recorded 3 steps, rank 1 2 (its run ended by the clock a step sooner): both
    train 2, so no rank enters a step's collectives alone."""
    from test_stats import on_two_ranks

    batch = pad_sequences_to_tensors(
        [{"input_ids": torch.arange(4) + 3, "rewards": torch.tensor(1.0)}]
    )
    for rank, steps in ((0, 3), (1, 2)):
        rec = EpisodeRecorder(str(tmp_path / "rec"), rank, str)
        for step in range(steps):
            rec.write(step, batch, [{"query_id": "a"}])
        rec.close()
    decide = functools.partial(_steps_to_train, str(tmp_path / "rec"))
    assert on_two_ranks(decide, tmp_path) == [2, 2]


# --------------------------------------------------------------------------- launcher runs


@pytest.fixture(scope="module")
def online(tmp_path_factory, tiny_model_dir):
    root = str(tmp_path_factory.mktemp("rr_online"))
    record, reward = os.path.join(root, "recording"), os.path.join(root, "parity.py")
    with open(reward, "w") as f:
        f.write(PARITY_REWARD)
    args = [f"rollout.record={record}", f"reward={reward}:parity"]
    launch(overrides(root, "online", tiny_model_dir, *args))
    return root, args


@pytest.mark.integration  # a multi-second run: not in `make test-fast`
@pytest.mark.timeout(200)
def test_train_only_reproduces_the_online_first_update(online, tiny_model_dir):
    root, args = online
    out = launch(overrides(root, "replay", tiny_model_dir, "mode=train_only", *args))
    replay_dir = os.path.join(root, "rr", "replay")
    assert not any(n.startswith("server") for n in os.listdir(os.path.join(replay_dir, "logs")))
    assert "server0 healthy" not in out
    (a,), (b,) = metrics(os.path.join(root, "rr", "online")), metrics(replay_dir)
    assert a["loss"] != 0.0  # the parity reward differs within groups: a real update
    for key in ("loss", "grad_norm", "staleness", "n_tokens", "behave_imp_weight"):
        assert abs(a[key] - b[key]) <= 1e-6, (key, a[key], b[key])
    assert a["grad_norm"] > 0
    print(
        f"online loss {a['loss']!r} grad_norm {a['grad_norm']!r}, replayed {b['loss']!r} {b['grad_norm']!r}"
    )


@pytest.mark.integration  # a multi-second run: not in `make test-fast`
@pytest.mark.timeout(200)
def test_rollout_only_records_without_a_trainer(tmp_path, tiny_model_dir):
    record = tmp_path / "rec"
    launch(
        overrides(
            str(tmp_path),
            "ro",
            tiny_model_dir,
            "mode=rollout_only",
            f"rollout.record={record}",
            "total_train_steps=2",
        )
    )
    replay = RecordedBatches(str(record), 0)
    assert replay.n_steps == 2
    for step in range(replay.n_steps):
        batch = replay.batch(step)
        assert batch.batch_size[0] == PROMPTS * SAMPLES
        assert bool((batch["versions"][batch["loss_mask"].bool()] == 0).all())
    run_dir = tmp_path / "rr" / "ro"
    assert not (run_dir / "checkpoints").exists()  # no trainer: nothing to save
    assert [r["rollout/episodes_recorded"] for r in metrics(str(run_dir))] == [16, 16]


@pytest.mark.integration
@pytest.mark.timeout(200)
def test_rollout_only_ends_by_the_clock(tmp_path, tiny_model_dir):
    """total_train_secs ends a rollout_only run as it ends a training run: the step during
    which the budget ran out is recorded and is the last (not the 100 steps asked for)."""
    record = tmp_path / "rec"
    launch(
        overrides(
            str(tmp_path),
            "clock",
            tiny_model_dir,
            "mode=rollout_only",
            f"rollout.record={record}",
            "total_train_steps=100",
            "total_train_secs=0.001",
        )
    )
    assert RecordedBatches(str(record), 0).n_steps == 1
    run_dir = tmp_path / "rr" / "clock"
    assert [r["rollout/episodes_recorded"] for r in metrics(str(run_dir))] == [16]
