"""The line a demo ends with: held-out score before and after GRPO, and where the curves are.

`python -m arealite.trainer.run_summary RUN_DIR SECONDS [NAME]` reads the run's metrics.jsonl;
the demo scripts call it so every demo reports the same figures the same way.
"""

from __future__ import annotations

import sys

from arealite.trainer.plotting import read_metrics_jsonl


def held_out_change(run_dir: str) -> tuple[float, float]:
    """(held-out score before the first step, the last one evaluated) of a finished run."""
    records = read_metrics_jsonl(f"{run_dir}/metrics.jsonl")
    key = "eval/accuracy_before_training"
    before = [r[key] for r in records if r.get(key) is not None]
    after = [r["eval/accuracy"] for r in records if r.get("eval/accuracy") is not None]
    if not before or not after:
        raise SystemExit(f"{run_dir}/metrics.jsonl has no held-out evaluation before and after")
    return before[0], after[-1]


def summary(run_dir: str, seconds: int, name: str = "accuracy") -> str:
    before, after = held_out_change(run_dir)
    return (
        f"\nheld-out {name}: {before:.1%} before GRPO -> {after:.1%} after "
        f"({(after - before) * 100:+.1f} points) in {seconds // 60}m{seconds % 60:02d}s\n"
        f"curves: {run_dir}/curves.png   metrics: {run_dir}/metrics.jsonl   "
        f"tensorboard --logdir {run_dir}/tensorboard"
    )


if __name__ == "__main__":
    print(summary(sys.argv[1], int(sys.argv[2]), *sys.argv[3:4]))
