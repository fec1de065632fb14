"""Tensor parallelism (PyTorch DTensor) inside the FSDP engine: `allocation_mode=...+dNtT`.

The T ranks of a tensor group hold one model replica between them, on the inner axis of a
2-D device mesh (dp x tp); FSDP2 shards over the outer (dp) axis, torchtitan style:
- attention: q/k/v column-wise (each rank computes heads/T query and kv heads), o row-wise
  (its all-reduce gives every rank the full hidden state again); MLP: gate/up column-wise,
  down row-wise. The HF modules reshape with `view(..., -1, head_dim)`, so they (and
  varlen_attention) simply see their local heads; GQA's ratio is unchanged.
- embedding row-wise (vocabulary rows), LM head column-wise with vocabulary-sharded logits:
  no rank ever holds [T, V]. `vocab_parallel_logprobs` reduces max / sum-exp / the target
  logit over the tensor group instead (the target read on the rank that owns its id).
- the ranks of a tensor group must compute the same tokens: `replica_batch` joins their
  batches (callers keep splitting data over all ranks, as at t1) and each keeps its rows.
Plans exist for Qwen2 and Llama (same module names), causal LMs and critics (the value head
stays whole); other models, and LoRA, are refused by name.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from arealite.engine.fsdp import apply_fsdp2
from arealite.engine.logprobs import compute_dtype
from arealite.utils import distributed as du
from arealite.utils.data import concat_padded_tensors

SUPPORTED_MODEL_TYPES = ("qwen2", "llama")


def layer_plan() -> dict:
    """One decoder layer: Megatron's column-then-row pairs, one all-reduce after each."""
    col, row = ColwiseParallel, RowwiseParallel
    return {
        "self_attn.q_proj": col(), "self_attn.k_proj": col(), "self_attn.v_proj": col(),
        "self_attn.o_proj": row(),
        "mlp.gate_proj": col(), "mlp.up_proj": col(), "mlp.down_proj": row(),
    }  # fmt: skip


def check_supported(model_config, tp: int, *, lora: bool) -> None:
    """Refuse, naming the key to change, what the plans cannot shard exactly."""
    fix = f"use allocation_mode=...t1, or a model it supports ({', '.join(SUPPORTED_MODEL_TYPES)})"
    if lora:
        raise ValueError(
            f"tensor parallelism (t{tp}) with LoRA is not supported: drop lora or {fix}"
        )
    mtype = getattr(model_config, "model_type", None)
    if mtype not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"tensor parallelism (t{tp}) has no plan for model_type={mtype!r}: {fix}")
    sizes = {
        "num_attention_heads": model_config.num_attention_heads,
        "num_key_value_heads": model_config.num_key_value_heads,
        "intermediate_size": model_config.intermediate_size,
        "vocab_size": model_config.vocab_size,
    }
    bad = {k: v for k, v in sizes.items() if v % tp}
    if bad:
        raise ValueError(
            f"tensor parallelism t{tp} must divide the model's {bad}: choose allocation_mode "
            f"with a t that divides them"
        )


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Shard `model` (an HF Qwen2/Llama causal LM, or a critic's backbone: its 1-output value
    head stays whole) in place over `tp_mesh`. Quiets DTensor's "2 sequential all_gather
    operations" warning: it concerns the full-tensor gathers of export and weight sync
    (FSDP's strided shard under TP's), never a training step."""
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    for layer in model.model.layers:
        parallelize_module(layer, tp_mesh, layer_plan())
    head_plan = {
        "model.embed_tokens": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Replicate()
        ),
    }
    if hasattr(model, "lm_head"):  # local [.., V/T] logits: forward_mb makes them a DTensor
        head_plan["lm_head"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=True)
    parallelize_module(model, tp_mesh, head_plan)
    if "lm_head" in head_plan and getattr(model.config, "tie_word_embeddings", False):
        model.lm_head.weight = model.model.embed_tokens.weight  # both Shard(0) over vocab
    return model


def vocab_parallel(logits: torch.Tensor, tp_mesh: DeviceMesh) -> DTensor:
    """This rank's [.., V/T] logits as the vocabulary-sharded DTensor they are part of."""
    return DTensor.from_local(logits, tp_mesh, [Shard(-1)], run_check=False)


