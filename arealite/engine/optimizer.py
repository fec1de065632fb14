"""AdamW and its learning-rate schedule (linear warmup, then constant / linear / cosine)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from arealite.api.cli_args import OptimizerConfig
from arealite.api.io_struct import FinetuneSpec


def lr_lambda(kind: str, warmup_steps: int, total_steps: int, min_ratio: float) -> Callable:
    """LR multiplier: linear warmup to 1 over `warmup_steps`, then constant / linear / cosine
    decay to `min_ratio` at `total_steps`."""

    def f(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if kind == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        decay = 1.0 - progress if kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return min_ratio + (1.0 - min_ratio) * decay

    return f


def build_optimizer(
    model: nn.Module, cfg: OptimizerConfig, ft_spec: FinetuneSpec | None
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW (no weight decay on 1-D params: biases, norms) and its LR schedule."""
    if cfg.lr_scheduler_type != "constant" and ft_spec is None:
        raise ValueError(
            f"optimizer.lr_scheduler_type={cfg.lr_scheduler_type!r} needs the training length: "
            "pass a FinetuneSpec to initialize()"
        )
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps
    )
    total = ft_spec.total_train_steps if ft_spec else 1
    warmup = int(cfg.warmup_steps_proportion * total)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lr_lambda(cfg.lr_scheduler_type, warmup, total, cfg.min_lr_ratio)
    )
    return opt, sched
