"""The decoupled PPO loss keeps a stale replay's update near the proximal policy; naive PPO not.

Staleness is made artificial and large: the behaviour logprobs of a fixed batch are the current
policy's shifted by +-0.7 per token (behaviour / proximal ratio 2 or 1/2, as after many versions;
inside the cap 5, so no token is masked), and the batch is replayed for several optimizer steps
with the proximal logprobs fixed (PPO epochs). Naive PPO (old = behaviour) centres its clip on the
behaviour policy, so a token whose behaviour ratio starts at 1/2 may move its current / proximal
ratio up to 1.2 / 0.5 before the clip stops it; the decoupled loss clips current / proximal at
1 +- 0.2 for every token. The measure is the largest |log(new / proximal)| over generated tokens.
"""

from __future__ import annotations

import pytest
import torch
from test_ppo_actor import actor_config, rl_batch

from arealite.api.cli_args import OptimizerConfig
from arealite.engine.ppo.actor import FSDPPPOActor

REWARDS = [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0] * 2  # 4 groups of 4
STALE_GAP = 0.7  # |log behaviour - log proximal| per token
EPOCHS = 8  # optimizer steps on the one replayed batch
LR = 2e-5  # small enough that one step stays inside the clip (max |log ratio| ~0.2 after one)


def max_log_ratio_after_replay(build_engine, model_dir: str, decoupled: bool, seed: int) -> float:
    """max |log pi_new - log pi_prox| over generated tokens after EPOCHS steps on the batch."""
    cfg = actor_config(
        model_dir,
        group_size=4,
        use_decoupled_loss=decoupled,
        recompute_logprob=decoupled,
        behav_imp_weight_cap=5.0,
        eps_clip=0.2,
        temperature=1.0,
        optimizer=OptimizerConfig(lr=LR, eps=1e-6, weight_decay=0.0),
    )
    actor = build_engine(FSDPPPOActor, cfg)
    batch = rl_batch(REWARDS, gen_lens=[6] * len(REWARDS), seed=seed)
    mask = batch["loss_mask"].bool()
    sign = torch.randint(0, 2, mask.shape, generator=torch.Generator().manual_seed(seed)) * 2 - 1
    prox = actor.compute_logp(batch)
    batch["prox_logp"] = prox  # fixed over the epochs: the policy before the replay
    batch["logprobs"] = (prox - STALE_GAP * sign) * batch["loss_mask"]
    actor.compute_advantages(batch)
    for _ in range(EPOCHS):
        stats = actor.ppo_update(batch)
    if decoupled:  # the stale gap is what the actor measures, and nothing was capped
        assert stats["behave_kl_k3"] > 0.1 and stats["behave_mask_ratio"] == 1.0
    return float((actor.compute_logp(batch) - prox)[mask].abs().max())


@pytest.mark.integration  # a multi-second run: not in `make test-fast`
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_decoupled_loss_stays_near_the_proximal_policy(tiny_model_dir, build_engine, seed):
    decoupled = max_log_ratio_after_replay(build_engine, tiny_model_dir, True, seed)
    naive = max_log_ratio_after_replay(build_engine, tiny_model_dir, False, seed)
    # Measured (seeds 1-3, 2-core CPU): decoupled 0.60-0.70, naive 1.08-1.25, gap 0.48-0.55,
    # decoupled / naive 0.54-0.56; with the loss's proximal_logprobs dropped: gap 0.00, 1.00.
    # Neither is a hard bound (Adam's momentum and shared weights move clipped tokens too), but
    # naive PPO's worst token moves ~1.8x as far. Without the proximal policy in the loss
    # (ratio taken to the behaviour logprobs) the decoupled run is the naive one: gap ~0.
    assert naive - decoupled > 0.25, (decoupled, naive)
    assert decoupled < 0.8 * naive, (decoupled, naive)
