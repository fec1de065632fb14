"""LoRA through `peft`: adapters on an HF model before FSDP2 shards it, and the two ways weights
leave the trainer.

- Weight sync and the merged export get MERGED weights (W + alpha/r * B A, base names): a plain
  checkpoint that every backend (embedded, SGLang, vLLM) reloads the usual way. The embedded
  server cannot load adapters, so the sync path stays merged for all backends.
- `save_adapter` writes the adapter in PEFT format (adapter_config.json +
  adapter_model.safetensors), loadable with `PeftModel.from_pretrained(base, path)` and by
  vLLM's runtime adapter loading (`--enable-lora`, POST /v1/load_lora_adapter; tested).
Recovery (DCP) saves the whole PEFT model and the optimizer, which covers the adapters only.
"""

from __future__ import annotations

import logging
import re

import torch
from torch import nn

from arealite.api.lora_config import LoRAConfig, raise_unmatched_targets

logger = logging.getLogger("arealite.engine")

_ADAPTER = "default"
_PEFT_PREFIX = "base_model.model."


def apply_lora(model: nn.Module, cfg: LoRAConfig) -> nn.Module:
    """The PEFT model with adapters on `cfg.target_modules`; only adapters require grad."""
    from peft import LoraConfig, get_peft_model

    raise_unmatched_targets(cfg, model)  # peft would only say "not found"
    peft_cfg = LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        bias="none",
    )
    # A fixed seed: every rank draws the same A (FSDP2 then keeps each rank's shard of its own
    # copy, so ranks drawing differently would train a mixture), and runs are reproducible.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = get_peft_model(model, peft_cfg)
    trainable, total = count_parameters(model)
    logger.info(
        "LoRA r=%d on %s: %d trainable of %d parameters (%.2f%%)",
        cfg.rank,
        cfg.target_modules,
        trainable,
        total,
        100.0 * trainable / max(total, 1),
    )
    return model


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in model.parameters())


def optimizer_state_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of optimizer state over all ranks (AdamW: exp_avg + exp_avg_sq per trained
    parameter); sharded DTensor state counts its global size. 0 before the first step."""
    if optimizer is None:
        return 0
    return sum(
        t.numel() * t.element_size()
        for state in optimizer.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor)
    )


def merge_lora_weights(full: dict[str, torch.Tensor], cfg: LoRAConfig) -> dict[str, torch.Tensor]:
    """Full PEFT state (names of the PEFT model) -> the base model's checkpoint with
    W = W_base + alpha / r * B @ A (in float32, cast back to W's dtype)."""
    scale = cfg.alpha / cfg.rank
    out = {}
    for name, t in full.items():
        if ".lora_" in name:
            continue
        base = name.removeprefix(_PEFT_PREFIX).replace(".base_layer.", ".")
        if ".base_layer." in name:
            stem = name.rsplit(".base_layer.", 1)[0]
            a = full.get(f"{stem}.lora_A.{_ADAPTER}.weight")
            b = full.get(f"{stem}.lora_B.{_ADAPTER}.weight")
            if a is not None and b is not None and name.endswith(".weight"):
                t = (t.float() + scale * (b.float() @ a.float())).to(t.dtype)
        out[base] = t
    return out


def adapter_weights(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter tensors under PEFT's saved names (adapter name dropped)."""
    return {
        re.sub(rf"\.{_ADAPTER}\.", ".", n): t.contiguous() for n, t in full.items() if ".lora_" in n
    }
