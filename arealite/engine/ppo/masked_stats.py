"""Masked statistics of token tensors, optionally over all ranks.

Token tensors come padded, [B, L] with a mask, or packed, [T] with a mask and `cu_seqlens`
(int, [n_seqs + 1], starting at 0). Functions that take `all_reduce=True` are collectives when
torch.distributed is initialised: every rank of `group` must call them, and they return the
statistic of the global batch, so N ranks give the same result as one process with all data.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def as_bool_mask(mask: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    if mask is None:
        return torch.ones_like(x, dtype=torch.bool)
    try:
        return torch.broadcast_to(mask != 0, x.shape)
    except RuntimeError as e:
        raise ValueError(
            f"mask shape {tuple(mask.shape)} does not broadcast to x shape {tuple(x.shape)}"
        ) from e


def _dims(x: torch.Tensor, dim) -> tuple[int, ...]:
    if dim is None:
        return tuple(range(x.ndim))
    return (dim,) if isinstance(dim, int) else tuple(dim)


def _all_reduce_(tensors: list[torch.Tensor], all_reduce: bool, group) -> None:
    """Sum `tensors` in place over the ranks of `group`, in one collective."""
    if not (all_reduce and dist.is_available() and dist.is_initialized()):
        return
    if any(t.requires_grad for t in tensors) and torch.is_grad_enabled():
        raise ValueError(
            "all-reduced statistics are not differentiable; pass a detached x "
            "(or all_reduce=False) when gradients are needed"
        )
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    for t, chunk in zip(tensors, flat.split([t.numel() for t in tensors])):
        t.copy_(chunk.view_as(t))


def masked_count_sum(x, mask, dim, all_reduce, group):
    """(count, sum) over `dim`, keepdim, all-reduced when asked."""
    m = as_bool_mask(mask, x)
    dims = _dims(x, dim)
    count = m.sum(dims, keepdim=True).to(x.dtype)
    total = torch.where(m, x, 0).sum(dims, keepdim=True)
    _all_reduce_([count, total], all_reduce, group)
    return m, dims, count, total


def masked_sum(
    x: torch.Tensor, mask: torch.Tensor | None, dim=None, keepdim: bool = False
) -> torch.Tensor:
    """sum_i m_i x_i over `dim` (all dims when None). Masked positions may hold NaN/inf."""
    dims = _dims(x, dim)
    return torch.where(as_bool_mask(mask, x), x, 0).sum(dims, keepdim=keepdim)


def masked_mean(
    x: torch.Tensor,
    mask: torch.Tensor | None,
    dim=None,
    keepdim: bool = False,
    all_reduce: bool = False,
    group=None,
) -> torch.Tensor:
    """sum_i m_i x_i / sum_i m_i over `dim`; 0 where nothing is selected.

    An empty selection gives 0 rather than NaN so an all-masked micro-batch adds no loss.
    With all_reduce, numerator and denominator are summed over ranks (the global mean).
    """
    _, dims, count, total = masked_count_sum(x, mask, dim, all_reduce, group)
    mean = total / count.clamp(min=1)
    return mean if keepdim else mean.squeeze(dims)


def masked_var(
    x: torch.Tensor,
    mask: torch.Tensor | None,
    dim=None,
    unbiased: bool = False,
    keepdim: bool = False,
    all_reduce: bool = False,
    group=None,
) -> torch.Tensor:
    """sum_i m_i (x_i - mean)^2 / (n - ddof), n = sum_i m_i, ddof = 1 if unbiased else 0.

    Two passes (mean first, then squared deviations) instead of E[x^2] - E[x]^2, which cancels
    catastrophically for large offsets. 0 where n <= ddof.
    """
    m, dims, count, total = masked_count_sum(x, mask, dim, all_reduce, group)
    mean = total / count.clamp(min=1)
    sq_dev = torch.where(m, (x - mean).square(), 0).sum(dims, keepdim=True)
    _all_reduce_([sq_dev], all_reduce, group)
    denom = count - float(unbiased)
    var = torch.where(denom > 0, sq_dev / denom.clamp(min=1), 0)
    return var if keepdim else var.squeeze(dims)


def masked_normalization(
    x: torch.Tensor,
    mask: torch.Tensor | None = None,
    dim=None,
    unbiased: bool = False,
    eps: float = 1e-5,
    all_reduce: bool = True,
    group=None,
) -> torch.Tensor:
    """(x - mean) / (std + eps) with masked statistics over `dim`; 0 at masked positions.

    Statistics are computed in float64 and, with all_reduce, over the global batch of all ranks
    (the advantage whitening of PPO must not depend on how the batch was sharded).
    Returns x's dtype.
    """
    x64 = x.to(torch.float64)
    m = as_bool_mask(mask, x)
    mean = masked_mean(x64, m, dim, keepdim=True, all_reduce=all_reduce, group=group)
    var = masked_var(x64, m, dim, unbiased, keepdim=True, all_reduce=all_reduce, group=group)
    out = torch.where(m, (x64 - mean) / (var.sqrt() + eps), 0)
    return out.to(x.dtype if x.is_floating_point() else torch.float32)


def _check_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    if cu_seqlens.ndim != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
        raise ValueError(f"cu_seqlens must be a 1-D int tensor [n_seqs + 1], got {cu_seqlens}")
    lens = cu_seqlens.diff()
    if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != total or bool((lens < 0).any()):
        raise ValueError(
            f"cu_seqlens must start at 0, be non-decreasing and end at the token count "
            f"{total}; got {cu_seqlens.tolist()}"
        )
    return lens


def packed_seq_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Index of the sequence each packed token belongs to, [T]."""
    lens = _check_cu_seqlens(cu_seqlens, total).long()
    return torch.repeat_interleave(torch.arange(lens.numel(), device=cu_seqlens.device), lens)


def sequence_masked_mean(
    x: torch.Tensor, mask: torch.Tensor | None, cu_seqlens: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-sequence masked mean, [n_seqs]: rows of padded [B, L] x, or cu_seqlens segments of
    packed [T] x. Differentiable; 0 for a sequence with no selected token."""
    if x.ndim == 2 and cu_seqlens is None:
        return masked_mean(x, mask, dim=-1)
    if x.ndim != 1 or cu_seqlens is None:
        raise ValueError(
            "sequence_masked_mean takes padded [B, L] x without cu_seqlens, or packed [T] x "
            f"with cu_seqlens; got x of shape {tuple(x.shape)} and cu_seqlens={cu_seqlens}"
        )
    ids = packed_seq_ids(cu_seqlens, x.numel())
    m = as_bool_mask(mask, x)
    n = cu_seqlens.numel() - 1
    sums = x.new_zeros(n).index_add(0, ids, torch.where(m, x, 0))
    counts = x.new_zeros(n).index_add(0, ids, m.to(x.dtype))
    return sums / counts.clamp(min=1)
