"""Statistics of a PPO update, all global over ranks: before it (`batch_stats`: sizes,
staleness, trainer-vs-server logprob gap) and of it (`update_stats`, from the token-weighted
sums that `accumulate` / `accumulate_behaviour_gap` gather micro-batch by micro-batch inside
the loss function, then all-reduce once)."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from arealite.engine.ppo.losses import kl_estimator
from arealite.engine.ppo.masked_stats import masked_mean
from arealite.utils import distributed as du

# Statistics accumulated over micro-batches as token-weighted sums (then all-reduced).
_SUM_KEYS = ("importance_weight", "approx_kl", "clip_mask", "dual_clip_mask", "entropy")
# Sums of squares, for the spread (std) of the importance weights over tokens.
_SQUARE_KEYS = ("importance_weight_sq", "behave_imp_weight_sq")
# Trainer-vs-server logprob gap, summed in the update when prox_logp comes from its forward.
_PROX_KEYS = ("behave_kl_k1", "behave_kl_k3")


def new_accumulator() -> dict[str, float]:
    """The zeroed sums `accumulate` adds to and `update_stats` reads."""
    keys = (*_SUM_KEYS, *_PROX_KEYS, "n_tokens", "behave_imp_weight", "behave_n", *_SQUARE_KEYS)
    acc = dict.fromkeys(keys, 0.0)
    acc["behave_logp_absdiff_max"] = 0.0
    return acc


def batch_stats(data: TensorDict, version: int) -> dict[str, float]:
    """Global pre-update statistics: sizes, staleness against the trainer's weight `version`,
    trainer-vs-server logprob gap."""
    mask = data["loss_mask"].bool() & data["attention_mask"].bool()
    n_tokens, n_seqs = du.all_reduce_sum([float(mask.sum()), float(data.batch_size[0])])
    stats = {"n_tokens": n_tokens, "n_seqs": n_seqs}
    if "versions" in data.keys():
        stale = (version - data["versions"]).float()
        stats["staleness"] = masked_mean(stale, mask, all_reduce=True).item()
        big = stale[mask].max().item() if bool(mask.any()) else 0.0
        stats["staleness_max"] = du.all_reduce_max([big])[0]
        stats.update(regime_stats(data, version))
    if "prox_logp" in data.keys():
        behav, prox = data["logprobs"].float(), data["prox_logp"].float()
        for kind in ("k1", "k3"):  # KL(behaviour || current), sampled from behaviour
            kl = kl_estimator(behav, prox, kind)
            stats[f"behave_kl_{kind}"] = masked_mean(kl, mask, all_reduce=True).item()
        gap = (behav - prox).abs()[mask].max().item() if bool(mask.any()) else 0.0
        stats["behave_logp_absdiff_max"] = du.all_reduce_max([gap])[0]
    stats["advantages_mean"] = masked_mean(data["advantages"].float(), mask, all_reduce=True).item()
    return stats


def regime_stats(data: TensorDict, version: int) -> dict[str, float]:
    """What makes a batch long-tailed and off-policy, over every generated token (masks zeroed
    by dynamic sampling included): output lengths (p50 / p90 / max), the share of tokens sampled
    by weights older than `version`, and the share of sequences whose tokens came from more than
    one weight version (interrupted by a weight update, then resumed)."""
    generated = (data["versions"] >= 0) & data["attention_mask"].bool()
    lengths = generated.sum(-1)
    versions = torch.where(generated, data["versions"], version).int()
    oldest = torch.where(generated, versions, torch.iinfo(torch.int32).max).amin(-1)
    newest = torch.where(generated, versions, -1).amax(-1)
    n_old, n_tok, n_mixed, n_seq = du.all_reduce_sum(
        [
            float((generated & (versions < version)).sum()),
            float(generated.sum()),
            float(((newest > oldest) & (lengths > 0)).sum()),
            float(lengths.numel()),
        ]
    )
    all_lengths = torch.tensor(du.all_gather_objects(lengths.tolist()), dtype=torch.float)
    p50, p90 = torch.quantile(all_lengths, torch.tensor([0.5, 0.9])).tolist()
    return {
        "gen_len_p50": p50,
        "gen_len_p90": p90,
        "gen_len_max": float(all_lengths.max()),
        "off_policy_token_frac": n_old / max(n_tok, 1.0),
        "resumed_seq_frac": n_mixed / max(n_seq, 1.0),
    }


def update_stats(
    acc: dict[str, float], step_stats: list[dict[str, float]], fused_prox: bool
) -> dict[str, float]:
    """Global statistics of the update from the micro-batch sums in `acc` and the engine's
    per-step results (loss, grad_norm, lr, update_successful)."""
    gap = acc.pop("behave_logp_absdiff_max")
    totals = dict(zip(acc, du.all_reduce_sum(list(acc.values()))))
    n = max(totals["n_tokens"], 1.0)
    stats = {k.replace("_mask", "_ratio"): totals[k] / n for k in _SUM_KEYS}
    stats["behave_imp_weight"] = totals["behave_imp_weight"] / max(totals["behave_n"], 1.0)
    for key, count in (("importance_weight", n), ("behave_imp_weight", max(totals["behave_n"], 1))):
        mean_sq = totals[f"{key}_sq"] / count
        stats[f"{key}_std"] = max(mean_sq - (totals[key] / count) ** 2, 0.0) ** 0.5
    stats["behave_mask_ratio"] = totals["behave_n"] / n
    if fused_prox:  # what batch_stats reports when prox_logp comes with the batch
        stats["behave_kl_k1"] = totals["behave_kl_k1"] / n
        stats["behave_kl_k3"] = totals["behave_kl_k3"] / n
        stats["behave_logp_absdiff_max"] = du.all_reduce_max([gap])[0]
    for k in ("loss", "grad_norm"):
        stats[k] = sum(s[k] for s in step_stats) / len(step_stats)
    stats["lr"] = step_stats[-1]["lr"]
    stats["update_successful"] = min(s["update_successful"] for s in step_stats)
    stats["n_minibatches"] = float(len(step_stats))
    return stats


def accumulate(
    acc: dict[str, float], st: dict[str, torch.Tensor], mask: torch.Tensor, entropy: torch.Tensor
) -> None:
    """Add one micro-batch's loss statistics `st` (and entropies) over target tokens."""
    acc["n_tokens"] += float(mask.sum())
    for k in ("importance_weight", "approx_kl", "clip_mask", "dual_clip_mask"):
        acc[k] += float(st[k].float().sum())
    acc["entropy"] += float(torch.where(mask, entropy.detach(), 0).sum())
    acc["behave_imp_weight"] += float(st["behave_imp_weight"].sum())
    acc["importance_weight_sq"] += float(st["importance_weight"].float().square().sum())
    acc["behave_imp_weight_sq"] += float(st["behave_imp_weight"].float().square().sum())
    acc["behave_n"] += float(st["behave_mask"].sum())


def accumulate_behaviour_gap(
    acc: dict[str, float], behav: torch.Tensor, prox: torch.Tensor, mask: torch.Tensor
) -> None:
    """KL(behaviour || current) estimators and the largest |logp gap| over target tokens."""
    for kind in ("k1", "k3"):
        acc[f"behave_kl_{kind}"] += float(
            torch.where(mask, kl_estimator(behav, prox, kind), 0).sum()
        )
    if bool(mask.any()):
        gap = float((behav - prox).abs()[mask].max())
        acc["behave_logp_absdiff_max"] = max(acc["behave_logp_absdiff_max"], gap)
