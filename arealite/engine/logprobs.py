"""Token log-probabilities and entropies of logits, chunked over tokens so that at most one
[chunk, V] fp32 softmax exists at a time (forward and backward): the full-vocabulary fp32
copy is what runs a trainer out of memory on long sequences with large vocabularies.

Imports torch only (arealite/utils imports no other arealite package).
"""

from __future__ import annotations

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """bf16/fp16 logits are upcast so log_softmax is accurate; fp64 stays fp64 (tests)."""
    return torch.promote_types(dtype, torch.float32)


class _ChunkedLogprobEntropy(torch.autograd.Function):
    """log_softmax(z)[label] and entropy of softmax(z), z = logits / T, one chunk of rows at a time.

    Plain autograd would keep one fp32 [chunk, V] softmax alive per chunk until backward, i.e. a
    full fp32 [T, V] copy in total. This Function saves only the input logits and recomputes each
    chunk's softmax in backward:
        d logp_t / d z_tk = 1[k = y_t] - p_tk
        d H_t    / d z_tk = -p_tk (log p_tk + H_t)
    """

    @staticmethod
    def forward(ctx, logits, labels, temperature, chunk_size, with_entropy):
        vocab = logits.shape[-1]
        flat, flat_labels = logits.reshape(-1, vocab), labels.reshape(-1, 1)
        dtype = compute_dtype(logits.dtype)
        logp = torch.empty(flat.shape[0], dtype=dtype, device=logits.device)
        entropy = torch.empty_like(logp) if with_entropy else logp.new_empty(0)
        for s in range(0, flat.shape[0], chunk_size):
            z = flat[s : s + chunk_size].to(dtype) / temperature
            logp_all = z.log_softmax(-1)
            logp[s : s + chunk_size] = logp_all.gather(-1, flat_labels[s : s + chunk_size])[:, 0]
            if with_entropy:
                entropy[s : s + chunk_size] = -(logp_all.exp() * logp_all).sum(-1)
        ctx.save_for_backward(logits, labels)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        ctx.set_materialize_grads(False)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
            return logp.view(labels.shape), entropy
        return logp.view(labels.shape), entropy.view(labels.shape)

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        logits, labels = ctx.saved_tensors
        vocab, t, step = logits.shape[-1], ctx.temperature, ctx.chunk_size
        flat, flat_labels = logits.reshape(-1, vocab), labels.reshape(-1, 1)
        dtype = compute_dtype(logits.dtype)
        grad = torch.empty_like(flat)
        g_lp = None if grad_logp is None else grad_logp.reshape(-1, 1).to(dtype)
        g_h = None if grad_entropy is None else grad_entropy.reshape(-1, 1).to(dtype)
        for s in range(0, flat.shape[0], step):
            logp_all = (flat[s : s + step].to(dtype) / t).log_softmax(-1)
            p = logp_all.exp()
            gz = torch.zeros_like(p)
            if g_lp is not None:
                gz -= p * g_lp[s : s + step]
                gz.scatter_add_(-1, flat_labels[s : s + step], g_lp[s : s + step])
            if g_h is not None:
                h = -(p * logp_all).sum(-1, keepdim=True)
                gz -= g_h[s : s + step] * p * (logp_all + h)
            grad[s : s + step] = gz / t
        return grad.view_as(logits), None, None, None, None


def _check_logits_labels(logits, labels, temperature, chunk_size):
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} must equal logits shape without the vocab "
            f"dim {tuple(logits.shape[:-1])}"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if not (isinstance(chunk_size, int) and chunk_size >= 1):
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")


def gather_logprobs(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, chunk_size: int = 1024
) -> torch.Tensor:
    """log pi(y_t) = log_softmax(logits_t / T)[y_t], for logits [..., V] and labels [...].

    Dividing by the sampling temperature T makes trainer logprobs match the inference server's.
    Rows are processed `chunk_size` at a time (forward and backward) so at most a
    [chunk_size, V] fp32 softmax exists at once; the result is fp32 (fp64 for fp64 logits).
    """
    _check_logits_labels(logits, labels, temperature, chunk_size)
    return _ChunkedLogprobEntropy.apply(logits, labels.long(), temperature, chunk_size, False)[0]


def gather_logprobs_entropy(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, chunk_size: int = 1024
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log pi(y_t), H_t) with H_t = -sum_k pi_k log pi_k, pi = softmax(logits_t / T).

    Same chunking and memory bound as `gather_logprobs`; both outputs are differentiable, so
    the entropy can serve as a bonus term as well as a logged statistic.
    """
    _check_logits_labels(logits, labels, temperature, chunk_size)
    return _ChunkedLogprobEntropy.apply(logits, labels.long(), temperature, chunk_size, True)
