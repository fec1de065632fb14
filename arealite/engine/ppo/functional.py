"""The RL equations of arealite (PPO / GRPO and relatives), as small pure torch functions.

Each function is written to be read beside its paper. Token tensors come either padded, [B, L]
with a mask, or packed, [T] with a mask and `cu_seqlens` (int, [n_seqs + 1], starting at 0) that
mark where each sequence starts; the trainer works on packed micro-batches.

Masks are bool or 0/1 tensors; a position counts when its mask is non-zero. Functions that take
`all_reduce=True` are collectives when torch.distributed is initialised: every rank of `group`
must call them, and they return the statistic of the global batch (the concatenation of all
ranks' data), so N ranks give the same result as one process holding all the data. The masked
statistics themselves live in `masked_stats.py`, token logprobs in `logprobs.py`.

References: PPO (Schulman et al. 2017, arXiv 1707.06347), GAE (arXiv 1506.02438), dual clip
(Ye et al. 2020, arXiv 1912.09729), GRPO (arXiv 2402.03300), RLOO (arXiv 2402.14740), DAPO
(arXiv 2503.14476), GSPO (arXiv 2507.18071), decoupled PPO / AReaL (arXiv 2505.24298),
KL estimators (http://joschu.net/blog/kl-approx.html).
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
    sequence_masked_mean,
)
from arealite.utils.logprobs import compute_dtype

__all__ = [
    "kl_estimator",
    "compute_gae",
    "compute_gae_packed",
    "shape_rewards",
    "overlong_penalty",
    "group_normalize",
    "normalize_advantages",
    "ppo_actor_loss_fn",
    "ppo_critic_loss_fn",
    "dynamic_sampling_mask",
]


# ---------------------------------------------------------------------------------------------
# KL, rewards, advantages
# ---------------------------------------------------------------------------------------------


def kl_estimator(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    kind: Literal["k1", "k2", "k3"] = "k1",
    clamp: float | None = 10.0,
) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled from pi (Schulman's blog).

    With log_ratio = log pi(y) - log pi_ref(y):
        k1 = log_ratio                          unbiased, high variance, can be negative
        k2 = 0.5 * log_ratio^2                  biased, low variance, >= 0
        k3 = exp(-log_ratio) - 1 + log_ratio    unbiased, low variance, >= 0 (GRPO's choice)
    With `clamp`, the log-ratio and the estimate are clamped to [-clamp, clamp] (OpenRLHF and
    AReaL use 10): it keeps exp() finite and bounds a single token's penalty.
    """
    if kind not in ("k1", "k2", "k3"):
        raise ValueError(f"kind must be 'k1', 'k2' or 'k3', got {kind!r}")
    dtype = compute_dtype(logprobs.dtype)
    log_ratio = logprobs.to(dtype) - ref_logprobs.to(dtype)
    if clamp is not None:
        log_ratio = log_ratio.clamp(-clamp, clamp)
    if kind == "k1":
        kl = log_ratio
    elif kind == "k2":
        kl = 0.5 * log_ratio.square()
    else:
        kl = torch.expm1(-log_ratio) + log_ratio
    return kl if clamp is None else kl.clamp(-clamp, clamp)


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
    if x.ndim != 1 or group_size < 1 or x.numel() % group_size:
        raise ValueError(
            f"x must be 1-D with a length divisible by group_size={group_size}, got {x.shape}"
        )
    x64 = x.to(torch.float64)
    grouped = x64.view(-1, group_size)
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


def _sequence_level(log_ratio, mask, cu_seqlens):
    """Broadcast each sequence's mean log-ratio back to its tokens (GSPO)."""
    seq_mean = sequence_masked_mean(log_ratio, mask, cu_seqlens)
    if log_ratio.ndim == 2:
        return seq_mean[:, None].expand_as(log_ratio)
    return seq_mean[packed_seq_ids(cu_seqlens, log_ratio.numel())]


