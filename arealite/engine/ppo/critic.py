"""The PPO value model: the actor's backbone with a scalar head per token.

`values[i]` is aligned with input_ids like logprobs: the value of the state in which token i
is chosen (the head's output at position i-1), 0 at position 0. GAE (`compute_advantages` in
the actor) reads `batch["values"]`; the critic regresses on `batch["returns"]`.
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict

from arealite.api.cli_args import PPOCriticConfig
from arealite.api.engine_api import TrainEngine
from arealite.engine.fsdp_engine import FSDPEngine
from arealite.engine.packing import shift_right_packed, target_mask
from arealite.engine.ppo.losses import ppo_critic_loss_fn
from arealite.utils import distributed as du
from arealite.utils.data import split_padded_tensor_dict


class PPOCritic:
    """Value estimation and the clipped value loss around a critic TrainEngine."""

    def __init__(self, config: PPOCriticConfig, engine: TrainEngine):
        if not config.is_critic:
            raise ValueError("PPOCritic needs a config with is_critic=true (a value head)")
        self.config = config
        self.engine = engine

    @torch.no_grad()
    def compute_values(self, data: TensorDict) -> torch.Tensor:
        """Values [B, L] (float32, 0 at position 0 and on padding)."""
        self.engine.eval()
        out = self.engine.forward(
            data, post_hook=lambda v, mb: shift_right_packed(v, mb["cu_seqlens"])
        )
        return None if out is None else out.float().cpu()

    def ppo_update(self, data: TensorDict) -> dict[str, float]:
        """`ppo_n_minibatches` steps of the clipped value loss towards `returns`; `values`
        (from compute_values before the update) anchor the clip."""
        missing = [k for k in ("loss_mask", "values", "returns") if k not in data.keys()]
        error = KeyError(f"critic ppo_update: batch has no {missing[0]!r}") if missing else None
        du.raise_if_any_rank_failed(error)
        acc = {"n_tokens": 0.0, "clip": 0.0, "value": 0.0}

        def loss_fn(values: torch.Tensor, mb: dict[str, Any]) -> torch.Tensor:
            v = shift_right_packed(values, mb["cu_seqlens"])
            mask = target_mask(mb)
            loss, st = ppo_critic_loss_fn(
                v, mb["values"].float(), mb["returns"].float(), self.config.value_eps_clip, mask
            )
            acc["n_tokens"] += float(mask.sum())
            acc["clip"] += float(st["clip_mask"].sum())
            acc["value"] += float(torch.where(mask, v.detach(), 0).sum())
            return loss

        self.engine.train()
        steps = [
            self.engine.train_batch(mb, loss_fn, lambda mb: float(target_mask(mb).sum()))
            for mb in split_padded_tensor_dict(data, self.config.ppo_n_minibatches)
        ]
        n, clip, value = du.all_reduce_sum([acc["n_tokens"], acc["clip"], acc["value"]])
        return dict(
            explained_variance=explained_variance(data["values"], data["returns"], data),
            value_loss=sum(s["loss"] for s in steps) / len(steps),
            value_grad_norm=sum(s["grad_norm"] for s in steps) / len(steps),
            value_clip_ratio=clip / max(n, 1.0),
            value_mean=value / max(n, 1.0),
            update_successful=min(s["update_successful"] for s in steps),
        )


def explained_variance(values: torch.Tensor, returns: torch.Tensor, data: TensorDict) -> float:
    """1 - Var(returns - values) / Var(returns) over the completion tokens of all ranks, with
    the values the batch was scored with (before this update): 1 = the critic predicts the
    returns, 0 = no better than their mean, < 0 = worse."""
    mask = data["loss_mask"].bool()
    if "attention_mask" in data.keys():
        mask = mask & data["attention_mask"].bool()
    r, d = returns.float()[mask], (returns.float() - values.float())[mask]
    n, sr, sr2, sd, sd2 = du.all_reduce_sum(
        [
            float(mask.sum()),
            float(r.sum()),
            float((r * r).sum()),
            float(d.sum()),
            float((d * d).sum()),
        ]
    )
    if n < 2:
        return 0.0
    var_r = sr2 / n - (sr / n) ** 2
    var_d = sd2 / n - (sd / n) ** 2
    return 1.0 - var_d / var_r if var_r > 1e-12 else 0.0


class FSDPPPOCritic(FSDPEngine):
    """An FSDPEngine with a value head (AutoModelForTokenClassification, num_labels=1)."""

    def __init__(self, config: PPOCriticConfig):
        super().__init__(config)
        self.critic = PPOCritic(config, self)

    def compute_values(self, data: TensorDict) -> torch.Tensor:
        return self.critic.compute_values(data)

    def ppo_update(self, data: TensorDict) -> dict[str, float]:
        return self.critic.ppo_update(data)
