"""The embedded server's decoding step by attention implementation: SDPA (what the server runs)
vs transformers' eager attention, in bf16 and fp32, one after the other on this machine.

The step is the server's: B left-padded rows sharing one DynamicCache, one token each, the
attention mask grown by a column a step. On 2 CPU cores it is the long regime's bottleneck
(docs/results.md, "The long regime"); this says whether the attention kernel is worth changing.
Prints one JSON line per arm and the ratio eager / SDPA per dtype.

    python bench/decode_attention.py [--model-path P] [--rows 48] [--new-tokens 220]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
from bench_io import emit, emit_machine


def ms_per_step(model_path: str, dtype: torch.dtype, attn: str, rows: int, steps: int) -> float:
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(
        model_path, dtype=dtype, attn_implementation=attn
    ).eval()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(5, model.config.vocab_size - 1, (rows, 12), generator=gen)
    mask = torch.ones(rows, 12, dtype=torch.long)
    mask[: rows // 2, :3] = 0  # half the rows left-padded, as in a merged running batch
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, cache=cache, logits_to_keep=1)
        tokens, positions = out.logits[:, -1].argmax(-1), mask.sum(-1)
        start = time.perf_counter()
        for _ in range(steps):
            mask = torch.cat([mask, mask.new_ones(rows, 1)], 1)
            out = model(
                input_ids=tokens[:, None],
                attention_mask=mask,
                position_ids=positions[:, None],
                cache=cache,
                logits_to_keep=1,
            )
            tokens, positions = out.logits[:, -1].argmax(-1), positions + 1
    return (time.perf_counter() - start) / steps * 1000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default=None, help="default: the tests' tiny Qwen2")
    p.add_argument("--rows", type=int, default=48, help="running rows (long_sums async: ~48)")
    p.add_argument("--new-tokens", type=int, default=220, help="decoding steps (KV 12 -> 232)")
    args = p.parse_args()
    emit_machine()
    model_path = args.model_path
    if model_path is None:
        from arealite.testing.tiny_model import build_tiny_model

        model_path = build_tiny_model(tempfile.mkdtemp(prefix="decode_attention_"))
    for dtype in (torch.bfloat16, torch.float32):
        ms = {
            attn: ms_per_step(model_path, dtype, attn, args.rows, args.new_tokens)
            for attn in ("sdpa", "eager")
        }
        for attn, v in ms.items():
            emit("decode_step", dtype=str(dtype)[6:], attn=attn, rows=args.rows, ms=round(v, 2))
        emit("eager_over_sdpa", dtype=str(dtype)[6:], ratio=round(ms["eager"] / ms["sdpa"], 2))


if __name__ == "__main__":
    main()
