"""Supervised fine-tuning: the packed token-mean negative log-likelihood over target tokens.

`loss_mask[i] = 1` marks token i as a target, predicted from position i-1 (so a sequence's
first token can never be one). The mean is over all target tokens of the global batch (all
micro-batches, all ranks): long answers weigh by their length, as in standard SFT.
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict

from arealite.api.cli_args import TrainEngineConfig
from arealite.api.engine_api import TrainEngine
from arealite.engine.fsdp_engine import FSDPEngine
from arealite.engine.packing import packed_logprobs, target_mask
from arealite.utils import distributed as du


def sft_loss_fn(logits: torch.Tensor, mb: dict[str, Any]) -> torch.Tensor:
    """Mean NLL over the micro-batch's target tokens."""
    logp = packed_logprobs(logits, mb["input_ids"], mb["cu_seqlens"])
    mask = target_mask(mb)
    return -torch.where(mask, logp, 0).sum() / mask.sum().clamp(min=1)


def sft_loss_weight(mb: dict[str, Any]) -> float:
    return float(target_mask(mb).sum())


def _require_loss_mask(data: TensorDict) -> None:
    error = None
    if isinstance(data, TensorDict) and "loss_mask" not in data.keys():
        error = KeyError(
            f"SFT batch has no 'loss_mask' entry (1 on target tokens); keys: {sorted(data.keys())}"
        )
    du.raise_if_any_rank_failed(error)


class LMEngine:
    """SFT on top of any TrainEngine."""

    def __init__(self, engine: TrainEngine):
        self.engine = engine

    def train_lm(self, data: TensorDict) -> dict[str, float]:
        """One optimizer step on `data` (input_ids, attention_mask, loss_mask [B, L]);
        returns the engine's stats (loss = mean NLL before the update, grad_norm, lr, ...)."""
        _require_loss_mask(data)
        self.engine.train()
        return self.engine.train_batch(data, sft_loss_fn, sft_loss_weight)

    def evaluate_lm(self, data: TensorDict) -> float | None:
        """Mean NLL over the target tokens of `data` (global over ranks); None if empty."""
        _require_loss_mask(data)
        self.engine.eval()
        loss = self.engine.eval_batch(data, sft_loss_fn, sft_loss_weight)
        return None if loss is None else float(loss)


class FSDPLMEngine(FSDPEngine):
    """FSDPEngine + `train_lm` / `evaluate_lm`."""

    def __init__(self, config: TrainEngineConfig):
        super().__init__(config)
        self.lm_engine = LMEngine(self)

    def train_lm(self, data: TensorDict) -> dict[str, float]:
        return self.lm_engine.train_lm(data)

    def evaluate_lm(self, data: TensorDict) -> float | None:
        return self.lm_engine.evaluate_lm(data)
