"""The embedded server's decoding step by attention implementation: SDPA (what the server runs)
vs transformers' eager attention, in bf16 and fp32, one after the other on this machine.

`ModelRunner.step` itself (server_decode_profile.py's loop): `--rows` long_sums requests, every
row decoding `--new-tokens` tokens (EOS ignored, so both arms do the same work). On 2 CPU cores
the server's step is the long regime's bottleneck (docs/results.md, "The long regime"); this
says whether the attention kernel is worth changing. Prints the median ms per decoding step of
each arm and eager / SDPA per dtype.

    python bench/decode_attention.py MODEL_PATH [--rows 48] [--new-tokens 220]
"""

from __future__ import annotations

import argparse
import statistics

from bench_io import emit, emit_machine
from server_decode_profile import decode_all, requests

from arealite.server.model_runner import ModelRunner


def median_step_ms(runner: ModelRunner, rows: int, new_tokens: int) -> float:
    decode_all(runner, requests(runner, 8, 8, 8))  # warm-up
    steps = decode_all(runner, requests(runner, rows, new_tokens, 8, ignore_eos=True))
    return 1e3 * statistics.median(s for _, s in steps[1:])  # steps[0] is the prefill


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model_path")
    p.add_argument("--rows", type=int, default=48, help="running rows (long_sums async: ~48)")
    p.add_argument("--new-tokens", type=int, default=220, help="decoding steps a row")
    args = p.parse_args()
    emit_machine()
    for dtype in ("bfloat16", "float32"):
        runner = ModelRunner(args.model_path, dtype=dtype, device="cpu")
        ms = {}
        for attn in ("sdpa", "eager"):
            runner.model.set_attn_implementation(attn)
            ms[attn] = median_step_ms(runner, args.rows, args.new_tokens)
            emit("decode_step", dtype=dtype, attn=attn, rows=args.rows, ms=round(ms[attn], 2))
        emit("eager_over_sdpa", dtype=dtype, ratio=round(ms["eager"] / ms["sdpa"], 2))


if __name__ == "__main__":
    main()
