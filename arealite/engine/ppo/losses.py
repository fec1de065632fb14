"""Losses: the PPO family's objectives and the KL penalty, as small pure torch functions.

The decoupled PPO clipped surrogate (PPO, DAPO clip-higher, dual clip, GSPO sequence-level
ratios, AReaL's behaviour-policy weight), the clipped value loss of the critic, and the KL
estimators of the reference-model penalty; each function with its equation in its docstring.
The advantages they weight come from `advantages.py`.

Token tensors come either padded, [B, L] with a mask, or packed, [T] with a mask and
`cu_seqlens` (int, [n_seqs + 1], starting at 0). Masks are bool or 0/1 tensors; a position
counts when its mask is non-zero.

References: PPO (Schulman et al. 2017, arXiv 1707.06347), dual clip (Ye et al. 2020, arXiv
1912.09729), DAPO (arXiv 2503.14476), GSPO (arXiv 2507.18071), decoupled PPO / AReaL (arXiv
2505.24298), KL estimators (http://joschu.net/blog/kl-approx.html).
"""

from __future__ import annotations

from typing import Literal

import torch

from arealite.engine.logprobs import compute_dtype
from arealite.engine.ppo.masked_stats import masked_mean, packed_seq_ids, sequence_masked_mean

__all__ = ["kl_estimator", "ppo_actor_loss_fn", "ppo_critic_loss_fn"]


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
        (logprobs, old_logprobs, advantages, loss_mask, proximal_logprobs),
        eps_clip,
        eps_clip_higher,
        c_clip,
        behav_imp_weight_cap,
        importance_sampling_level,
        cu_seqlens,
    )
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
    clips = (clip_mask, dual_clip_mask)
    behaviour = (behav_weight, behav_log, behav_mask)
    return loss, _actor_loss_stats(token_loss, ratio, log_ratio, mask, clips, behaviour)


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


def _actor_loss_stats(token_loss, ratio, log_ratio, mask, clips, behaviour) -> dict:
    """Detached per-token tensors (0 off the mask) and scalar ratios / means for logging;
    `clips` = (clip mask, dual-clip mask), `behaviour` = (weight, log weight, kept mask)."""
    clip_mask, dual_clip_mask = clips
    behav_weight, behav_log, behav_mask = behaviour
    n_tokens = mask.sum()
    approx_kl = torch.where(mask, log_ratio, 0).detach()
    stats = {
        "loss": token_loss.detach(),
        "importance_weight": torch.where(mask, ratio, 0).detach(),
        "approx_kl": approx_kl,
        "clip_mask": clip_mask,
        "dual_clip_mask": dual_clip_mask,
        "behave_imp_weight": behav_weight,
        "behave_approx_kl": behav_log,
        "behave_mask": behav_mask,
        "n_tokens": n_tokens,
    }
    for name, selected in (
        ("clip", clip_mask),
        ("dual_clip", dual_clip_mask),
        ("behave_mask", behav_mask),
    ):
        stats[f"{name}_ratio"] = selected.sum() / n_tokens.clamp(min=1)
    for name, m in (
        ("importance_weight", mask),
        ("approx_kl", mask),
        ("behave_imp_weight", behav_mask),
        ("behave_approx_kl", behav_mask),
    ):
        stats[f"{name}_mean"] = masked_mean(stats[name], m)
    return stats


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
