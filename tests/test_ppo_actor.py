"""PPO actor / critic / reference on the tiny model: advantages by hand, update direction."""

from __future__ import annotations

import statistics

import pytest
import torch
from _torchrun_fsdp import VOCAB, engine_config

from arealite.api.cli_args import ACTOR_PRESETS, OptimizerConfig, PPOActorConfig, PPOCriticConfig
from arealite.engine.ppo.actor import FSDPPPOActor, rows_with_loss
from arealite.engine.ppo.critic import FSDPPPOCritic
from arealite.utils.data import pad_sequences_to_tensors

EPS = 1e-5  # group_normalize's epsilon


def rl_batch(rewards, prompt_len=3, gen_lens=None, seed=0):
    """Rollout-shaped batch: prompt + generated tokens, behaviour logprobs 0 (filled later)."""
    g = torch.Generator().manual_seed(seed)
    gen_lens = gen_lens or [4 + i % 3 for i in range(len(rewards))]
    rows = []
    for r, n in zip(rewards, gen_lens):
        rows.append(
            {
                "input_ids": torch.randint(0, VOCAB, (prompt_len + n,), generator=g),
                "loss_mask": torch.tensor([0] * prompt_len + [1] * n),
                "logprobs": torch.zeros(prompt_len + n),
                "versions": torch.tensor([-1] * prompt_len + [0] * n),
                "rewards": torch.tensor(float(r)),
            }
        )
    return pad_sequences_to_tensors(rows)


def actor_config(model_dir, **kw) -> PPOActorConfig:
    base = engine_config(model_dir, 48)
    opt = kw.pop("optimizer", OptimizerConfig(lr=1e-3, eps=1e-6))
    fields = {k: getattr(base, k) for k in ("path", "fsdp", "mb_spec")}
    return PPOActorConfig(**fields, optimizer=opt, **kw)


@pytest.fixture
def make_actor(tiny_model_dir, build_engine):
    def make(cls=FSDPPPOActor, config=None, **kw):
        return build_engine(cls, config or actor_config(tiny_model_dir, **kw))

    return make


def group_adv(rewards, group_size):
    """GRPO by hand: (r - group mean) / (unbiased group std + eps)."""
    out = []
    for i in range(0, len(rewards), group_size):
        g = rewards[i : i + group_size]
        mu, sd = statistics.mean(g), statistics.stdev(g)
        out += [(r - mu) / (sd + EPS) for r in g]
    return out


# --------------------------------------------------------------------------- advantages


def test_grpo_advantages_match_hand_computation(make_actor):
    rewards = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.5, 0.0]
    actor = make_actor(group_size=4, **ACTOR_PRESETS["grpo"])
    batch = rl_batch(rewards)
    actor.compute_advantages(batch)
    expected = group_adv(rewards, 4)
    mask = batch["loss_mask"].bool()
    for i, a in enumerate(expected):
        # REINFORCE (gamma = lambda = 1, V = 0): every generated token carries the reward
        torch.testing.assert_close(
            batch["advantages"][i][mask[i]], torch.full((int(mask[i].sum()),), a)
        )
        assert bool((batch["advantages"][i][~mask[i]] == 0).all())


def test_kl_penalty_and_discount_by_hand(make_actor):
    actor = make_actor(group_size=2, kl_ctl=0.5, discount=0.9, gae_lambda=1.0)
    batch = rl_batch([1.0, 0.0], gen_lens=[3, 3])
    batch["prox_logp"] = -torch.rand(batch["input_ids"].shape) * batch["loss_mask"]
    batch["ref_logp"] = -torch.rand(batch["input_ids"].shape) * batch["loss_mask"]
    actor.compute_advantages(batch)
    seq_adv = group_adv([1.0, 0.0], 2)
    for i in range(2):
        kl = (batch["prox_logp"][i] - batch["ref_logp"][i])[3:6]  # k1 estimator
        r = (-0.5 * kl).tolist()
        r[-1] += seq_adv[i]
        expected, run = [], 0.0
        for x in reversed(r):  # A_t = sum_s gamma^(s-t) r_s
            run = x + 0.9 * run
            expected.insert(0, run)
        torch.testing.assert_close(
            batch["advantages"][i][3:6], torch.tensor(expected), atol=1e-5, rtol=0
        )