def local_view(x: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds (differentiable)."""
    return x.to_local() if isinstance(x, DTensor) else x


def is_vocab_parallel(logits: torch.Tensor) -> bool:
    return isinstance(logits, DTensor) and logits.placements[-1] == Shard(logits.ndim - 1)


class _VocabParallelLogprob(torch.autograd.Function):
    """log softmax(z)[y] and entropy, z = logits / temperature sharded over the vocabulary,
    `chunk` rows at a time (as engine/logprobs.py: at most one fp32 [chunk, V/T] softmax).

    Forward: per row, the max (one all-reduce MAX), then sum exp(z - max), the target logit
    (non-zero on its owner only) and sum exp(z - max) * z (one all-reduce SUM). Backward is
    local: the loss is the same on every rank of the group, so each rank's output gradient
    is the whole gradient, and d/dz_k of logp and H only need p_k = exp(z_k - lse):
        d logp / d z_k = 1[k = y] - p_k,    d H / d z_k = -p_k (log p_k + H)
    """

    @staticmethod
    def forward(ctx, local, labels, temperature, start, group, with_entropy, chunk):
        dtype, width = compute_dtype(local.dtype), local.shape[-1]
        rows = [slice(s, s + chunk) for s in range(0, local.shape[0], chunk)]
        m = torch.cat([local[r].detach().amax(-1).to(dtype) / temperature for r in rows])
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        owned = (labels >= start) & (labels < start + width)
        idx = (labels - start).clamp(0, width - 1)
        stats = torch.zeros(3, local.shape[0], dtype=dtype, device=local.device)
        for r in rows:
            z = local[r].to(dtype) / temperature
            e = (z - m[r, None]).exp()
            stats[0, r] = e.sum(-1)
            stats[1, r] = z.gather(-1, idx[r, None])[:, 0] * owned[r]
            if with_entropy:
                stats[2, r] = (e * z).sum(-1)
        dist.all_reduce(stats, group=group)
        lse = m + stats[0].log()
        logp, entropy = stats[1] - lse, lse - stats[2] / stats[0]
        ctx.save_for_backward(local, idx, owned, lse, entropy)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.set_materialize_grads(False)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        local, idx, owned, lse, entropy = ctx.saved_tensors
        t, grad = ctx.temperature, torch.empty_like(local)
        for s in range(0, local.shape[0], ctx.chunk):
            r = slice(s, s + ctx.chunk)
            logp_all = local[r].to(lse.dtype) / t - lse[r, None]
            p = logp_all.exp()
            gz = torch.zeros_like(p)
            if grad_logp is not None:
                g = grad_logp[r].to(p.dtype)[:, None]
                gz -= p * g
                gz.scatter_add_(-1, idx[r, None], g * owned[r, None])
            if grad_entropy is not None:
                g_h = grad_entropy[r].to(p.dtype)[:, None]
                gz -= g_h * p * (logp_all + entropy[r, None])
            grad[r] = gz / t
        return grad, None, None, None, None, None, None


def vocab_parallel_logprobs(
    logits: DTensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: int = 1024,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`gather_logprobs(_entropy)` for vocabulary-sharded logits [T, V/T per rank]: the same
    values, a collective over the tensor group; no rank ever holds a [T, V] tensor."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    mesh = logits.device_mesh
    local = logits.to_local()
    width = local.shape[-1]
    start = mesh.get_local_rank() * width  # check_supported: T divides V
    args = (labels.reshape(-1).long(), temperature, start, mesh.get_group(), with_entropy)
    flat = local.reshape(-1, width)
    logp, entropy = _VocabParallelLogprob.apply(flat, *args, chunk_size)
    logp, entropy = logp.view(labels.shape), entropy.view(labels.shape)
    return (logp, entropy) if with_entropy else logp


def replica_batch(input_: TensorDict, tp_mesh: DeviceMesh) -> tuple[TensorDict, slice]:
    """The batch the tensor group computes (its ranks' batches, in rank order) and the rows
    that are this rank's own (a collective). Batches that cannot be joined (other keys) raise
    on every rank of the world, not only in this group, which would leave the rest hanging."""
    parts: list = [None] * tp_mesh.size()
    dist.all_gather_object(parts, input_, group=tp_mesh.get_group())
    me = tp_mesh.get_local_rank()
    start = sum(p.batch_size[0] for p in parts[:me])
    joined, error = None, None
    try:
        joined = concat_padded_tensors(parts)
    except ValueError as e:
        error = ValueError(f"the batches of a tensor group differ: {e}")
    du.raise_if_any_rank_failed(error)
    return joined, slice(start, start + input_.batch_size[0])


class TensorParallelMixin:
    """What FSDPEngine adds for tensor parallelism: the mesh, the sharding, and the two
    BaseHFEngine hooks (`_replica_batch`, `_model_output`). Needs `self.config` (a
    TrainEngineConfig) and `self.device`; `tp_mesh` is None without tensor parallelism."""

    mesh: DeviceMesh | None = None
    tp_mesh: DeviceMesh | None = None

    def _device_mesh(self) -> DeviceMesh:
        """1-D (dp) for data parallelism; 2-D (dp x tp) with `tensor_parallel_size` T > 1,
        tp the inner axis, so a tensor group is T consecutive ranks (one node's GPUs)."""
        tp, world = self.config.tensor_parallel_size, du.world_size()
        if tp == 1:
            return init_device_mesh(self.device.type, (world,), mesh_dim_names=("dp",))
        if world % tp:
            raise ValueError(
                f"allocation_mode: the trainer's t{tp} must divide its {world} ranks (d x t)"
            )
        mesh = init_device_mesh(self.device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
        self.tp_mesh = mesh["tp"]
        return mesh

    def _shard(self, model: nn.Module) -> nn.Module:
        """Tensor parallelism inside each replica first, then FSDP2 across replicas."""
        fs, dp_mesh = self.config.fsdp, self.mesh
        if self.tp_mesh is not None:
            check_supported(model.config, self.tp_mesh.size(), lora=self.config.lora is not None)
            model, dp_mesh = apply_tensor_parallel(model, self.tp_mesh), self.mesh["dp"]
        return apply_fsdp2(model, dp_mesh, fs.param_dtype, fs.reduce_dtype,
                           fs.offload_params, fs.reshard_after_forward)  # fmt: skip

    def _replica_batch(self, input_: TensorDict) -> tuple[TensorDict, slice]:
        if self.tp_mesh is None:
            return input_, slice(None)
        return replica_batch(input_, self.tp_mesh)

    def _model_output(self, out: torch.Tensor) -> torch.Tensor:
        if self.tp_mesh is None or self.config.is_critic:
            return out
        return vocab_parallel(out, self.tp_mesh)
