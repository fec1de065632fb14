"""`sdpa_fp32`: transformers' sdpa attention computed in fp32, for a bf16 model served on CPU.

torch's CPU flash kernel is slower in bf16 than in fp32, and its math kernel slower still
(`utils.hardware.attention_dtype`), so a bf16 model's decoding step spent ~40% of its time in
attention. The runner keeps its KV cache in fp32 (`kv_batch.new_cache(kv_dtype=...)`): each step
casts only the new token's keys and values into the cache and its query here, and the rest of the
model (the matmuls, where bf16 is fast) stays bf16. docs/results.md, "The long regime".
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

NAME = "sdpa_fp32"


def sdpa_fp32_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """sdpa over fp32 query / keys / values (a no-op cast for an fp32 cache), output in the
    query's dtype."""
    out, weights = sdpa_attention_forward(
        module, query.float(), key.float(), value.float(), attention_mask, **kwargs
    )
    return out.to(query.dtype), weights


def register() -> None:
    AttentionInterface.register(NAME, sdpa_fp32_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)


register()