def test_reward_pipeline_options(make_actor):
    actor = make_actor(
        group_size=2,
        group_reward_std_level="none",
        mask_no_eos_with_zero=True,
        dynamic_sampling=True,
    )
    batch = rl_batch([1.0, 0.0, 1.0, 1.0])
    last = batch["attention_mask"].sum(1) - 1
    batch["input_ids"][torch.arange(4), last] = 5  # not EOS: truncated
    batch["input_ids"][0, last[0]] = actor.eos_token_ids[0]  # row 0 ends with EOS
    stats = actor.compute_advantages(batch)
    # rows 1-3 are truncated -> reward 0; group 2 (rows 2, 3) is then all-equal and dropped
    assert stats["dynamic_sampling_kept_frac"] == 0.5
    assert batch["loss_mask"][2:].sum() == 0 and batch["loss_mask"][:2].sum() > 0
    assert batch["seq_rewards"][:2].tolist() == [0.5, -0.5]  # Dr.GRPO: mean only

    dapo = make_actor(group_size=2, **ACTOR_PRESETS["dapo"])
    with pytest.raises(ValueError, match="max_response_len"):
        dapo.compute_advantages(rl_batch([1.0, 0.0]))
    dapo.actor.max_response_len = 8
    dapo.actor.config.overlong_tokens = 4  # penalty ramps from 4 to 8 generated tokens
    b = rl_batch([1.0, 1.0], gen_lens=[4, 8])
    dapo.compute_advantages(b)
    assert b["seq_rewards"][0] > b["seq_rewards"][1]  # the overlong answer is penalised


def test_bad_rewards_are_rejected(make_actor):
    actor = make_actor(group_size=2)
    batch = rl_batch([1.0, float("nan")])
    with pytest.raises(ValueError, match="rewards"):
        actor.compute_advantages(batch)
    with pytest.raises(KeyError, match="rewards"):
        actor.compute_advantages(rl_batch([1.0, 0.0]).exclude("rewards"))
    with pytest.raises(KeyError, match="advantages"):
        actor.ppo_update(rl_batch([1.0, 0.0]))


# --------------------------------------------------------------------------- update


def seq_logp(actor, batch):
    return (actor.compute_logp(batch) * batch["loss_mask"]).sum(1)


@pytest.mark.parametrize("decoupled", [False, True])
def test_ppo_update_follows_the_advantages(make_actor, decoupled):
    rewards = [1.0, 0.0, 0.0, 1.0, 1.0, 0.0]
    actor = make_actor(
        group_size=2, ppo_n_minibatches=2, use_decoupled_loss=decoupled, temperature=1.0
    )
    batch = rl_batch(rewards, seed=4)
    prox = actor.compute_logp(batch)
    batch["prox_logp"] = prox
    # behaviour logprobs: on-policy, or slightly stale for the decoupled loss
    batch["logprobs"] = (prox - 0.05 * decoupled) * batch["loss_mask"]
    actor.compute_advantages(batch)
    actor.set_version(1)
    before = seq_logp(actor, batch)
    stats = actor.ppo_update(batch)
    after = seq_logp(actor, batch)
    up = torch.tensor(rewards) > 0.5
    assert bool((after[up] > before[up]).all()) and bool((after[~up] < before[~up]).all())
    assert stats["update_successful"] == 1.0 and stats["n_minibatches"] == 2
    assert stats["n_seqs"] == 6 and stats["n_tokens"] == batch["loss_mask"].sum()
    assert stats["staleness"] == 1.0 and stats["entropy"] > 0
    assert stats["importance_weight"] == pytest.approx(1.0, abs=0.05)
    if decoupled:
        assert stats["behave_kl_k1"] == pytest.approx(-0.05, abs=1e-4)
        assert stats["behave_imp_weight"] == pytest.approx(
            float(torch.exp(torch.tensor(0.05))), abs=1e-4
        )
    else:
        assert stats["behave_kl_k1"] == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("decoupled", [False, True])
def test_one_minibatch_reuses_the_training_forward_as_proximal_policy(make_actor, decoupled):
    """With one minibatch, ppo_update without prox_logp (proximal logprobs taken, detached, from
    its own training forward) equals the explicit recompute: same loss, stats and weights."""
    kw = dict(group_size=2, use_decoupled_loss=decoupled, behav_imp_weight_cap=5.0)
    explicit, fused = make_actor(**kw), make_actor(**kw)
    batch = rl_batch([1.0, 0.0, 0.0, 1.0, 1.0, 0.0], seed=5)
    batch["logprobs"] = (explicit.compute_logp(batch) - 0.1) * batch["loss_mask"]
    explicit.compute_advantages(batch)
    fused_batch = batch.clone()
    batch["prox_logp"] = explicit.compute_logp(batch)
    want, got = explicit.ppo_update(batch), fused.ppo_update(fused_batch)
    assert "prox_logp" not in fused_batch.keys()  # no separate forward ran
    assert got["loss"] == want["loss"] and got["grad_norm"] == want["grad_norm"]
    for key in ("behave_kl_k1", "behave_kl_k3", "behave_imp_weight", "importance_weight"):
        assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-7), key
    for a, b in zip(explicit.model.parameters(), fused.model.parameters()):
        assert torch.equal(a.full_tensor(), b.full_tensor())


