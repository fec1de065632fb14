"""PPO with a critic: preflight rules of GRPOConfig, and the critic learning returns (value
loss falls, explained variance rises) on the tiny model."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from _launch import local_launch, torchrun
from _torchrun_fsdp import engine_config, make_batch, train_variant

from arealite.api.cli_args import (
    ConfigError,
    GRPOConfig,
    OptimizerConfig,
    PPOCriticConfig,
    load_expr_config,
)
from arealite.engine.ppo.critic import FSDPPPOCritic


def _base(model_dir):
    return ["experiment_name=x", "trial_name=y", f"actor.path={model_dir}"]


def test_ppo_preset_needs_a_critic_and_group_presets_refuse_one(tiny_model_dir):
    base = _base(tiny_model_dir)
    with pytest.raises(ConfigError, match="preset=ppo needs a value model"):
        load_expr_config(base + ["actor.preset=ppo"], GRPOConfig)
    with pytest.raises(ConfigError, match="critic is set but actor.preset='grpo'"):
        load_expr_config(base + ["actor.preset=grpo", f"critic.path={tiny_model_dir}"], GRPOConfig)
    cfg = load_expr_config(base + ["actor.preset=ppo", f"critic.path={tiny_model_dir}"], GRPOConfig)
    assert cfg.critic.is_critic and cfg.actor.gae_lambda == 0.95
    shipped = [
        "--config",
        "examples/configs/arith_ppo.yaml",
        f"actor.path={tiny_model_dir}",
        f"critic.path={tiny_model_dir}",
    ]
    assert load_expr_config(shipped, GRPOConfig).critic is not None
    with pytest.raises(ConfigError, match="critic.warmup_steps must be >= 0"):
        load_expr_config(shipped + ["critic.warmup_steps=-1"], GRPOConfig)
    with pytest.raises(ConfigError, match="critic.warmup_steps=5 >= total_train_steps=5"):
        load_expr_config(shipped + ["critic.warmup_steps=5", "total_train_steps=5"], GRPOConfig)


def test_critic_value_loss_falls_and_explained_variance_rises(tiny_model_dir):
    base = engine_config(tiny_model_dir, optimizer=OptimizerConfig(lr=3e-3, weight_decay=0.0))
    cfg = PPOCriticConfig(**{k: getattr(base, k) for k in ("path", "fsdp", "mb_spec", "optimizer")})
    critic = FSDPPPOCritic(cfg)
    critic.initialize(None, None)
    try:
        batch = make_batch(n=8, seed=11)
        # returns depend on the sequence (its first token), so a value model can fit them
        target = (batch["input_ids"][:, :1] % 7).float() / 3.0 - 1.0
        mask = batch["loss_mask"].bool() & batch["attention_mask"].bool()
        batch["returns"] = torch.where(mask, target.expand_as(mask), 0.0)
        losses, ev = [], []
        for _ in range(12):
            batch["values"] = critic.compute_values(batch)
            v, r = batch["values"][mask], batch["returns"][mask]
            ev.append(float(1 - (r - v).var() / r.var()))
            stats = critic.ppo_update(batch)
            assert stats["explained_variance"] == pytest.approx(ev[-1], abs=1e-4)  # logged
            losses.append(stats["value_loss"])
        assert losses[-1] < 0.3 * losses[0], losses
        assert ev[-1] > 0.5 and ev[-1] > ev[0] + 0.3, ev
    finally:
        critic.destroy()


def run_two_gloo_ranks(mode: str, model_dir: str, out) -> dict:
    """tests/_torchrun_fsdp.py --mode MODE on 2 gloo ranks; rank 0's stats and weights."""
    script = os.path.join(os.path.dirname(__file__), "_torchrun_fsdp.py")
    args = ["--mode", mode, "--model", model_dir, "--out", out, "--hf-dir", f"{out}_hf"]
    torchrun(script, 2, *args)
    two = torch.load(out, weights_only=False)
    assert two["world"] == 2
    return two


@pytest.mark.integration  # a multi-second run: not in `make test-fast`
def test_critic_on_two_gloo_ranks_matches_one_rank(tiny_model_dir, tmp_path):
    """Uneven row slices per rank: value loss, explained variance and weights equal 1 rank's."""
    two = run_two_gloo_ranks("critic", tiny_model_dir, tmp_path / "critic.pt")
    one_stats, one_weights = train_variant("critic", tiny_model_dir, 48, 2, 0, 1)
    for a, b in zip(one_stats, two["stats"], strict=True):
        for key in ("value_loss", "explained_variance", "value_grad_norm", "value_mean"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-5), key
    assert one_weights.keys() == two["weights"].keys()
    for k, w in one_weights.items():
        torch.testing.assert_close(w, two["weights"][k], atol=1e-5, rtol=0, msg=k)


@pytest.mark.integration
def test_ppo_with_a_critic_runs_through_the_launcher(tiny_model_dir, tmp_path):
    """examples/grpo.py + arith_ppo.yaml, sync, 2 steps, the first a critic warm-up step: the
    critic's value loss and explained variance reach metrics.jsonl every step, the actor
    trains only after the warm-up."""
    local_launch(
        "grpo.py",
        "arith_ppo.yaml",
        f"cluster.fileroot={tmp_path}",
        f"actor.path={tiny_model_dir}",
        f"critic.path={tiny_model_dir}",
        "rollout.max_head_offpolicyness=0",
        "total_train_steps=2",
        "critic.warmup_steps=1",
        "train_dataset.batch_size=4",
        "valid_dataset.options.size=4",
        "evaluator.freq_steps=null",
    )
    lines = open(tmp_path / "arith-ppo" / "demo" / "metrics.jsonl").read().splitlines()
    records = [json.loads(line) for line in lines]
    assert len(records) == 2
    assert "loss" not in records[0] and "loss" in records[1]  # the actor's, after warm-up
    for r in records:
        ev = r["ppo_critic/explained_variance"]  # very negative for a fresh head: just finite
        assert r["ppo_critic/value_loss"] > 0 and math.isfinite(ev) and ev <= 1
