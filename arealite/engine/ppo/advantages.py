"""Advantages: from rewards (and values) to the per-token signal the losses weight.

GAE over padded or packed tokens, reward shaping, DAPO's overlong penalty, group-normalised
advantages (GRPO, RLOO, Dr. GRPO), token-level whitening, and DAPO's dynamic-sampling mask. Each
function is small and pure, with its equation in its docstring; the losses that use the
advantages are in `losses.py`.

Token tensors come either padded, [B, L] with a mask, or packed, [T] with a mask and
`cu_seqlens` (int, [n_seqs + 1], starting at 0) that mark where each sequence starts. Masks are
bool or 0/1 tensors. Functions that take `all_reduce=True` are collectives when
torch.distributed is initialised (every rank of `group` must call them) and return the
statistic of the global batch; the masked statistics live in `masked_stats.py`.

References: GAE (Schulman et al. 2016, arXiv 1506.02438), GRPO (arXiv 2402.03300), RLOO
(arXiv 2402.14740), DAPO (arXiv 2503.14476; overlong penalty, dynamic sampling), Dr. GRPO
(arXiv 2503.20783).
"""

from __future__ import annotations

from typing import Literal

import torch

from arealite.engine.ppo.masked_stats import (
    as_bool_mask,
    masked_count_sum,
    masked_mean,
    masked_normalization,
    masked_var,
    packed_seq_ids,
)

__all__ = [
    "compute_gae",
    "compute_gae_packed",
    "shape_rewards",
    "overlong_penalty",
    "group_normalize",
    "normalize_advantages",
    "dynamic_sampling_mask",
]


def _grouped(x: torch.Tensor, group_size: int, name: str) -> torch.Tensor:
    """x [N] viewed as [n_groups, group_size] (a group = the adjacent samples of one prompt)."""
    if x.ndim != 1 or group_size < 1 or x.numel() % group_size:
        raise ValueError(
            f"{name} must be 1-D with a length divisible by group_size={group_size}, "
            f"got {tuple(x.shape)}"
        )
    return x.view(-1, group_size)


