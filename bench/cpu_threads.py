"""The GRPO loop on a CPU node under each thread policy (`launcher.cpu_threads`), and its trainer
step against one plain PyTorch step given the whole machine.

The demo's loop (`examples/configs/arith_grpo.yaml`: 1 embedded server + 1 trainer rank, 16
prompts x 8 samples, 8 new tokens) runs `--steps` steps from the tiny offline model under each
policy, one after the other, with dtype auto. Figures (one JSON line each):
- `loop_<policy>`: median seconds per step (step-to-step gap), median seconds of the trainer's
  `train_step` phase and of the `rollout` wait inside the loop.
- `plain_step`: one plain PyTorch step (HF forward on the padded batch, policy-gradient loss,
  backward, clipping, AdamW; bench/train_step_vs_plain.py's baseline) on a batch of the loop's
  shape, with every core, in this process.
- `ratio`: split / shared seconds per step, and each policy's in-loop train_step / plain step
  (goal <= 1.3).

    python bench/cpu_threads.py [--steps 30] [--policies split,shared] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from bench_io import emit, emit_machine, launch, make_workdir
from train_step_vs_plain import PlainStep, make_batch

LOOP_BATCH = dict(n=128, lo=10, hi=17, prompt=9)  # 16 prompts x 8 samples, <= 8 new tokens


def run_loop(policy: str, model: str, steps: int, workdir: str) -> dict:
    args = [
        f"cluster.fileroot={workdir}",
        "experiment_name=threads",
        f"trial_name={policy}",
        f"actor.path={model}",
        f"launcher.cpu_threads={policy}",
        f"total_train_steps={steps}",
        "valid_dataset=null",
        "saver.freq_steps=null",
        "rollout.dynamic_sampling=false",  # the random model scores 0: every batch the same size
    ]
    secs = launch("grpo.py", "arith_grpo.yaml", args, os.path.join(workdir, f"{policy}.log"))
    with open(os.path.join(workdir, "threads", policy, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()][2:]  # warm-up steps out
    wall = [r["wall_time"] for r in records]
    med = lambda key: round(statistics.median(r.get(key) or 0 for r in records), 4)  # noqa: E731
    return {
        "sec_per_step": round(statistics.median(b - a for a, b in zip(wall, wall[1:])), 4),
        "train_step_s": med("timeperf/train_step"),
        "rollout_wait_s": med("timeperf/rollout"),
        "update_weights_s": med("timeperf/update_weights"),
        "launcher_s": round(secs, 1),
    }


def plain_step_seconds(model: str, rounds: int = 7) -> float:
    plain = PlainStep(model)
    batch = make_batch(LOOP_BATCH, plain.model.config.vocab_size)
    plain(batch)  # warm-up
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        plain(batch)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--policies", default="split,shared")
    p.add_argument("--workdir", default=None)
    args = p.parse_args()
    workdir = make_workdir(args.workdir, "bench_threads_")
    emit_machine()
    from arealite.testing.tiny_model import build_tiny_model

    model = build_tiny_model(os.path.join(workdir, "tiny_model"))
    plain = plain_step_seconds(model)
    emit("plain_step", seconds=round(plain, 4), threads=torch.get_num_threads())
    loops = {}
    for policy in args.policies.split(","):
        loops[policy] = run_loop(policy, model, args.steps, workdir)
        emit(f"loop_{policy}", **loops[policy])
    ratios = {
        f"{k}_train_step_vs_plain": round(v["train_step_s"] / plain, 3) for k, v in loops.items()
    }
    if {"split", "shared"} <= loops.keys():
        ratios["split_over_shared_sec_per_step"] = round(
            loops["split"]["sec_per_step"] / loops["shared"]["sec_per_step"], 3
        )
    emit("ratio", **ratios)


if __name__ == "__main__":
    main()
