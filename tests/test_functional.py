"""arealite.engine.ppo.advantages / losses against slow per-token Python references (float64, 1e-6).

Run as a script under torchrun this file is also the 2-rank worker of the distributed test.
"""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch
from _launch import torchrun
from hypothesis import given, settings
from hypothesis import strategies as st

from arealite.engine.logprobs import gather_logprobs, gather_logprobs_entropy
from arealite.engine.ppo.advantages import (
    compute_gae,
    compute_gae_packed,
    dynamic_sampling_mask,
    group_normalize,
    normalize_advantages,
    overlong_penalty,
    shape_rewards,
)
from arealite.engine.ppo.losses import kl_estimator, ppo_actor_loss_fn, ppo_critic_loss_fn
from arealite.engine.ppo.masked_stats import (
    masked_mean,
    masked_normalization,
    masked_sum,
    masked_var,
    sequence_masked_mean,
)

F64 = torch.float64
TOL = dict(atol=1e-6, rtol=1e-6)
HYP = settings(max_examples=25, deadline=None)


def close(a, b):
    torch.testing.assert_close(torch.as_tensor(a, dtype=F64), torch.as_tensor(b, dtype=F64), **TOL)


def random_masks(b: int, n: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Several [B, L] masks: full, random with an all-zero row, right-padded, and empty."""
    rand = torch.rand(b, n, generator=gen) > 0.4
    rand[1] = False
    lens = torch.randint(0, n + 1, (b,), generator=gen)
    lens[0] = 0
    right_padded = torch.arange(n)[None, :] < lens[:, None]
    return [
        torch.ones(b, n, dtype=torch.bool),
        rand,
        right_padded,
        torch.zeros(b, n, dtype=torch.bool),
    ]


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(0)


# ----------------------------------------------------------------------------------------------
# gather_logprobs / entropy
# ----------------------------------------------------------------------------------------------


def ref_logprob_entropy(logits, labels, temperature):
    """Per token: z = logits / T, log p_y = z_y - log sum exp z, H = -sum p log p."""
    flat, flat_y = logits.reshape(-1, logits.shape[-1]).tolist(), labels.reshape(-1).tolist()
    logps, ents = [], []
    for row, y in zip(flat, flat_y):
        z = [v / temperature for v in row]
        zmax = max(z)
        lse = zmax + math.log(sum(math.exp(v - zmax) for v in z))
        logps.append(z[y] - lse)
        ents.append(-sum(math.exp(v - lse) * (v - lse) for v in z))
    shape = labels.shape
    return torch.tensor(logps, dtype=F64).view(shape), torch.tensor(ents, dtype=F64).view(shape)


@pytest.mark.parametrize("shape", [(13,), (3, 5)])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("chunk_size", [1, 4, 1024])
def test_gather_logprobs_matches_reference(shape, temperature, chunk_size, gen):
    logits = torch.randn(*shape, 17, generator=gen, dtype=F64) * 3
    labels = torch.randint(0, 17, shape, generator=gen)
    ref_lp, ref_h = ref_logprob_entropy(logits, labels, temperature)
    close(gather_logprobs(logits, labels, temperature, chunk_size), ref_lp)
    lp, h = gather_logprobs_entropy(logits, labels, temperature, chunk_size)
    close(lp, ref_lp)
    close(h, ref_h)


def test_gather_logprobs_gradients_match_autograd(gen):
    """Chunked custom backward == autograd through a plain log_softmax, for both outputs."""
    logits = torch.randn(23, 19, generator=gen, dtype=F64, requires_grad=True)
    labels = torch.randint(0, 19, (23,), generator=gen)
    w_lp, w_h = torch.randn(23, generator=gen, dtype=F64), torch.randn(23, generator=gen, dtype=F64)

    logp_all = (logits / 0.8).log_softmax(-1)
    ref = (logp_all.gather(-1, labels[:, None])[:, 0] * w_lp).sum()
    ref = ref + (-(logp_all.exp() * logp_all).sum(-1) * w_h).sum()
    (g_ref,) = torch.autograd.grad(ref, logits, retain_graph=True)

    lp, h = gather_logprobs_entropy(logits, labels, 0.8, chunk_size=5)
    (g,) = torch.autograd.grad((lp * w_lp).sum() + (h * w_h).sum(), logits)
    close(g, g_ref)
    (g_lp,) = torch.autograd.grad((gather_logprobs(logits, labels, 0.8, 7) * w_lp).sum(), logits)
    (g_lp_ref,) = torch.autograd.grad(
        (logp_all.gather(-1, labels[:, None])[:, 0] * w_lp).sum(), logits
    )
    close(g_lp, g_lp_ref)
    assert torch.autograd.gradcheck(
        lambda x: gather_logprobs_entropy(x, labels[:6], 1.3, 4),
        (logits[:6].detach().requires_grad_(),),
    )


def _saved_tensors_numel(fn, logits):
    """Sizes of every tensor autograd saves for backward, ignoring those that alias `logits`."""
    sizes = []

    def pack(t):
        if t.untyped_storage().data_ptr() != logits.untyped_storage().data_ptr():
            sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(logits)
    return sizes


def test_gather_logprobs_never_saves_a_full_fp32_copy(gen):
    """bf16 logits [T, V]: nothing of size T*V is kept for backward besides the logits."""
    t, v = 512, 64
    logits = torch.randn(t, v, generator=gen).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, v, (t,), generator=gen)
    naive = _saved_tensors_numel(
        lambda x: x.float().log_softmax(-1).gather(-1, labels[:, None]), logits
    )
    assert max(naive) >= t * v  # the probe does see a full fp32 copy in the naive version
    for fn in (gather_logprobs, gather_logprobs_entropy):
        sizes = _saved_tensors_numel(lambda x, fn=fn: fn(x, labels, 1.0, chunk_size=64), logits)
        assert max(sizes, default=0) < t * v
    lp, h = gather_logprobs_entropy(logits, labels, chunk_size=64)
    (lp.sum() + h.sum()).backward()
    assert logits.grad.dtype == torch.bfloat16 and torch.isfinite(logits.grad).all()


def test_gather_logprobs_rejects_bad_input():
    with pytest.raises(ValueError, match="labels shape"):
        gather_logprobs(torch.zeros(3, 4, 5), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        gather_logprobs(torch.zeros(3, 5), torch.zeros(3, dtype=torch.long), temperature=0)
    with pytest.raises(ValueError, match="chunk_size"):
        gather_logprobs(torch.zeros(3, 5), torch.zeros(3, dtype=torch.long), chunk_size=0)


@HYP
@given(t=st.integers(1, 40), chunk=st.integers(1, 50), seed=st.integers(0, 1000))
def test_chunked_equals_unchunked(t, chunk, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, 9, generator=g, dtype=F64) * 4
    labels = torch.randint(0, 9, (t,), generator=g)
    lp, h = gather_logprobs_entropy(logits, labels, 0.9, chunk)
    lp_full, h_full = gather_logprobs_entropy(logits, labels, 0.9, 10_000)
    torch.testing.assert_close(lp, lp_full, atol=1e-12, rtol=0)
    torch.testing.assert_close(h, h_full, atol=1e-12, rtol=0)
    assert (lp <= 0).all() and (h >= -1e-12).all() and (h <= math.log(9) + 1e-12).all()


# ----------------------------------------------------------------------------------------------
# Masked statistics
# ----------------------------------------------------------------------------------------------


def selected(x, mask):
    return [v for v, m in zip(x.reshape(-1).tolist(), mask.reshape(-1).tolist()) if m]


def ref_mean(vals):
    return sum(vals) / len(vals) if vals else 0.0


def ref_var(vals, unbiased):
    n, ddof = len(vals), int(unbiased)
    if n <= ddof:
        return 0.0
    mu = ref_mean(vals)
    return sum((v - mu) ** 2 for v in vals) / (n - ddof)


def test_masked_stats_over_all_dims(gen):
    x = torch.randn(4, 6, generator=gen, dtype=F64) + 3
    for mask in random_masks(4, 6, gen):
        vals = selected(x, mask)
        close(masked_sum(x, mask), sum(vals))
        close(masked_mean(x, mask), ref_mean(vals))
        for unbiased in (False, True):
            close(masked_var(x, mask, unbiased=unbiased), ref_var(vals, unbiased))


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_masked_stats_along_a_dim(dim, gen):
    x = torch.randn(4, 6, generator=gen, dtype=F64)
    for mask in random_masks(4, 6, gen):
        xt, mt = (x, mask) if dim == 0 else (x.T, mask.T)
        cols = [selected(xt[:, j], mt[:, j]) for j in range(xt.shape[1])]
        close(masked_sum(x, mask, dim), [sum(c) for c in cols])
        close(masked_mean(x, mask, dim), [ref_mean(c) for c in cols])
        close(masked_mean(x, mask, dim, keepdim=True).squeeze(dim), [ref_mean(c) for c in cols])
        close(masked_var(x, mask, dim, unbiased=True), [ref_var(c, True) for c in cols])


def test_masked_sum_ignores_nan_under_the_mask():
    x = torch.tensor([1.0, float("nan"), 2.0, float("inf")], dtype=F64)
    mask = torch.tensor([1, 0, 1, 0])
    close(masked_sum(x, mask), 3.0)
    close(masked_mean(x, mask), 1.5)
    close(masked_var(x, mask), 0.25)


@pytest.mark.parametrize("unbiased", [False, True])
def test_masked_normalization_matches_reference(unbiased, gen):
    x = torch.randn(5, 7, generator=gen, dtype=F64) * 2 + 1
    for mask in random_masks(5, 7, gen):
        out = masked_normalization(x, mask, unbiased=unbiased, eps=1e-5)
        vals = selected(x, mask)
        mu, sd = ref_mean(vals), math.sqrt(ref_var(vals, unbiased))
        for i in range(5):
            for j in range(7):
                expect = (x[i, j].item() - mu) / (sd + 1e-5) if mask[i, j] else 0.0
                assert abs(out[i, j].item() - expect) < 1e-6
        # along dim 1: each row normalised on its own
        out_rows = masked_normalization(x, mask, dim=1, unbiased=unbiased)
        for i in range(5):
            vals = selected(x[i], mask[i])
            mu, sd = ref_mean(vals), math.sqrt(ref_var(vals, unbiased))
            expect = [(v - mu) / (sd + 1e-5) if m else 0.0 for v, m in zip(x[i].tolist(), mask[i])]
            close(out_rows[i], expect)


def test_masked_normalization_keeps_dtype_and_large_offsets():
    x = torch.tensor([1e6 + 1, 1e6 + 2, 1e6 + 3], dtype=torch.float32)
    out = masked_normalization(x, None)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.tensor([-1.2247, 0.0, 1.2247]), atol=1e-3, rtol=0)


def test_mask_shape_error():
    with pytest.raises(ValueError, match="does not broadcast"):
        masked_mean(torch.zeros(3, 4), torch.ones(5, dtype=torch.bool))


@HYP
@given(
    n=st.integers(2, 30),
    shift=st.floats(-100, 100),
    scale=st.floats(0.1, 10),
    seed=st.integers(0, 999),
)
def test_masked_normalization_properties(n, shift, scale, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=F64)
    mask = torch.rand(n, generator=g) > 0.3
    mask[:2] = True
    out = masked_normalization(x, mask, eps=0.0)
    assert abs(masked_mean(out, mask).item()) < 1e-9
    if masked_var(x, mask).item() > 1e-6:
        assert abs(masked_var(out, mask).item() - 1) < 1e-9
        close(masked_normalization(x * scale + shift, mask, eps=0.0), out)


def test_sequence_masked_mean(gen):
    x = torch.randn(11, generator=gen, dtype=F64)
    mask = torch.rand(11, generator=gen) > 0.3
    cu = torch.tensor([0, 3, 3, 8, 11])
    ref = [ref_mean(selected(x[a:b], mask[a:b])) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]
    close(sequence_masked_mean(x, mask, cu), ref)
    x2 = torch.randn(3, 4, generator=gen, dtype=F64)
    m2 = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 1, 1]])
    close(sequence_masked_mean(x2, m2), [ref_mean(selected(x2[i], m2[i])) for i in range(3)])
    with pytest.raises(ValueError, match="cu_seqlens"):
        sequence_masked_mean(x, mask, torch.tensor([0, 3, 12]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        sequence_masked_mean(x, mask)


# ----------------------------------------------------------------------------------------------
# KL estimators
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_estimators_match_formulas(kind, gen):
    lp = torch.randn(3, 8, generator=gen, dtype=F64)
    ref_lp = torch.randn(3, 8, generator=gen, dtype=F64)
    out = kl_estimator(lp, ref_lp, kind, clamp=None)
    for a, b, o in zip(
        lp.reshape(-1).tolist(), ref_lp.reshape(-1).tolist(), out.reshape(-1).tolist()
    ):
        lr = a - b
        expect = {"k1": lr, "k2": 0.5 * lr * lr, "k3": math.exp(-lr) - 1 + lr}[kind]
        assert abs(o - expect) < 1e-9


def test_kl_estimator_clamp_and_unbiasedness():
    lp = torch.tensor([0.0, 50.0, -50.0], dtype=F64, requires_grad=True)
    ref = torch.zeros(3, dtype=F64)
    for kind in ("k1", "k2", "k3"):
        out = kl_estimator(lp, ref, kind, clamp=10.0)
        assert torch.isfinite(out).all() and out.abs().max() <= 10.0
        (g,) = torch.autograd.grad(out.sum(), lp)
        assert torch.isfinite(g).all()
    close(kl_estimator(lp, ref, "k1"), [0.0, 10.0, -10.0])
    # E_{y~p}[k1] = E_{y~p}[k3] = KL(p || q) for exact expectations over a small vocab.
    g = torch.Generator().manual_seed(1)
    p = torch.randn(6, generator=g, dtype=F64).log_softmax(-1)
    q = torch.randn(6, generator=g, dtype=F64).log_softmax(-1)
    kl = (p.exp() * (p - q)).sum()
    for kind in ("k1", "k3"):
        close((p.exp() * kl_estimator(p, q, kind, clamp=None)).sum(), kl)
    with pytest.raises(ValueError, match="kind"):
        kl_estimator(p, q, "k4")


@HYP
@given(
    st.lists(st.floats(-30, 30), min_size=1, max_size=20),
    st.lists(st.floats(-30, 30), min_size=1, max_size=20),
)
def test_kl_k2_k3_nonnegative(a, b):
    n = min(len(a), len(b))
    lp, ref = torch.tensor(a[:n], dtype=F64), torch.tensor(b[:n], dtype=F64)
    for kind in ("k2", "k3"):
        assert (kl_estimator(lp, ref, kind) >= -1e-12).all()


# ----------------------------------------------------------------------------------------------
# GAE
# ----------------------------------------------------------------------------------------------


def ref_gae_row(rewards, values, mask, gamma, lam):
    steps = [t for t in range(len(rewards)) if mask[t]]
    adv, ret = [0.0] * len(rewards), [0.0] * len(rewards)
    next_v, next_a = 0.0, 0.0
    for t in reversed(steps):
        delta = rewards[t] + gamma * next_v - values[t]
        adv[t] = delta + gamma * lam * next_a
        ret[t] = adv[t] + values[t]
        next_v, next_a = values[t], adv[t]
    return adv, ret


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_compute_gae_matches_reference(gamma, lam, gen):
    b, n = 5, 9
    rewards = torch.randn(b, n, generator=gen, dtype=F64)
    values = torch.randn(b, n, generator=gen, dtype=F64)
    for mask in random_masks(b, n, gen):
        adv, ret = compute_gae(rewards, values, mask, gamma, lam)
        for i in range(b):
            ra, rr = ref_gae_row(
                rewards[i].tolist(), values[i].tolist(), mask[i].tolist(), gamma, lam
            )
            close(adv[i], ra)
            close(ret[i], rr)
        adv0, _ = compute_gae(rewards, None, mask, gamma, lam)
        adv_ref, _ = compute_gae(rewards, torch.zeros_like(values), mask, gamma, lam)
        close(adv0, adv_ref)


def test_compute_gae_packed_equals_padded(gen):
    lens = [4, 0, 7, 1, 5]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()))
    t = sum(lens)
    rewards, values = (
        torch.randn(t, generator=gen, dtype=F64),
        torch.randn(t, generator=gen, dtype=F64),
    )
    mask = torch.rand(t, generator=gen) > 0.3
    for m in (None, mask):
        adv, ret = compute_gae_packed(rewards, values, cu, 0.97, 0.9, mask=m)
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            seg_mask = [True] * (b - a) if m is None else m[a:b].tolist()
            ra, rr = ref_gae_row(rewards[a:b].tolist(), values[a:b].tolist(), seg_mask, 0.97, 0.9)
            close(adv[a:b], ra)
            close(ret[a:b], rr)
    with pytest.raises(ValueError, match="cu_seqlens"):
        compute_gae_packed(rewards, values, torch.tensor([0, 5]), 1.0, 1.0)


@HYP
@given(n=st.integers(1, 12), seed=st.integers(0, 999))
def test_gae_lambda_one_is_return_minus_value(n, seed):
    """gamma = lam = 1 telescopes: A_t = sum_{s >= t} r_s - V_t."""
    g = torch.Generator().manual_seed(seed)
    r, v = torch.randn(1, n, generator=g, dtype=F64), torch.randn(1, n, generator=g, dtype=F64)
    adv, ret = compute_gae(r, v, torch.ones(1, n, dtype=torch.bool), 1.0, 1.0)
    close(ret, r.flip(-1).cumsum(-1).flip(-1))
    close(adv, ret - v)


# ----------------------------------------------------------------------------------------------
# Reward shaping, group normalisation, dynamic sampling
# ----------------------------------------------------------------------------------------------


def test_shape_rewards(gen):
    r = torch.randn(20, generator=gen, dtype=F64) * 5
    out = shape_rewards(r, scaling=0.5, bias=-1.0, clip=2.0)
    close(out, [max(-2.0, min(2.0, (v - 1.0) * 0.5)) for v in r.tolist()])
    close(shape_rewards(r), r)
    with pytest.raises(ValueError, match="clip"):
        shape_rewards(r, clip=0.0)


def test_overlong_penalty():
    lengths = torch.tensor([0, 10, 12, 13, 16, 20, 25])
    r = torch.ones(7, dtype=F64)
    out = overlong_penalty(r, lengths, max_response_len=20, overlong_tokens=8, penalty_factor=0.5)
    expect = []
    for n in lengths.tolist():
        pen = 0.0 if n <= 12 else ((12 - n) / 8 if n <= 20 else -1.0)
        expect.append(1.0 + 0.5 * pen)
    close(out, expect)
    with pytest.raises(ValueError, match="overlong_tokens"):
        overlong_penalty(r, lengths, 20, 0, 1.0)


def ref_group_normalize(x, g, mean_level, std_level, eps, loo, unbiased):
    groups = [x[i : i + g] for i in range(0, len(x), g)]
    out = []
    for gi, grp in enumerate(groups):
        for j, v in enumerate(grp):
            pool_m = {"batch": x, "group": grp, "none": None}[mean_level]
            if pool_m is None:
                b = 0.0
            elif loo:
                idx = gi * g + j if mean_level == "batch" else j
                others = pool_m[:idx] + pool_m[idx + 1 :]
                b = sum(others) / len(others)
            else:
                b = ref_mean(pool_m)
            pool_s = {"batch": x, "group": grp, "none": None}[std_level]
            s, e = (1.0, 0.0) if pool_s is None else (math.sqrt(ref_var(pool_s, unbiased)), eps)
            out.append((v - b) / (s + e))
    return out


@pytest.mark.parametrize("mean_level", ["batch", "group", "none"])
@pytest.mark.parametrize("std_level", ["batch", "group", "none"])
@pytest.mark.parametrize("loo", [False, True])
def test_group_normalize_matches_reference(mean_level, std_level, loo, gen):
    x = torch.randn(12, generator=gen, dtype=F64)
    x[4:8] = 1.0  # a group with identical rewards: std 0 -> eps keeps it finite
    for unbiased in (False, True):
        out = group_normalize(
            x, 4, mean_level, std_level, 1e-5, leave_one_out=loo, unbiased=unbiased
        )
        ref = ref_group_normalize(
            x.tolist(), 4, mean_level, std_level, 1e-5, loo and mean_level != "none", unbiased
        )
        close(out, ref)


def test_group_normalize_errors():
    with pytest.raises(ValueError, match="divisible"):
        group_normalize(torch.zeros(7), 4)
    with pytest.raises(ValueError, match="mean_level"):
        group_normalize(torch.zeros(8), 4, mean_level="token")
    with pytest.raises(ValueError, match="leave_one_out"):
        group_normalize(torch.zeros(8), 1, leave_one_out=True)


@HYP
@given(n_groups=st.integers(1, 5), g=st.integers(2, 6), seed=st.integers(0, 999))
def test_group_normalize_properties(n_groups, g, seed):
    x = torch.randn(n_groups * g, generator=torch.Generator().manual_seed(seed), dtype=F64)
    grpo = group_normalize(x, g, "group", "none").view(n_groups, g)
    assert grpo.sum(-1).abs().max() < 1e-9  # group-centred
    rloo = group_normalize(x, g, "group", "none", leave_one_out=True).view(n_groups, g)
    close(rloo, grpo * g / (g - 1))  # RLOO == scaled group centring


def test_dynamic_sampling_mask():
    r = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5])
    close(dynamic_sampling_mask(r, 3).double(), [False, False, True, False])
    close(dynamic_sampling_mask(r, 4).double(), [True, True, False])
    for n in range(1, 5):
        rows = r.view(-1, n) if r.numel() % n == 0 else None
        if rows is not None:
            expect = [len(set(row)) > 1 for row in rows.tolist()]
            close(dynamic_sampling_mask(r, n).double(), expect)
    with pytest.raises(ValueError, match="divisible"):
        dynamic_sampling_mask(r, 5)


def test_normalize_advantages(gen):
    a = torch.randn(4, 6, generator=gen, dtype=F64) + 2
    for mask in random_masks(4, 6, gen)[:3]:
        close(normalize_advantages(a, mask), masked_normalization(a, mask))
        vals = selected(a, mask)
        mu, sd = ref_mean(vals), math.sqrt(ref_var(vals, False))
        centred = normalize_advantages(a, mask, std_level="none")
        scaled = normalize_advantages(a, mask, mean_level="none")
        for i in range(4):
            for j in range(6):
                v, m = a[i, j].item(), bool(mask[i, j])
                assert abs(centred[i, j].item() - ((v - mu) if m else 0.0)) < 1e-9
                assert abs(scaled[i, j].item() - (v / (sd + 1e-5) if m else 0.0)) < 1e-9


# ----------------------------------------------------------------------------------------------
# PPO actor loss
# ----------------------------------------------------------------------------------------------


def ref_actor_loss(
    lp, old, adv, mask, eps, eps_high=None, c_clip=None, prox=None, cap=None, seqs=None
):
    """Per-token loop. lp: flat list of scalar tensors (for gradients); others flat floats.
    seqs: list of token-index lists for sequence-level ratios, else None."""
    prox = old if prox is None else prox
    high = eps if eps_high is None else eps_high
    log_ratio = [lp[i] - prox[i] for i in range(len(lp))]
    if seqs is not None:
        for seq in seqs:
            sel = [i for i in seq if mask[i]]
            if sel:
                mean = sum(log_ratio[i] for i in sel) / len(sel)
                for i in sel:
                    log_ratio[i] = mean
    total, n, clipped, dual = 0.0, sum(mask), 0, 0
    for i in range(len(lp)):
        if not mask[i]:
            continue
        r = torch.exp(log_ratio[i])
        a = adv[i]
        l1 = -a * r
        l2 = -a * torch.clamp(r, 1 - eps, 1 + high)
        loss = l2 if l2 > l1 else l1
        clipped += int(l2 > l1)
        if c_clip is not None and a < 0 and loss > -a * c_clip:
            loss = -a * c_clip * torch.ones((), dtype=F64)
            dual += 1
        w = math.exp(prox[i] - old[i])
        if cap is not None and w > cap:
            w = 0.0
        total = total + loss * w
    return total / max(n, 1), clipped, dual


def actor_inputs(shape, gen, spread=0.4):
    lp = torch.randn(shape, generator=gen, dtype=F64) * 0.5 - 1
    old = lp + torch.randn(shape, generator=gen, dtype=F64) * spread
    prox = lp + torch.randn(shape, generator=gen, dtype=F64) * spread
    adv = torch.randn(shape, generator=gen, dtype=F64)
    return lp, old, prox, adv


def compare_with_reference(lp, old, adv, mask, seqs=None, **kw):
    lp = lp.clone().requires_grad_()
    ref_kw = dict(kw)
    if "proximal_logprobs" in ref_kw:
        p = ref_kw.pop("proximal_logprobs")
        ref_kw["prox"] = None if p is None else p.reshape(-1).tolist()
    ref_kw["eps_high"] = ref_kw.pop("eps_clip_higher", None)
    ref_kw["cap"] = ref_kw.pop("behav_imp_weight_cap", None)
    ref_kw.pop("importance_sampling_level", None)
    ref_kw.pop("cu_seqlens", None)
    eps = ref_kw.pop("eps_clip")

    loss, stats = ppo_actor_loss_fn(lp, old, adv, loss_mask=mask, **kw)
    (g,) = torch.autograd.grad(loss, lp)
    flat_lp = list(lp.reshape(-1).unbind())
    ref, clipped, dual = ref_actor_loss(
        flat_lp,
        old.reshape(-1).tolist(),
        adv.reshape(-1).tolist(),
        mask.reshape(-1).tolist(),
        eps,
        seqs=seqs,
        **ref_kw,
    )
    close(loss, ref)
    n = max(int(mask.sum()), 1)
    close(stats["clip_ratio"], clipped / n)
    close(stats["dual_clip_ratio"], dual / n)
    if torch.is_tensor(ref) and ref.requires_grad:
        (g_ref,) = torch.autograd.grad(ref, lp)
        close(g, g_ref)
    else:
        close(g, torch.zeros_like(g))
    return loss, stats


@pytest.mark.parametrize(
    "kw",
    [
        dict(eps_clip=0.2),
        dict(eps_clip=0.2, eps_clip_higher=0.28),
        dict(eps_clip=0.2, c_clip=1.5),
        dict(eps_clip=0.2, proximal="yes"),
        dict(
            eps_clip=0.1, eps_clip_higher=0.3, c_clip=2.0, proximal="yes", behav_imp_weight_cap=1.2
        ),
    ],
)
@pytest.mark.parametrize("packed", [False, True])
def test_actor_loss_matches_reference(kw, packed, gen):
    shape = (24,) if packed else (4, 6)
    lp, old, prox, adv = actor_inputs(shape, gen)
    kw = dict(kw)
    if kw.pop("proximal", None):
        kw["proximal_logprobs"] = prox
    for mask in random_masks(4, 6, gen):
        compare_with_reference(lp, old, adv, mask.reshape(shape), **kw)


@pytest.mark.parametrize("packed", [False, True])
def test_actor_loss_sequence_level_gspo(packed, gen):
    lp, old, prox, adv = actor_inputs((4, 6), gen, spread=0.15)
    for mask in random_masks(4, 6, gen):
        seqs = [list(range(i * 6, (i + 1) * 6)) for i in range(4)]
        kw = dict(
            eps_clip=0.05, c_clip=1.05, proximal_logprobs=prox, importance_sampling_level="sequence"
        )
        if packed:
            kw.update(
                cu_seqlens=torch.tensor([0, 6, 12, 18, 24]), proximal_logprobs=prox.reshape(-1)
            )
            _, stats = compare_with_reference(
                lp.reshape(-1), old.reshape(-1), adv.reshape(-1), mask.reshape(-1), seqs=seqs, **kw
            )
        else:
            _, stats = compare_with_reference(lp, old, adv, mask, seqs=seqs, **kw)
        # every masked token of a sequence shares one ratio: exp(mean log-ratio over its tokens)
        iw = stats["importance_weight"].reshape(4, 6)
        for i in range(4):
            sel = selected(lp[i] - prox[i], mask[i])
            for j in range(6):
                expect = math.exp(ref_mean(sel)) if mask[i, j] else 0.0
                assert abs(iw[i, j].item() - expect) < 1e-9


def test_gspo_packed_with_uneven_sequences(gen):
    lp, old, _, adv = actor_inputs((10,), gen)
    cu = torch.tensor([0, 2, 7, 10])
    mask = torch.ones(10, dtype=torch.bool)
    _, stats = ppo_actor_loss_fn(
        lp, old, adv, 0.2, mask, importance_sampling_level="sequence", cu_seqlens=cu
    )
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        expect = math.exp((lp[a:b] - old[a:b]).mean().item())
        close(stats["importance_weight"][a:b], [expect] * (b - a))
    with pytest.raises(ValueError, match="cu_seqlens"):
        ppo_actor_loss_fn(lp, old, adv, 0.2, mask, importance_sampling_level="sequence")


def _targeted_inputs():
    """Six tokens with known ratios r = exp(lp - old): only chosen tokens sit past a clip edge."""
    ratios = torch.tensor([1.0, 1.1, 1.25, 3.0, 0.5, 1.25], dtype=F64)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, -1.0, -1.0], dtype=F64)
    old = torch.full((6,), -1.0, dtype=F64)
    return old + ratios.log(), old, adv, torch.ones(6, dtype=torch.bool)


def _per_token_grad(lp, old, adv, mask, **kw):
    lp = lp.clone().requires_grad_()
    loss, stats = ppo_actor_loss_fn(lp, old, adv, loss_mask=mask, **kw)
    (g,) = torch.autograd.grad(loss, lp)
    return loss, stats, g


def test_clip_higher_only_changes_tokens_between_the_two_upper_edges():
    lp, old, adv, mask = _targeted_inputs()
    _, base, g_base = _per_token_grad(lp, old, adv, mask, eps_clip=0.2)
    _, high, g_high = _per_token_grad(lp, old, adv, mask, eps_clip=0.2, eps_clip_higher=0.3)
    # token 2: A > 0, r = 1.25 in (1.2, 1.3] -> clipped at 0.2, unclipped with clip-higher
    assert base["clip_mask"].tolist() == [False, False, True, False, True, False]
    assert high["clip_mask"].tolist() == [False, False, False, False, True, False]
    changed = (base["loss"] != high["loss"]) | (g_base != g_high)
    assert changed.tolist() == [False, False, True, False, False, False]
    close(high["loss"][2], -1.25)
    close(base["loss"][2], -1.2)
    assert g_base[2] == 0 and g_high[2] != 0


def test_dual_clip_only_changes_negative_advantage_tokens_past_c():
    lp, old, adv, mask = _targeted_inputs()
    _, base, g_base = _per_token_grad(lp, old, adv, mask, eps_clip=0.2)
    _, dual, g_dual = _per_token_grad(lp, old, adv, mask, eps_clip=0.2, c_clip=2.0)
    # token 3: A < 0, r = 3 > c = 2 -> loss capped at -A c = 2 and its gradient cut
    assert dual["dual_clip_mask"].tolist() == [False, False, False, True, False, False]
    changed = (base["loss"] != dual["loss"]) | (g_base != g_dual)
    assert changed.tolist() == [False, False, False, True, False, False]
    close(base["loss"][3], 3.0)
    close(dual["loss"][3], 2.0)
    assert g_base[3] != 0 and g_dual[3] == 0
    close(dual["dual_clip_ratio"], 1 / 6)


def test_importance_weight_cap_only_drops_tokens_above_the_cap():
    lp, old, adv, mask = _targeted_inputs()
    behav = torch.tensor([1.0, 1.5, 0.9, 1.1, 2.5, 1.0], dtype=F64)  # pi_prox / pi_behav
    prox = old + behav.log()
    kw = dict(eps_clip=0.2, proximal_logprobs=prox)
    # keep the PPO ratio r = pi / pi_prox as in _targeted_inputs
    lp = lp + behav.log()
    loss_nc, nocap, g_nc = _per_token_grad(lp, old, adv, mask, **kw)
    loss_c, cap, g_c = _per_token_grad(lp, old, adv, mask, behav_imp_weight_cap=2.0, **kw)
    assert cap["behave_mask"].tolist() == [True, True, True, True, False, True]
    changed = (nocap["loss"] != cap["loss"]) | (g_nc != g_c)
    assert changed.tolist() == [False, False, False, False, True, False]
    close(cap["loss"][4], 0.0)
    close(nocap["behave_imp_weight"], behav)
    # the dropped token still counts in the denominator: loss drops by exactly its share
    close(loss_nc - loss_c, nocap["loss"][4] / 6)
    close(cap["behave_mask_ratio"], 5 / 6)


def test_actor_loss_on_policy_identities(gen):
    """ratio = 1 everywhere: loss = -mean(A), nothing clipped, gradient = -A / n."""
    lp = torch.randn(3, 5, generator=gen, dtype=F64)
    adv = torch.randn(3, 5, generator=gen, dtype=F64)
    mask = torch.rand(3, 5, generator=gen) > 0.3
    loss, stats, g = _per_token_grad(lp, lp.clone(), adv, mask, eps_clip=0.2, c_clip=3.0)
    close(loss, -masked_mean(adv, mask))
    close(g, torch.where(mask, -adv / mask.sum(), 0))
    assert stats["clip_ratio"] == 0 and stats["dual_clip_ratio"] == 0
    close(stats["importance_weight_mean"], 1.0)
    # empty mask: zero loss and zero gradient, never NaN
    loss, _, g = _per_token_grad(lp, lp + 1, adv, torch.zeros_like(mask), eps_clip=0.2)
    assert loss == 0 and (g == 0).all()


def test_actor_loss_padding_garbage_cannot_leak(gen):
    lp, old, _, adv = actor_inputs((8,), gen)
    mask = torch.tensor([1, 1, 1, 1, 1, 0, 0, 0], dtype=torch.bool)
    lp2, old2, adv2 = lp.clone(), old.clone(), adv.clone()
    lp2[5:], old2[5:], adv2[5:] = 500.0, -500.0, float("nan")
    loss1, _, g1 = _per_token_grad(lp, old, adv, mask, eps_clip=0.2)
    loss2, _, g2 = _per_token_grad(lp2, old2, adv2, mask, eps_clip=0.2, proximal_logprobs=old2)
    close(loss1, loss2)
    close(g1, g2)


def test_actor_loss_rejects_bad_arguments():
    x = torch.zeros(4)
    m = torch.ones(4, dtype=torch.bool)
    with pytest.raises(ValueError, match="c_clip"):
        ppo_actor_loss_fn(x, x, x, 0.2, m, c_clip=0.9)
    with pytest.raises(ValueError, match="importance_sampling_level"):
        ppo_actor_loss_fn(x, x, x, 0.2, m, importance_sampling_level="group")
    with pytest.raises(ValueError, match="shapes differ"):
        ppo_actor_loss_fn(x, x, torch.zeros(5), 0.2, m)
    with pytest.raises(ValueError, match="eps_clip"):
        ppo_actor_loss_fn(x, x, x, 0.0, m)


# ----------------------------------------------------------------------------------------------
# Critic loss
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("clip", [0.2, None])
def test_critic_loss_matches_reference(clip, gen):
    v = torch.randn(4, 6, generator=gen, dtype=F64, requires_grad=True)
    old = v.detach() + torch.randn(4, 6, generator=gen, dtype=F64) * 0.3
    ret = torch.randn(4, 6, generator=gen, dtype=F64)
    for mask in random_masks(4, 6, gen):
        loss, stats = ppo_critic_loss_fn(v, old, ret, clip, mask)
        total, n, n_clip = 0.0, int(mask.sum()), 0
        for vi, oi, ri, mi in zip(
            v.reshape(-1).unbind(),
            old.reshape(-1).tolist(),
            ret.reshape(-1).tolist(),
            mask.reshape(-1).tolist(),
        ):
            if not mi:
                continue
            l1 = (vi - ri) ** 2
            l2 = l1 if clip is None else (oi + torch.clamp(vi - oi, -clip, clip) - ri) ** 2
            n_clip += int(l2 > l1)
            total = total + 0.5 * (l2 if l2 > l1 else l1)
        ref = total / max(n, 1)
        close(loss, ref)
        close(stats["clip_ratio"], n_clip / max(n, 1))
        (g,) = torch.autograd.grad(loss, v)
        g_ref = torch.autograd.grad(ref, v)[0] if torch.is_tensor(ref) else torch.zeros_like(v)
        close(g, g_ref)


# ----------------------------------------------------------------------------------------------
# Distributed: 2 gloo ranks == one process on the concatenated batch
# ----------------------------------------------------------------------------------------------


def _shard(rank: int):
    g = torch.Generator().manual_seed(100 + rank)
    rows = 3 if rank == 0 else 5
    x = torch.randn(rows, 6, generator=g, dtype=F64) * (1 + rank) + rank
    mask = torch.rand(rows, 6, generator=g) > 0.3
    mask[0] = False
    rewards = torch.randn(4 * (2 + rank), generator=g, dtype=F64)
    return x, mask, rewards


def _statistics(x, mask, rewards) -> dict[str, torch.Tensor]:
    return {
        "norm": masked_normalization(x, mask),
        "norm_dim0_unbiased": masked_normalization(x, mask, dim=0, unbiased=True),
        "mean": masked_mean(x, mask, all_reduce=True),
        "var": masked_var(x, mask, unbiased=True, all_reduce=True),
        "adv_centred": normalize_advantages(x, mask, std_level="none"),
        "group_mean_batch_std": group_normalize(rewards, 4, "group", "batch"),
        "batch_loo": group_normalize(rewards, 4, "batch", "batch", leave_one_out=True),
    }


def _dist_worker(out_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    x, mask, rewards = _shard(rank)
    result = _statistics(x, mask, rewards)
    result["local_norm"] = masked_normalization(x, mask, all_reduce=False)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_two_gloo_ranks_equal_single_process(tmp_path):
    torchrun(__file__, 2, tmp_path, timeout=150)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    shards = [_shard(r) for r in range(2)]
    full = _statistics(*(torch.cat(parts) for parts in zip(*shards)))
    rows = [s[0].shape[0] for s in shards]
    n_rewards = [s[2].numel() for s in shards]
    for key, expect in full.items():
        if expect.ndim == 0:
            got = [r[key] for r in ranks]
            close(got[0], expect)
            close(got[1], expect)
        else:
            sizes = n_rewards if expect.numel() == sum(n_rewards) and expect.ndim == 1 else rows
            for r, part in enumerate(expect.split(sizes)):
                close(ranks[r][key], part)
    # without all_reduce each rank normalises on its own data, which differs here
    local0 = masked_normalization(shards[0][0], shards[0][1])
    close(ranks[0]["local_norm"], local0)
    assert not torch.allclose(local0, full["norm"][: rows[0]])


if __name__ == "__main__":
    _dist_worker(sys.argv[1])
