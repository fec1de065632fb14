"""Vectorised per-row sampling: every request in a batch keeps its own sampling parameters.

Logprobs always describe the temperature-scaled *untruncated* distribution
(`log_softmax(logits / T)`), because that is what the trainer recomputes; top-p / top-k and the
min-new-tokens mask only shape which token gets drawn.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from arealite.server.protocol import SamplingParams


@dataclass
class SamplingTensors:
    """Per-row parameters as tensors, rebuilt only when the batch composition changes."""

    temperature: torch.Tensor  # [B] float32, temperature of the logprob distribution
    greedy: torch.Tensor  # [B] bool
    top_k: torch.Tensor  # [B] long, vocab size where disabled
    top_p: torch.Tensor  # [B] float32, 2.0 where disabled (keeps float error from truncating)
    all_greedy: bool
    any_greedy: bool
    any_top_k: bool
    any_top_p: bool
    seeds: tuple[int | None, ...] = ()  # per-row sampling_seed (None: the shared generator)

    @property
    def any_seeded(self) -> bool:
        return any(s is not None for s in self.seeds)

    @classmethod
    def build(cls, params: list[SamplingParams], vocab: int, device) -> SamplingTensors:
        greedy = [p.greedy for p in params]
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        top_p = [p.top_p if p.top_p < 1.0 else 2.0 for p in params]
        return cls(
            temperature=torch.tensor(
                [p.logprob_temperature for p in params], dtype=torch.float32, device=device
            ),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            top_k=torch.tensor(top_k, dtype=torch.long, device=device),
            top_p=torch.tensor(top_p, dtype=torch.float32, device=device),
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            any_top_k=any(k < vocab for k, g in zip(top_k, greedy) if not g),
            any_top_p=any(p < 1.0 for p, g in zip(top_p, greedy) if not g),
            seeds=tuple(None if g else p.seed for p, g in zip(params, greedy)),
        )


def _truncate_top_k_top_p(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Set to -inf every token outside each row's top-k, then outside its top-p nucleus."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if st.any_top_k:
        rank = torch.arange(logits.shape[-1], device=logits.device)
        sorted_logits = sorted_logits.masked_fill(rank[None, :] >= st.top_k[:, None], float("-inf"))
    if st.any_top_p:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        sorted_logits = sorted_logits.masked_fill(mass_before > st.top_p[:, None], float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sample_next_tokens(
    logits: torch.Tensor,
    st: SamplingTensors,
    generator: torch.Generator | None = None,
    banned: torch.Tensor | None = None,
    positions: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] -> (tokens [B] long, logprobs [B] float32).

    `banned` [B, V] bool marks tokens that must not be drawn this step (stop tokens before
    min_new_tokens); it does not change the reported logprobs. `positions` [B] (the position
    of the token being drawn in each row) is required when some row has a seed.
    """
    scaled = logits.float() / st.temperature[:, None]
    logprobs = torch.log_softmax(scaled, dim=-1)
    if banned is not None:
        scaled = scaled.masked_fill(banned, float("-inf"))
    if st.all_greedy:
        tokens = scaled.argmax(dim=-1)
    else:
        candidates = _truncate_top_k_top_p(scaled, st) if st.any_top_k or st.any_top_p else scaled
        probs = candidates.softmax(dim=-1)
        # Exponential race (Gumbel-max equivalent): no renormalisation needed.
        noise = exponential_noise(probs.shape, generator, probs.device)
        if st.any_seeded:
            _seeded_noise(noise, st.seeds, positions)
        tokens = (probs / noise).argmax(dim=-1)
        if st.any_greedy:
            tokens = torch.where(st.greedy, scaled.argmax(dim=-1), tokens)
    return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)


def top_logprobs(
    logits: torch.Tensor, temperature: torch.Tensor, ks: list[int]
) -> dict[int, list[tuple[int, float]]]:
    """Row -> its ks[row] most likely (token, logprob) pairs of the distribution the logprobs
    describe (OpenAI `top_logprobs`), for the rows with ks[row] > 0; the others cost nothing."""
    rows = [i for i, k in enumerate(ks) if k > 0]
    if not rows:
        return {}
    index = torch.tensor(rows, device=logits.device)
    logprobs = torch.log_softmax(logits[index].float() / temperature[index][:, None], dim=-1)
    k = min(max(ks[i] for i in rows), logprobs.shape[-1])
    values, ids = logprobs.topk(k, dim=-1)
    return {
        row: list(zip(toks, vals))[: ks[row]]
        for row, vals, toks in zip(rows, values.tolist(), ids.tolist())
    }


def exponential_noise(shape, generator: torch.Generator | None, device) -> torch.Tensor:
    """Exp(1) draws as -log(1 - U): on a CPU 6x faster than `exponential_` (80 vs 460 us for
    48 x 638, ~9% of a long_sums decoding step), the same distribution."""
    uniform = torch.rand(shape, generator=generator, device=device)
    return uniform.neg_().log1p_().neg_()


_MASK64 = (1 << 64) - 1


def _mix(seed: int, position: int) -> int:
    """splitmix64 of (seed, position): unrelated streams for neighbouring seeds / positions."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _seeded_noise(noise: torch.Tensor, seeds, positions: list[int] | None) -> None:
    """Overwrite seeded rows with exponential noise drawn from (seed, position) alone (on the
    CPU, so the draw is the same on any device)."""
    if positions is None:
        raise ValueError("sample_next_tokens: rows with a seed need their positions")
    for i, (seed, pos) in enumerate(zip(seeds, positions)):
        if seed is not None:
            g = torch.Generator().manual_seed(_mix(seed, pos))
            noise[i] = exponential_noise((noise.shape[-1],), g, torch.device("cpu")).to(
                noise.device
            )
