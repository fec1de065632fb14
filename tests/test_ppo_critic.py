"""PPO with a critic: preflight rules of GRPOConfig, and the critic learning returns (value
loss falls, explained variance rises) on the tiny model."""

from __future__ import annotations

import pytest
import torch
from _torchrun_fsdp import engine_config, make_batch

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
    shipped = ["--config", "examples/configs/arith_ppo.yaml", f"actor.path={tiny_model_dir}",
               f"critic.path={tiny_model_dir}"]  # fmt: skip
    assert load_expr_config(shipped, GRPOConfig).critic is not None


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
