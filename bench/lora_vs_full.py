"""LoRA GRPO vs full fine-tuning on the arithmetic demo, from one SFT checkpoint.

Both arms go through the local launcher (`examples/grpo.py`): full fine-tuning with
`examples/configs/arith_grpo.yaml`, LoRA with `examples/configs/arith_grpo_lora.yaml`, the same
steps, data, seed and warm start, one after the other (never at the same time, so wall times
compare). Figures (one JSON line each, then the ratios), read from each run's metrics.jsonl:
- trainable_params / total_params / optimizer_state_bytes: logged by grpo.py after its first
  update (AdamW keeps exp_avg + exp_avg_sq for every trained parameter);
- accuracy_before / accuracy_after / gain: greedy held-out accuracy on the 166 unseen sums
  before GRPO and at the last evaluation; best_accuracy: the best periodic evaluation;
- wall_s: launcher wall seconds.
Ratios: LoRA / full for trainable parameters, optimizer state and wall time, and
lora_gain_over_full_gain (the issue's goal: >= 0.8).

Without --sft a warm start is built first (the tiny offline model, then examples/sft.py with
arith_sft.yaml, as `make demo` does); pass --sft DIR to reuse one for several comparisons.

    python bench/lora_vs_full.py [--sft DIR] [--workdir DIR] [--steps 150]
        [--set key=value ...] [--lora-set key=value ...] [--skip-full]

`--set` goes to both arms (e.g. seed=2), `--lora-set` to the LoRA arm only (e.g.
actor.optimizer.lr=3e-3 actor.lora.rank=4). Each arm takes 2-8 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys

from bench_io import emit, launch, make_workdir


def build_sft(workdir: str) -> str:
    """The demo's warm start: tiny model + a short SFT; returns the final checkpoint."""
    tiny = os.path.join(workdir, "tiny_model")
    if not os.path.isfile(os.path.join(tiny, "config.json")):
        subprocess.run([sys.executable, "-m", "arealite.testing.tiny_model", tiny], check=True)
    launch(
        "sft.py",
        "arith_sft.yaml",
        [f"cluster.fileroot={workdir}", f"model.path={tiny}"],
        os.path.join(workdir, "sft.log"),
    )
    return sorted(
        glob.glob(os.path.join(workdir, "arith-sft", "demo", "checkpoints", "final", "*"))
    )[-1]


def read_arm(run_dir: str, wall_s: float) -> dict:
    """The figures of one finished run, from its metrics.jsonl."""
    records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]

    def first(key):
        return next((r[key] for r in records if r.get(key) is not None), None)

    evals = [r["eval/accuracy"] for r in records if r.get("eval/accuracy") is not None]
    before, after = first("eval/accuracy_before_training"), evals[-1]
    return {
        "trainable_params": first("actor/trainable_params"),
        "total_params": first("actor/total_params"),
        "optimizer_state_bytes": first("actor/optimizer_state_bytes"),
        "accuracy_before": round(before, 4),
        "accuracy_after": round(after, 4),
        "best_accuracy": round(max(evals), 4),
        "gain": round(after - before, 4),
        "steps": len(records),
        "wall_s": round(wall_s, 1),
    }


def run_arm(name: str, config: str, sft: str, workdir: str, overrides: list[str]) -> dict:
    args = [f"cluster.fileroot={workdir}", f"actor.path={sft}", f"trial_name={name}", *overrides]
    wall = launch("grpo.py", config, args, os.path.join(workdir, f"{name}.log"))
    arm = read_arm(os.path.join(workdir, "arith-grpo", name), wall)
    emit(name, **arm, overrides=overrides)
    return arm


def ratio(a, b):
    return round(a / b, 4) if a is not None and b else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sft", help="SFT checkpoint to start both arms from (default: build one)")
    p.add_argument("--workdir", help="where runs go (default: a fresh temp dir)")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--set", nargs="*", default=[], help="overrides for both arms")
    p.add_argument("--lora-set", nargs="*", default=[], help="overrides for the LoRA arm")
    p.add_argument("--skip-full", action="store_true", help="LoRA arm only (tuning)")
    a = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    workdir = make_workdir(a.workdir, "lora_vs_full_")
    sft = a.sft or build_sft(workdir)
    common = [f"total_train_steps={a.steps}", *a.set]
    lora = run_arm("lora", "arith_grpo_lora.yaml", sft, workdir, common + a.lora_set)
    if a.skip_full:
        return
    full = run_arm("full", "arith_grpo.yaml", sft, workdir, common)
    emit(
        "lora_vs_full",
        trainable_fraction_lora=ratio(lora["trainable_params"], lora["total_params"]),
        trainable_params_lora_over_full=ratio(lora["trainable_params"], full["trainable_params"]),
        optimizer_state_lora_over_full=ratio(
            lora["optimizer_state_bytes"], full["optimizer_state_bytes"]
        ),
        lora_gain_over_full_gain=ratio(lora["gain"], full["gain"]),
        wall_lora_over_full=ratio(lora["wall_s"], full["wall_s"]),
        sft=sft,
        workdir=workdir,
    )


if __name__ == "__main__":
    main()
