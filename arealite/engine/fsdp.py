"""FSDP2 around an unchanged HF model (torchtitan style), plus what sharded weights need:
global gradient clipping and bucketed gathering of full tensors.

FSDP2 (`fully_shard`) shards every parameter as a DTensor over a 1-D device mesh; each decoder
layer is its own unit (all-gathered just before use, freed after), the root holds the rest
(embeddings, final norm, LM head).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {list(_DTYPES)}")
    return _DTYPES[name]


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks to shard one by one: HF lists their class in `_no_split_modules`."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:  # fall back to the members of any `layers` / `h` ModuleList
        for name, m in model.named_modules():
            if isinstance(m, nn.ModuleList) and name.split(".")[-1] in ("layers", "h", "blocks"):
                layers.extend(m)
    return layers


def apply_fsdp2(
    model: nn.Module,
    mesh: DeviceMesh,
    param_dtype: str | torch.dtype = "float32",
    reduce_dtype: str | torch.dtype = "float32",
    offload_params: bool = False,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """`fully_shard` each decoder layer, then the root; parameters move to the mesh's device
    (or stay pinned on the CPU with `offload_params`, for GPU runs short of memory)."""
    mp = MixedPrecisionPolicy(
        param_dtype=torch_dtype(param_dtype), reduce_dtype=torch_dtype(reduce_dtype)
    )
    kw = dict(mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    if offload_params:
        if mesh.device_type == "cpu":
            raise ValueError("fsdp.offload_params needs a GPU (parameters already live on CPU)")
        kw["offload_policy"] = CPUOffloadPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


def _local_value(x: torch.Tensor) -> float:
    return float(x.full_tensor() if isinstance(x, DTensor) else x)


def clip_grad_norm_(parameters: list[nn.Parameter], max_norm: float) -> float:
    """The *global* L2 gradient norm over all ranks' shards, clipping to `max_norm` if > 0.

    With DTensor gradients the norm torch computes is itself a DTensor reduced over the mesh,
    so every rank sees the same value (and scales by the same factor).
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    if len({g.device_mesh for g in grads if isinstance(g, DTensor)}) > 1:
        return _clip_across_meshes(grads, max_norm)
    if max_norm and max_norm > 0:
        norm = nn.utils.clip_grad_norm_(
            [p for p in parameters if p.grad is not None], max_norm, foreach=True
        )
    else:
        norm = nn.utils.get_total_norm(grads, foreach=True)
    return _local_value(norm)


def _copies(g: torch.Tensor, world: int) -> int:
    """How many ranks hold each element of `g` (its local pieces, over all ranks)."""
    if not isinstance(g, DTensor):
        return world
    mesh = g.device_mesh
    rep = math.prod(mesh.size(i) for i, p in enumerate(g.placements) if p.is_replicate())
    return world // mesh.size() * rep


def _clip_across_meshes(grads: list[torch.Tensor], max_norm: float) -> float:
    """`clip_grad_norm_` for gradients on different meshes (tensor parallelism: FSDP-only
    ones on dp, FSDP+TP ones on dp x tp), which torch's foreach norm cannot mix: each rank's
    local squares, divided by how many ranks hold the same elements, summed over the world."""
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    world = dist.get_world_size()
    sq = torch.zeros((), dtype=torch.float64, device=local[0].device)
    for g, x in zip(grads, local):
        sq += x.double().pow(2).sum() / _copies(g, world)
    dist.all_reduce(sq)
    norm = float(sq.sqrt())
    if max_norm and max_norm > 0 and math.isfinite(norm):
        coef = min(max_norm / (norm + 1e-6), 1.0)
        torch._foreach_mul_(local, coef)
    return norm


def full_tensor(t: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """The unsharded value of a (possibly sharded) tensor. A collective for DTensors: every
    rank must call it in the same order. CPU-offloaded shards are moved to `device` first so
    NCCL can gather them."""
    if not isinstance(t, DTensor):
        return t
    if device is not None and t.device != device:
        t = t.to(device)
    if t.device_mesh.size() == 1:  # one rank holds it all: a view, no gather
        return t.to_local()
    return t.full_tensor()


def plan_buckets(
    model: nn.Module, bucket_bytes: int, dtype: torch.dtype | None = None
) -> list[list[tuple[str, torch.Tensor]]]:
    """Split the model's state dict into groups of about `bucket_bytes` (full, unsharded
    size), in state-dict order. Tied weights appear once (under their first name), as HF
    checkpoints store them. The plan is metadata only: nothing is gathered yet."""
    buckets: list[list[tuple[str, torch.Tensor]]] = [[]]
    size, seen = 0, set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:
            continue
        seen.add(id(t))
        nbytes = t.numel() * (dtype.itemsize if dtype else t.element_size())
        if buckets[-1] and size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append((name, t))
        size += nbytes
    return [b for b in buckets if b]


def iter_full_buckets(
    buckets: list[list[tuple[str, torch.Tensor]]],
    device: torch.device | None = None,
    dtype: torch.dtype | None = None,
    to_cpu: bool = True,
) -> Iterator[dict[str, torch.Tensor]]:
    """Gather one bucket at a time into full tensors (a collective; all ranks must iterate),
    so peak extra memory is one bucket rather than a second copy of the model."""
    for bucket in buckets:
        out = {}
        for name, t in bucket:
            full = full_tensor(t.detach(), device)
            if dtype is not None and full.is_floating_point():
                full = full.to(dtype)
            out[name] = full.cpu() if to_cpu else full
        yield out