def test_several_minibatches_recompute_the_proximal_policy_first(make_actor):
    """With n minibatches the proximal policy must be the weights before the first step: the
    actor recomputes prox_logp itself when the batch lacks it."""
    actor = make_actor(group_size=2, ppo_n_minibatches=2, use_decoupled_loss=True)
    batch = rl_batch([1.0, 0.0, 0.0, 1.0], seed=6)
    batch["logprobs"] = actor.compute_logp(batch) * batch["loss_mask"]
    before = actor.compute_logp(batch)
    actor.compute_advantages(batch)
    stats = actor.ppo_update(batch)
    torch.testing.assert_close(batch["prox_logp"], before, rtol=0, atol=0)
    assert stats["n_minibatches"] == 2 and stats["behave_kl_k1"] == pytest.approx(0, abs=1e-6)


def test_rows_without_loss_tokens_are_left_out_of_the_update(make_actor):
    """Groups dynamic sampling zeroed cost no forward or backward: the update equals the one on
    the batch without them (the loss is normalised by loss tokens)."""
    kw = dict(group_size=2, dynamic_sampling=True, use_decoupled_loss=True)
    full_actor, kept_actor = make_actor(**kw), make_actor(**kw)
    full = rl_batch([1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0], seed=7)
    full["logprobs"] = (full_actor.compute_logp(full) - 0.05) * full["loss_mask"]
    kept = full[torch.tensor([0, 1, 4, 5])].clone()
    full_actor.compute_advantages(full)
    kept_actor.compute_advantages(kept)
    full_actor.set_version(1), kept_actor.set_version(1)
    got, want = full_actor.ppo_update(full), kept_actor.ppo_update(kept)
    assert got["trained_seqs_frac"] == 0.5 and want["trained_seqs_frac"] == 1.0
    assert got["n_seqs"] == 8 and got["n_tokens"] == want["n_tokens"]
    for key in ("loss", "grad_norm", "behave_kl_k1", "staleness", "entropy"):
        assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-7), key
    for a, b in zip(full_actor.model.parameters(), kept_actor.model.parameters()):
        torch.testing.assert_close(a.full_tensor(), b.full_tensor(), rtol=1e-6, atol=1e-7)


def test_rows_with_loss_keeps_order_and_a_floor():
    batch = rl_batch([1.0] * 5)
    batch["loss_mask"][torch.tensor([0, 2, 3])] = 0
    assert rows_with_loss(batch)["input_ids"].tolist() == batch["input_ids"][[1, 4]].tolist()
    assert rows_with_loss(batch, min_rows=3)["input_ids"].tolist() == (
        batch["input_ids"][[0, 1, 4]].tolist()  # zero-loss rows in order fill the floor
    )
    batch["loss_mask"][:] = 0
    assert rows_with_loss(batch, min_rows=2).batch_size[0] == 2
    full = rl_batch([1.0, 0.0])
    assert rows_with_loss(full) is full


def test_reference_and_critic(make_actor, tiny_model_dir):
    actor = make_actor(group_size=2)
    ref = make_actor(config=actor_config(tiny_model_dir, optimizer=None))
    batch = rl_batch([1.0, 0.0, 1.0, 0.0])
    batch["prox_logp"] = actor.compute_logp(batch)
    torch.testing.assert_close(ref.compute_logp(batch), batch["prox_logp"])

    base = engine_config(tiny_model_dir, 48)
    ccfg = PPOCriticConfig(
        path=base.path, fsdp=base.fsdp, mb_spec=base.mb_spec, optimizer=OptimizerConfig(lr=5e-3)
    )
    critic = make_actor(cls=FSDPPPOCritic, config=ccfg)
    values = critic.compute_values(batch)
    assert values.shape == batch["input_ids"].shape and bool((values[:, 0] == 0).all())
    batch["values"] = values
    actor.compute_advantages(batch)  # GAE with the critic's values
    mask = batch["loss_mask"].bool()
    # gamma = lambda = 1: returns = A + V = the sequence's (normalised) reward at every step
    torch.testing.assert_close(
        batch["returns"][mask], (batch["advantages"] + values)[mask], atol=1e-5, rtol=0
    )
    err = lambda v: ((v - batch["returns"])[mask] ** 2).mean()  # noqa: E731
    first = err(values)
    for _ in range(3):
        stats = critic.ppo_update(batch)
        batch["values"] = critic.compute_values(batch)
    assert err(batch["values"]) < 0.5 * first and stats["update_successful"] == 1.0
    with pytest.raises(RuntimeError, match="no optimizer"):
        ref.ppo_update(batch)  # a reference model is forward-only
