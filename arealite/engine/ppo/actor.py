"""The PPO / GRPO policy: recomputed logprobs, advantages, and the decoupled PPO update.

Batch keys (padded [B, L] unless noted), as the rollout side produces them:
  input_ids, attention_mask, loss_mask (1 on generated tokens), logprobs (the server's
  behaviour logprobs, aligned with input_ids, 0 on the prompt), versions (weight version that
  generated each token, -1 on the prompt), rewards [B] (one score per sequence).
The algorithm adds: prox_logp (`compute_logp`, recomputed with the current weights), ref_logp
(a reference model's `compute_logp`), values (critic), advantages / returns / kl_rewards /
tot_rewards (`compute_advantages`).

Samples of one prompt (a GRPO group of `group_size`) are adjacent rows, and a group never
spans ranks. Every statistic reported is global over ranks.
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict

from arealite.api.cli_args import PPOActorConfig
from arealite.api.engine_api import TrainEngine
from arealite.engine.fsdp_engine import FSDPEngine
from arealite.engine.packing import packed_logprobs, target_mask
from arealite.engine.ppo.advantages import (
    compute_gae,
    dynamic_sampling_mask,
    group_normalize,
    normalize_advantages,
    overlong_penalty,
    shape_rewards,
)
from arealite.engine.ppo.losses import kl_estimator, ppo_actor_loss_fn
from arealite.engine.ppo.masked_stats import masked_mean
from arealite.engine.ppo.update_stats import (
    accumulate,
    accumulate_behaviour_gap,
    batch_stats,
    new_accumulator,
    update_stats,
)
from arealite.utils import distributed as du
from arealite.utils.data import split_padded_tensor_dict


class PPOActor:
    """PPO math around any TrainEngine whose micro-batches are packed dicts (see BaseHFEngine).

    `max_response_len` (the rollout's max_new_tokens) is needed only for the DAPO overlong
    penalty.
    """

    def __init__(
        self, config: PPOActorConfig, engine: TrainEngine, max_response_len: int | None = None
    ):
        self.config = config
        self.engine = engine
        self.max_response_len = max_response_len or getattr(config, "max_new_tokens", None)

    # -- logprobs ----------------------------------------------------------------------------

    @torch.no_grad()
    def compute_logp(self, data: TensorDict, temperature: float | None = None) -> torch.Tensor:
        """Logprobs [B, L] of the batch's tokens under the current weights at the sampling
        temperature, aligned with input_ids (0 at position 0 and on padding)."""
        t = self.config.temperature if temperature is None else temperature

        def hook(logits, mb):
            return packed_logprobs(logits, mb["input_ids"], mb["cu_seqlens"], t)

        self.engine.eval()
        out = self.engine.forward(data, post_hook=hook)
        return None if out is None else out.float().cpu()

    # -- advantages --------------------------------------------------------------------------

    @torch.no_grad()
    def compute_advantages(self, data: TensorDict) -> dict[str, float]:
        """Sequence rewards -> token advantages, in place (adds advantages, returns,
        kl_rewards, tot_rewards, seq_rewards; with dynamic_sampling, zeroes loss_mask of
        groups whose rewards are all equal). Returns global statistics.

        rewards: shape (bias, scale, clip) -> DAPO overlong penalty -> zero if truncated
        (mask_no_eos_with_zero) -> group normalisation (GRPO / Dr.GRPO / RLOO / none) ->
        per-token KL penalty vs the reference (kl_ctl) with the sequence reward added at the
        last generated token -> GAE (critic values when present, else V = 0: REINFORCE) ->
        optional token-level advantage whitening.
        """
        cfg = self.config
        error = None
        try:
            rewards = _check_rewards(data)
        except (KeyError, ValueError) as e:
            error = e
        du.raise_if_any_rank_failed(error)  # later steps are collectives
        loss_mask = data["loss_mask"].bool() & data["attention_mask"].bool()
        raw = rewards
        stats = {"reward_raw": masked_mean(rewards, None, all_reduce=True).item()}
        rewards = self._shape_rewards(data, rewards, loss_mask)
        if cfg.dynamic_sampling:
            keep = dynamic_sampling_mask(raw, cfg.group_size).repeat_interleave(cfg.group_size)
            loss_mask &= keep[:, None]
            data["loss_mask"] = loss_mask.to(data["loss_mask"].dtype)
            stats["dynamic_sampling_kept_frac"] = keep.float().mean().item()
        rewards = group_normalize(
            rewards,
            cfg.group_size,
            cfg.group_reward_mean_level,
            cfg.group_reward_std_level,
            leave_one_out=cfg.leave_one_out,
        )

        kl_rewards = self._kl_rewards(data, loss_mask)
        tot_rewards = kl_rewards.clone()
        rows = loss_mask.any(1).nonzero().flatten()
        last = _last_true(loss_mask)[rows]
        tot_rewards[rows, last] += rewards[rows].to(tot_rewards.dtype)

        values = data["values"].float() if "values" in data.keys() else None
        adv, returns = compute_gae(tot_rewards, values, loss_mask, cfg.discount, cfg.gae_lambda)
        if cfg.adv_norm_mean_level != "none" or cfg.adv_norm_std_level != "none":
            adv = normalize_advantages(
                adv, loss_mask, cfg.adv_norm_mean_level, cfg.adv_norm_std_level
            )
        data["seq_rewards"] = rewards.float()
        data["kl_rewards"], data["tot_rewards"] = kl_rewards, tot_rewards
        data["advantages"], data["returns"] = adv.float(), returns.float()
        stats["advantages"] = masked_mean(adv, loss_mask, all_reduce=True).item()
        stats["kl_reward"] = masked_mean(kl_rewards, loss_mask, all_reduce=True).item()
        return stats

    def _shape_rewards(
        self, data: TensorDict, rewards: torch.Tensor, loss_mask: torch.Tensor
    ) -> torch.Tensor:
        """Scale / bias / clip, then the DAPO overlong penalty, then 0 for truncated answers."""
        cfg = self.config
        rewards = shape_rewards(rewards, cfg.reward_scaling, cfg.reward_bias, cfg.reward_clip)
        if cfg.overlong_reward_penalty:
            if not self.max_response_len:
                raise ValueError(
                    "actor.overlong_reward_penalty needs the rollout's max_new_tokens: pass "
                    "max_response_len= to the actor"
                )
            rewards = overlong_penalty(
                rewards,
                loss_mask.sum(1),
                self.max_response_len,
                cfg.overlong_tokens,
                cfg.overlong_penalty_factor,
            )
        if cfg.mask_no_eos_with_zero:
            rewards = torch.where(self._no_eos(data), 0.0, rewards)
        return rewards

    def _no_eos(self, data: TensorDict) -> torch.Tensor:
        """True for truncated sequences: `seq_no_eos_mask` from the rollout if given, else
        the last real token is not an EOS id of the model."""
        if "seq_no_eos_mask" in data.keys():
            return data["seq_no_eos_mask"].bool()
        eos = torch.tensor(getattr(self.engine, "eos_token_ids", []), dtype=torch.long)
        if eos.numel() == 0:
            raise ValueError("mask_no_eos_with_zero: no 'seq_no_eos_mask' and no EOS id known")
        last = data["input_ids"].gather(1, _last_true(data["attention_mask"].bool())[:, None])
        return ~torch.isin(last[:, 0], eos)

    def _kl_rewards(self, data: TensorDict, loss_mask: torch.Tensor) -> torch.Tensor:
        """-kl_ctl * KL(pi || pi_ref) per generated token (0 without a KL term)."""
        zeros = torch.zeros(loss_mask.shape, dtype=torch.float32)
        if self.config.kl_ctl == 0:
            return zeros
        if "ref_logp" not in data.keys():
            raise KeyError(
                "actor.kl_ctl > 0 needs 'ref_logp' in the batch: batch['ref_logp'] = "
                "ref.compute_logp(batch)"
            )
        if "prox_logp" not in data.keys() and self._needs_prox():
            data["prox_logp"] = self.compute_logp(data)  # the KL is of the proximal policy
        logp = data["prox_logp"] if "prox_logp" in data.keys() else data["logprobs"]
        kl = kl_estimator(logp.float(), data["ref_logp"].float(), self.config.kl_estimator)
        return torch.where(loss_mask, -self.config.kl_ctl * kl, zeros)

    # -- update ------------------------------------------------------------------------------

    def ppo_update(self, data: TensorDict) -> dict[str, float]:
        """`ppo_n_minibatches` optimizer steps over the batch with the (decoupled) PPO loss.

        Standard PPO: old = recomputed `prox_logp` (or the server's `logprobs` when
        recompute_logprob=false). Decoupled PPO: old = behaviour `logprobs`, proximal =
        `prox_logp`; the behaviour importance weight corrects for stale rollouts.

        `prox_logp` need not be in the batch. With one minibatch the proximal policy is the
        current weights before the step, i.e. the training forward's own logprobs, detached:
        they are used directly (bit-identical loss, one forward pass saved). With more
        minibatches they are recomputed here with `compute_logp` before the first step.
        """
        cfg = self.config
        needs_prox = self._needs_prox()
        missing = [k for k in ("loss_mask", "advantages", "logprobs") if k not in data.keys()]
        error = None
        if missing:
            hint = {"advantages": "call actor.compute_advantages(batch) first"}.get(
                missing[0], "the rollout must provide it"
            )
            error = KeyError(f"ppo_update: batch has no {missing[0]!r} ({hint})")
        du.raise_if_any_rank_failed(error)
        n_seqs = du.all_reduce_sum([float(data.batch_size[0])])[0]
        data = rows_with_loss(data, min_rows=cfg.ppo_n_minibatches)
        fuse_prox = needs_prox and "prox_logp" not in data.keys()
        if fuse_prox and cfg.ppo_n_minibatches > 1:
            data["prox_logp"] = self.compute_logp(data)
            fuse_prox = False
        stats = batch_stats(data, self.engine.get_version())  # over loss tokens: none dropped
        stats["trained_seqs_frac"] = stats["n_seqs"] / max(n_seqs, 1.0)
        stats["n_seqs"] = n_seqs
        acc = new_accumulator()
        loss_fn = self._make_loss_fn(acc, fuse_prox)
        step_stats = []
        self.engine.train()
        for mb in split_padded_tensor_dict(data, cfg.ppo_n_minibatches):
            step_stats.append(self.engine.train_batch(mb, loss_fn, _n_targets))
        stats.update(update_stats(acc, step_stats, fuse_prox))
        return stats

    def _needs_prox(self) -> bool:
        return self.config.use_decoupled_loss or self.config.recompute_logprob

    def _make_loss_fn(self, acc: dict[str, float], fuse_prox: bool):
        cfg = self.config

        def loss_fn(logits: torch.Tensor, mb: dict[str, Any]) -> torch.Tensor:
            cu = mb["cu_seqlens"]
            logp, entropy = packed_logprobs(logits, mb["input_ids"], cu, cfg.temperature, True)
            mask = target_mask(mb)
            prox = logp.detach() if fuse_prox else mb.get("prox_logp")
            if cfg.use_decoupled_loss:
                old = mb["logprobs"]
            else:
                old, prox = (prox if cfg.recompute_logprob else mb["logprobs"]), None
            loss, st = ppo_actor_loss_fn(
                logp,
                old.float(),
                mb["advantages"].float(),
                cfg.eps_clip,
                mask,
                eps_clip_higher=cfg.eps_clip_higher,
                c_clip=cfg.c_clip,
                proximal_logprobs=None if prox is None else prox.float(),
                behav_imp_weight_cap=cfg.behav_imp_weight_cap,
                importance_sampling_level=cfg.importance_sampling_level,
                cu_seqlens=cu,
            )
            accumulate(acc, st, mask, entropy)
            if fuse_prox:
                accumulate_behaviour_gap(acc, mb["logprobs"].float(), logp.detach(), mask)
            return loss

        return loss_fn


def rows_with_loss(data: TensorDict, min_rows: int = 1) -> TensorDict:
    """The batch less its rows without a loss token (groups dynamic sampling zeroed, accepted
    past its over-sampling cap): the loss is normalised by loss tokens, so the update is the
    same, for a forward and backward over fewer rows. At least `min_rows` rows stay (one per
    PPO minibatch; zero-loss ones if need be) and row order is kept."""
    has_loss = (data["loss_mask"].bool() & data["attention_mask"].bool()).any(1)
    n_keep = max(int(has_loss.sum()), min(min_rows, data.batch_size[0]))
    if n_keep == data.batch_size[0]:
        return data
    first = torch.argsort((~has_loss).to(torch.int8), stable=True)[:n_keep]
    return data[first.sort().values]


def _n_targets(mb: dict[str, Any]) -> float:
    return float(target_mask(mb).sum())


def _last_true(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last True per row of a [B, L] bool mask (0 for an all-False row)."""
    L = mask.shape[1]
    idx = torch.arange(L).expand_as(mask)
    return torch.where(mask, idx, -1).max(1).values.clamp(min=0)


def _check_rewards(data: TensorDict) -> torch.Tensor:
    for key in ("rewards", "loss_mask", "attention_mask", "input_ids"):
        if key not in data.keys():
            raise KeyError(
                f"compute_advantages: batch has no {key!r} (keys: {sorted(data.keys())})"
            )
    r = data["rewards"]
    if r.ndim != 1:
        raise ValueError(f"rewards must be one score per sequence [B], got shape {tuple(r.shape)}")
    bad = (~torch.isfinite(r.float())).nonzero().flatten().tolist()
    if bad:
        raise ValueError(f"rewards has non-finite values (NaN/inf) at rows {bad[:8]}")
    return r.float()


class FSDPPPOActor(FSDPEngine):
    """An FSDPEngine that is a PPO actor. With `config.optimizer=None` it is a forward-only
    reference model: `ref.compute_logp(batch)`."""

    def __init__(self, config: PPOActorConfig, max_response_len: int | None = None):
        super().__init__(config)
        self.actor = PPOActor(config, self, max_response_len)

    def compute_logp(self, data: TensorDict, temperature: float | None = None) -> torch.Tensor:
        return self.actor.compute_logp(data, temperature)

    def compute_advantages(self, data: TensorDict) -> dict[str, float]:
        return self.actor.compute_advantages(data)

    def ppo_update(self, data: TensorDict) -> dict[str, float]:
        return self.actor.ppo_update(data)