def compute_gae(
    rewards: torch.Tensor,
    values: torch.Tensor | None,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over padded [B, L] token rewards and values.

        delta_t = r_t + gamma * V_{t+1} - V_t
        A_t     = delta_t + gamma * lam * A_{t+1}
        R_t     = A_t + V_t   (the critic's target)

    Only positions with mask set are steps: each step links to the next masked-in position in
    its row (masked positions, e.g. tool output inside a multi-turn response, are skipped and
    their rewards ignored), and after the row's last step V = 0 and A = 0 (the episode ended).
    values=None means no critic (V = 0). Masked positions get A = R = 0. Returns (A, R).
    """
    if rewards.ndim != 2:
        raise ValueError(f"compute_gae takes padded [B, L] tensors, got {tuple(rewards.shape)}")
    values = torch.zeros_like(rewards) if values is None else values.to(rewards.dtype)
    if values.shape != rewards.shape:
        raise ValueError(f"values {tuple(values.shape)} != rewards {tuple(rewards.shape)}")
    m = as_bool_mask(mask, rewards)
    rewards, values = torch.where(m, rewards, 0), torch.where(m, values, 0)
    advantages = torch.zeros_like(rewards)
    next_value = rewards.new_zeros(rewards.shape[0])
    next_adv = rewards.new_zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        advantages[:, t] = torch.where(m[:, t], adv, 0)
        next_adv = torch.where(m[:, t], adv, next_adv)
        next_value = torch.where(m[:, t], values[:, t], next_value)
    return advantages, torch.where(m, advantages + values, 0)


def compute_gae_packed(
    rewards: torch.Tensor,
    values: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    gamma: float,
    lam: float,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`compute_gae` for packed [T] tensors: each cu_seqlens segment is one episode (mask=None
    means every token of it is a step). Runs as one padded [n_seqs, max_len] recursion."""
    if rewards.ndim != 1:
        raise ValueError(f"compute_gae_packed takes packed [T] tensors, got {rewards.shape}")
    ids = packed_seq_ids(cu_seqlens, rewards.numel())
    pos = torch.arange(rewards.numel(), device=rewards.device) - cu_seqlens.long()[ids]
    n, max_len = cu_seqlens.numel() - 1, int(cu_seqlens.diff().max()) if rewards.numel() else 0

    def pad(x, fill):
        out = torch.full((n, max_len), fill, dtype=x.dtype, device=x.device)
        out[ids, pos] = x
        return out

    m = as_bool_mask(mask, rewards)
    vals = None if values is None else pad(values.to(rewards.dtype), 0)
    adv, ret = compute_gae(pad(rewards, 0), vals, pad(m, False), gamma, lam)
    return adv[ids, pos], ret[ids, pos]


def shape_rewards(
    rewards: torch.Tensor, scaling: float = 1.0, bias: float = 0.0, clip: float | None = None
) -> torch.Tensor:
    """r' = clip((r + bias) * scaling, -clip, clip): recentres and bounds the verifier's score."""
    if clip is not None and not clip > 0:
        raise ValueError(f"clip must be > 0 or None, got {clip}")
    out = (rewards + bias) * scaling
    return out if clip is None else out.clamp(-clip, clip)


def overlong_penalty(
    rewards: torch.Tensor,
    response_lengths: torch.Tensor,
    max_response_len: int,
    overlong_tokens: int,
    penalty_factor: float = 1.0,
) -> torch.Tensor:
    """DAPO's soft overlong punishment, added to per-sequence rewards [N].

    With L_max = max_response_len and L_cache = overlong_tokens:
        penalty(|y|) = 0                                   if |y| <= L_max - L_cache
                     = (L_max - L_cache - |y|) / L_cache    if L_max - L_cache < |y| <= L_max
                     = -1                                  if |y| > L_max
    times penalty_factor: long answers are discouraged smoothly rather than by a hard cut.
    """
    if not 0 < overlong_tokens <= max_response_len:
        raise ValueError(
            f"overlong_tokens must be in (0, max_response_len={max_response_len}], "
            f"got {overlong_tokens}"
        )
    if response_lengths.shape != rewards.shape:
        raise ValueError(
            f"response_lengths {tuple(response_lengths.shape)} != rewards {tuple(rewards.shape)}"
        )
    excess = response_lengths.to(rewards.dtype) - (max_response_len - overlong_tokens)
    return rewards + penalty_factor * (-excess / overlong_tokens).clamp(-1.0, 0.0)


_LEVELS = ("batch", "group", "none")


def group_normalize(
    x: torch.Tensor,
    group_size: int,
    mean_level: Literal["batch", "group", "none"] = "group",
    std_level: Literal["batch", "group", "none"] = "group",
    eps: float = 1e-5,
    leave_one_out: bool = False,
    unbiased: bool = True,
    all_reduce: bool = True,
    group=None,
) -> torch.Tensor:
    """Per-sequence rewards [N] -> advantages, N = n_groups * group_size (a group = the samples
    of one prompt, adjacent).

        A_i = (x_i - b_i) / (s_i + eps)
    b_i: mean of x over the sample's group (GRPO), the batch, or 0 ("none"); with
         leave_one_out the mean of the OTHER samples, sum_{j != i} x_j / (n - 1) (RLOO).
    s_i: standard deviation of x over its group or the batch (unbiased by default, as GRPO
         implementations use), or 1 with no eps ("none", e.g. Dr. GRPO).
    "batch" statistics are over all ranks when all_reduce (groups never span ranks).
    """
    if mean_level not in _LEVELS or std_level not in _LEVELS:
        raise ValueError(
            f"mean_level and std_level must be one of {_LEVELS}, got {mean_level!r}, {std_level!r}"
        )
    grouped = _grouped(x.to(torch.float64), group_size, "x")
    reduce_dim = {"batch": None, "group": -1}

    if mean_level == "none":
        baseline = torch.zeros_like(grouped)
    else:
        kw = dict(all_reduce=all_reduce and mean_level == "batch", group=group)
        _, dims, count, total = masked_count_sum(grouped, None, reduce_dim[mean_level], **kw)
        if leave_one_out:
            if bool((count < 2).any()):
                raise ValueError("leave_one_out needs at least 2 samples per mean")
            baseline = (total - grouped) / (count - 1)
        else:
            baseline = (total / count).expand_as(grouped)

    if std_level == "none":
        std, eps = torch.ones_like(grouped), 0.0
    else:
        var = masked_var(
            grouped,
            None,
            reduce_dim[std_level],
            unbiased=unbiased,
            keepdim=True,
            all_reduce=all_reduce and std_level == "batch",
            group=group,
        )
        std = var.sqrt()
    out = (grouped - baseline) / (std + eps)
    return out.view(-1).to(x.dtype if x.is_floating_point() else torch.float32)


def normalize_advantages(
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    mean_level: Literal["batch", "none"] = "batch",
    std_level: Literal["batch", "none"] = "batch",
    eps: float = 1e-5,
    unbiased: bool = False,
    all_reduce: bool = True,
    group=None,
) -> torch.Tensor:
    """Token-level advantage whitening over the (global) batch: (A - mean) / (std + eps), the
    statistics taken over loss_mask tokens only; either step can be switched off ("none").
    Both "batch" gives exactly `masked_normalization`. 0 at masked positions."""
    if mean_level not in ("batch", "none") or std_level not in ("batch", "none"):
        raise ValueError(
            f"token-level mean_level/std_level must be 'batch' or 'none', "
            f"got {mean_level!r}, {std_level!r}"
        )
    if mean_level == std_level == "batch":
        return masked_normalization(
            advantages, loss_mask, None, unbiased, eps, all_reduce=all_reduce, group=group
        )
    a64 = advantages.to(torch.float64)
    m = as_bool_mask(loss_mask, a64)
    if mean_level == "batch":
        a64 = a64 - masked_mean(a64, m, all_reduce=all_reduce, group=group)
    if std_level == "batch":
        var = masked_var(a64, m, unbiased=unbiased, all_reduce=all_reduce, group=group)
        a64 = a64 / (var.sqrt() + eps)
    return torch.where(m, a64, 0).to(advantages.dtype)


# ---------------------------------------------------------------------------------------------
# Losses
# ---------------------------------------------------------------------------------------------


def dynamic_sampling_mask(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Bool [n_groups]: True for groups whose rewards are not all equal (DAPO dynamic sampling).

        keep_g = exists i, j in g: r_i != r_j

    A group where every sample scored the same has zero group-normalised advantage and so no
    policy gradient; dropping it keeps the effective batch size honest.
    """
    grouped = _grouped(rewards, group_size, "rewards")
    return (grouped != grouped[:, :1]).any(dim=1)
