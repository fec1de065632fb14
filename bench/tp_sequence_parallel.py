"""Why the tensor-parallel plan has no sequence-parallel norms (docs/guide.md, "Tensor parallel").

    python -m torch.distributed.run --nproc-per-node 2 bench/tp_sequence_parallel.py [MODEL_DIR]

On a tiny Qwen2 (built when MODEL_DIR is absent), fp32, packed sequences through sdpa_varlen
(cu_seqlens, as the engine packs micro-batches), logits vs the unsharded model for: the shipped
plan (engine/tensor_parallel.apply_tensor_parallel), and torch's SequenceParallel for every
RMSNorm (torchtitan's layout: embedding and row-parallel outputs Shard(1) over tokens, attention
and MLP inputs gathered by PrepareModuleInput, the LM head's input gathered). One JSON line per
case. A packed micro-batch whose token count T does not divide is the last case: rank 0 raises
and rank 1 aborts inside gloo (collective size mismatch), so the launch ends failed.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from transformers import AutoModelForCausalLM

import arealite.engine.varlen_attention  # noqa: F401  (registers sdpa_varlen)
from arealite.engine.tensor_parallel import apply_tensor_parallel


def sequence_parallel(model, mesh):
    col, row = ColwiseParallel, RowwiseParallel
    gather = {"hidden_states": Replicate()}
    for layer in model.model.layers:
        parallelize_module(layer, mesh, {
            "input_layernorm": SequenceParallel(),
            "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                            desired_input_kwarg_layouts=gather),
            "self_attn.q_proj": col(), "self_attn.k_proj": col(), "self_attn.v_proj": col(),
            "self_attn.o_proj": row(output_layouts=Shard(1)),
            "post_attention_layernorm": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.gate_proj": col(), "mlp.up_proj": col(), "mlp.down_proj": row(output_layouts=Shard(1)),
        })  # fmt: skip
    parallelize_module(model, mesh, {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "model.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })  # fmt: skip
    return model


def main() -> None:
    dist.init_process_group("gloo")
    rank, tp = dist.get_rank(), dist.get_world_size()
    path = sys.argv[1] if len(sys.argv) > 1 else "/tmp/tp_sp_tiny"
    if rank == 0 and not os.path.isdir(path):
        from arealite.testing.tiny_model import build_tiny_model

        build_tiny_model(path)
    dist.barrier()
    mesh = init_device_mesh("cpu", (tp,))

    def load():
        kw = dict(attn_implementation="sdpa_varlen", dtype=torch.float32)
        return AutoModelForCausalLM.from_pretrained(path, **kw)

    ref, plain, sp = load(), apply_tensor_parallel(load(), mesh), sequence_parallel(load(), mesh)
    g = torch.Generator().manual_seed(0)
    for lens in ([10, 14, 14], [10, 14, 13]):  # 38 and 37 packed tokens
        n = sum(lens)
        ids = torch.randint(0, ref.config.vocab_size, (1, n), generator=g)
        cu = torch.tensor([0, *lens]).cumsum(0).int()
        kw = dict(position_ids=torch.cat([torch.arange(k) for k in lens])[None], use_cache=False,
                  cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lens),
                  max_length_k=max(lens))  # fmt: skip
        row = {"tokens": n, "tp": tp, "divisible": n % tp == 0}
        with torch.no_grad():
            want = ref(input_ids=ids, **kw).logits
            local = plain(input_ids=ids, **kw).logits.contiguous()  # vocabulary-sharded
            parts = [torch.empty_like(local) for _ in range(tp)]
            dist.all_gather(parts, local)
            row["plan_max_abs_diff"] = (torch.cat(parts, -1) - want).abs().max().item()
            if rank == 0:  # printed now: the sequence-parallel call may abort the process
                print(json.dumps(row), flush=True)
            try:
                got = sp(input_ids=ids, **kw).logits
                row["sequence_parallel_max_abs_diff"] = (got - want).abs().max().item()
            except RuntimeError as e:
                row["sequence_parallel_error"] = str(e)[:200]
        if rank == 0:
            print(json.dumps(row), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
