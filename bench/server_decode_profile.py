"""Where a decoding step of the embedded server goes: `ModelRunner.step` timed step by step on
one batch of long_sums prompts (every row sampled at T 1 until it stops, as in a GRPO rollout),
then one profiled stretch of steps with the top operators by self CPU time (and CUDA time on a
GPU). Prints ms per step against the rows still running, and tokens/s.

    python bench/server_decode_profile.py MODEL_PATH [--rows 64] [--device cuda] [--dtype float32]
        [--max-new 320]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from bench_io import emit, emit_machine

from arealite.server.model_runner import ModelRunner
from arealite.server.protocol import GenerateRequest, SamplingParams
from arealite.tasks.long_sums import generate_problems, prompt_text


def requests(
    runner: ModelRunner, rows: int, max_new: int, samples: int, ignore_eos: bool = False
) -> list:
    """`rows` requests: rows / samples distinct prompts, each `samples` times (a GRPO group);
    with `ignore_eos` every row decodes `max_new` tokens (equal work whatever is sampled)."""
    problems = generate_problems(max(rows // samples, 1), 0, "test")
    params = SamplingParams(max_new_tokens=max_new, temperature=1.0, ignore_eos=ignore_eos)
    out = []
    for i in range(rows):
        messages = [
            {"role": "user", "content": prompt_text(*problems[(i // samples) % len(problems)])}
        ]
        text = runner.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        ids = runner.tokenizer(text, add_special_tokens=False)["input_ids"]
        out.append(
            runner.new_sequence(GenerateRequest(rid=str(i), input_ids=list(ids), params=params))
        )
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_all(runner: ModelRunner, seqs: list) -> list[tuple[int, float]]:
    """(rows, seconds) of every step until the batch is empty."""
    steps, new = [], seqs
    while new or runner.num_running:
        rows = runner.num_running + len(new)
        t0 = time.perf_counter()
        with torch.inference_mode():
            runner.step(new)
        sync(runner.device)
        steps.append((rows, time.perf_counter() - t0))
        new = []
    return steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model_path")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--samples", type=int, default=8, help="rows per distinct prompt")
    p.add_argument("--max-new", type=int, default=320)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="auto", help="the server's `server.dtype`")
    p.add_argument("--profile-steps", type=int, default=20)
    p.add_argument("--table-out", default=None, help="write the profiler tables here, not stdout")
    args = p.parse_args()
    emit_machine()
    runner = ModelRunner(args.model_path, dtype=args.dtype, device=args.device)
    decode_all(runner, requests(runner, min(args.rows, 8), 8, args.samples))  # warm-up
    steps = decode_all(runner, requests(runner, args.rows, args.max_new, args.samples))
    decode = steps[1:]
    total = sum(s for _, s in steps)
    for lo, hi in ((1, 8), (9, 32), (33, 128), (129, 1 << 20)):
        sel = [s for r, s in decode if lo <= r <= hi]
        if sel:
            emit(
                "decode_ms",
                rows=f"{lo}-{hi}",
                steps=len(sel),
                median_ms=round(1e3 * statistics.median(sel), 2),
            )
    emit(
        "decode",
        device=str(runner.device),
        dtype=str(runner.dtype),
        rows=args.rows,
        steps=len(steps),
        prefill_ms=round(1e3 * steps[0][1], 1),
        tokens_per_s=round(sum(r for r, _ in steps) / total, 1),
    )
    activities = [torch.profiler.ProfilerActivity.CPU]
    if runner.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    seqs = requests(runner, args.rows, args.max_new, args.samples)
    with torch.inference_mode():
        runner.step(seqs)
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(args.profile_steps):
                if runner.num_running:
                    runner.step([])
            sync(runner.device)
    averages = prof.key_averages()
    tables = [averages.table(sort_by="self_cpu_time_total", row_limit=25)]
    if runner.device.type == "cuda":
        tables.append(averages.table(sort_by="self_cuda_time_total", row_limit=15))
    if args.table_out:
        with open(args.table_out, "w") as f:
            f.write("\n".join(tables))
    else:
        print("\n".join(tables), flush=True)
    runner.drop_running()


if __name__ == "__main__":
    main()
