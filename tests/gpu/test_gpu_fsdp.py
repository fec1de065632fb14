"""FSDP2 on CUDA as the shipped GPU configs run it: fp32 master weights, bf16 compute,
varlen attention; and with parameters offloaded to the CPU."""

from __future__ import annotations

import math

import pytest
import torch
from _torchrun_fsdp import engine_config, full_weights, make_batch

from arealite.api.train_config import FSDPConfig
from arealite.engine.fsdp_engine import FSDPEngine
from arealite.engine.sft.lm_engine import sft_loss_fn, sft_loss_weight


@pytest.mark.parametrize("offload", [False, True], ids=["on_gpu", "offload"])
def test_bf16_compute_step_moves_fp32_master_weights(tiny_model_dir, build_engine, offload):
    fsdp = FSDPConfig(param_dtype="bfloat16", reduce_dtype="float32", offload_params=offload)
    engine = build_engine(
        FSDPEngine, engine_config(tiny_model_dir, fsdp=fsdp, attn_impl="sdpa_varlen")
    )
    assert engine.device.type == "cuda"
    assert all(p.dtype == torch.float32 for p in engine.model.parameters())  # masters
    before = full_weights(engine)
    stats = engine.train_batch(make_batch(n=8), sft_loss_fn, sft_loss_weight)
    assert math.isfinite(stats["loss"]) and math.isfinite(stats["grad_norm"])
    after = full_weights(engine)
    moved = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(moved) > len(before) // 2, "most weights should move in one Adam step"
    if not offload:
        assert torch.cuda.max_memory_allocated() > 0