def ppo_actor_loss_fn(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    loss_mask: torch.Tensor,
    eps_clip_higher: float | None = None,
    c_clip: float | None = None,
    proximal_logprobs: torch.Tensor | None = None,
    behav_imp_weight_cap: float | None = None,
    importance_sampling_level: Literal["token", "sequence"] = "token",
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Decoupled PPO clipped surrogate (AReaL, arXiv 2505.24298), on [B, L] or packed [T].

    old_logprobs are the behaviour policy's (the inference server's, possibly stale) and
    proximal_logprobs the recomputed logprobs of the policy the trust region is centred on
    (defaults to old_logprobs, which is standard PPO):
        r_t   = exp(log pi(y_t) - log pi_prox(y_t))
        L_t   = max(-A_t r_t, -A_t clip(r_t, 1 - eps_clip, 1 + eps_clip_higher))   (PPO; DAPO
                                                                clip-higher when eps_clip_higher)
        L_t   = min(L_t, -A_t c_clip)   for A_t < 0, when c_clip > 1 is given  (dual clip)
        w_t   = exp(log pi_prox(y_t) - log pi_behav(y_t))   (detached; off-policy correction)
        w_t   = 0 where w_t > behav_imp_weight_cap          (drop too-stale tokens)
        loss  = sum_t m_t w_t L_t / sum_t m_t
    Capped tokens add 0 but still count in the denominator. With importance_sampling_level=
    "sequence" (GSPO), log r_t is replaced by the mean of log r over its sequence's masked
    tokens (rows of [B, L]; cu_seqlens segments of packed [T]), so all its tokens share one
    ratio. Returns (loss, stats); stats hold detached per-token tensors (0 off the mask) and
    scalar ratios/means for logging.
    """
    _check_actor_loss_args(
        (logprobs, old_logprobs, advantages, loss_mask, proximal_logprobs), eps_clip,
        eps_clip_higher, c_clip, behav_imp_weight_cap, importance_sampling_level, cu_seqlens,
    )  # fmt: skip
    mask = loss_mask != 0
    prox = old_logprobs if proximal_logprobs is None else proximal_logprobs
    adv = torch.where(mask, advantages, 0).detach()
    # Mask before exp so padding garbage can neither overflow nor send NaN into the gradient.
    log_ratio = torch.where(mask, logprobs - prox.detach(), 0)
    if importance_sampling_level == "sequence":
        if logprobs.ndim == 1 and cu_seqlens is None:
            raise ValueError("sequence-level importance sampling on packed input needs cu_seqlens")
        log_ratio = torch.where(mask, _sequence_level(log_ratio, mask, cu_seqlens), 0)
    ratio = log_ratio.exp()

    high = eps_clip if eps_clip_higher is None else eps_clip_higher
    pg_loss, clip_mask, dual_clip_mask = _clipped_surrogate(
        adv, ratio, eps_clip, high, c_clip, mask
    )
    behav_weight, behav_log, behav_mask = _behaviour_weight(
        prox, old_logprobs, mask, behav_imp_weight_cap
    )
    token_loss = torch.where(mask, pg_loss * behav_weight, 0)
    loss = token_loss.sum() / mask.sum().clamp(min=1)
    stats = _actor_loss_stats(
        token_loss, ratio, log_ratio, mask, clip_mask, dual_clip_mask, behav_weight, behav_log,
        behav_mask,
    )  # fmt: skip
    return loss, stats


def _check_actor_loss_args(tensors, eps_clip, eps_clip_higher, c_clip, cap, level, cu_seqlens):
    if level not in ("token", "sequence"):
        raise ValueError(f"importance_sampling_level must be 'token' or 'sequence', got {level!r}")
    if not eps_clip > 0 or (eps_clip_higher is not None and not eps_clip_higher > 0):
        raise ValueError(f"eps_clip/eps_clip_higher must be > 0, got {eps_clip}, {eps_clip_higher}")
    if c_clip is not None and not c_clip > 1:
        raise ValueError(f"c_clip must be > 1 (dual clip), got {c_clip}")
    if cap is not None and not cap > 0:
        raise ValueError(f"behav_imp_weight_cap must be > 0, got {cap}")
    if cu_seqlens is not None and tensors[0].ndim != 1:
        raise ValueError("cu_seqlens is only for packed 1-D inputs")
    shapes = {tuple(t.shape) for t in tensors if t is not None}
    if len(shapes) != 1:
        raise ValueError(
            f"logprobs, old/proximal logprobs, advantages, loss_mask shapes differ: {shapes}"
        )


def _clipped_surrogate(adv, ratio, eps_clip, eps_high, c_clip, mask):
    """Per-token PPO loss max(-A r, -A clip(r)), dual-clipped for A < 0; and which tokens each
    clip decided."""
    pg_loss1 = -adv * ratio
    pg_loss2 = -adv * ratio.clamp(1.0 - eps_clip, 1.0 + eps_high)
    clip_mask = (pg_loss2 > pg_loss1).detach() & mask
    pg_loss = torch.where(clip_mask, pg_loss2, pg_loss1)
    if c_clip is None:
        return pg_loss, clip_mask, torch.zeros_like(mask)
    pg_loss3 = -adv * c_clip
    dual_clip_mask = ((adv < 0) & (pg_loss > pg_loss3)).detach() & mask
    return torch.where(dual_clip_mask, pg_loss3, pg_loss), clip_mask, dual_clip_mask


def _behaviour_weight(prox, old_logprobs, mask, cap):
    """w_t = exp(log pi_prox - log pi_behav), detached, 0 where over `cap`; (w, log w, kept)."""
    behav_log = torch.where(mask, prox - old_logprobs, 0).detach()
    behav_weight = behav_log.exp()
    behav_mask = mask if cap is None else mask & (behav_weight <= cap)
    return (
        torch.where(behav_mask, behav_weight, 0),
        torch.where(behav_mask, behav_log, 0),
        behav_mask,
    )


def _actor_loss_stats(
    token_loss, ratio, log_ratio, mask, clip_mask, dual_clip_mask, behav_weight, behav_log,
    behav_mask,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """Detached per-token tensors (0 off the mask) and scalar ratios / means for logging."""
    n_tokens = mask.sum()

    def ratio_of(b):
        return b.sum() / n_tokens.clamp(min=1)

    approx_kl = torch.where(mask, log_ratio, 0).detach()
    return dict(
        loss=token_loss.detach(),
        importance_weight=torch.where(mask, ratio, 0).detach(),
        approx_kl=approx_kl,
        clip_mask=clip_mask,
        dual_clip_mask=dual_clip_mask,
        behave_imp_weight=behav_weight,
        behave_approx_kl=behav_log,
        behave_mask=behav_mask,
        n_tokens=n_tokens,
        clip_ratio=ratio_of(clip_mask),
        dual_clip_ratio=ratio_of(dual_clip_mask),
        behave_mask_ratio=ratio_of(behav_mask),
        importance_weight_mean=masked_mean(ratio.detach(), mask),
        approx_kl_mean=masked_mean(approx_kl, mask),
        behave_imp_weight_mean=masked_mean(behav_weight, behav_mask),
        behave_approx_kl_mean=masked_mean(behav_log, behav_mask),
    )


def ppo_critic_loss_fn(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    value_eps_clip: float | None,
    loss_mask: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss (PPO2 / OpenAI baselines), on [B, L] or packed [T]:

        V_clip = V_old + clip(V - V_old, -value_eps_clip, value_eps_clip)
        L_t    = 0.5 * max((V - R)^2, (V_clip - R)^2)
        loss   = sum_t m_t L_t / sum_t m_t

    The clip keeps the critic from moving far from the values the advantages were computed
    with; value_eps_clip=None disables it. Returns (loss, stats) like `ppo_actor_loss_fn`.
    """
    if value_eps_clip is not None and not value_eps_clip > 0:
        raise ValueError(f"value_eps_clip must be > 0 or None, got {value_eps_clip}")
    mask = loss_mask != 0
    returns, old_values = returns.detach(), old_values.detach()
    loss1 = (values - returns).square()
    if value_eps_clip is None:
        loss2 = loss1
    else:
        clipped = old_values + (values - old_values).clamp(-value_eps_clip, value_eps_clip)
        loss2 = (clipped - returns).square()
    clip_mask = (loss2 > loss1).detach() & mask
    token_loss = torch.where(mask, 0.5 * torch.where(clip_mask, loss2, loss1), 0)
    n_tokens = mask.sum()
    loss = token_loss.sum() / n_tokens.clamp(min=1)
    stats = dict(
        loss=token_loss.detach(),
        clip_mask=clip_mask,
        n_tokens=n_tokens,
        clip_ratio=clip_mask.sum() / n_tokens.clamp(min=1),
        value_mean=masked_mean(values.detach(), mask),
    )
    return loss, stats


def dynamic_sampling_mask(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Bool [n_groups]: True for groups whose rewards are not all equal (DAPO dynamic sampling).

    A group where every sample scored the same has zero group-normalised advantage and so no
    policy gradient; dropping it keeps the effective batch size honest.
    """
    if rewards.ndim != 1 or group_size < 1 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards must be 1-D with a length divisible by group_size={group_size}, "
            f"got {tuple(rewards.shape)}"
        )
    grouped = rewards.view(-1, group_size)
    return (grouped != grouped[:, :1]).any(dim=1)
