"""Figures of one GRPO / PPO run from its metrics.jsonl, as one JSON line: held-out accuracy
(before -> each evaluation), and for windows of `--window` steps the means of the critic's
explained variance and value loss (PPO) or of the rollouts' reward components (e.g. RM score
and true accuracy of a run whose `reward:` is a reward model).

    .venv/bin/python bench/summarize_run.py RUN_DIR [--window 20]
"""

from __future__ import annotations

import argparse
import json
import os


def windows(records: list[dict], key: str, size: int) -> list[float]:
    vals = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    out: dict[int, list[float]] = {}
    for step, v in vals:
        out.setdefault(step // size, []).append(v)
    return [round(sum(v) / len(v), 3) for _, v in sorted(out.items())]


def summarize(run_dir: str, window: int) -> dict:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    before = next(
        (
            r["eval/accuracy_before_training"]
            for r in records
            if r.get("eval/accuracy_before_training") is not None
        ),
        None,
    )
    evals = [
        (r["step"], round(r["eval/accuracy"], 3))
        for r in records
        if r.get("eval/accuracy") is not None
    ]
    out = {
        "run": run_dir,
        "steps": len(records),
        "wall_s": round(records[-1]["wall_time"]),
        "accuracy_before": before,
        "accuracy_at_step": evals,
        "window_steps": window,
    }
    keys = ["ppo_critic/explained_variance", "ppo_critic/value_loss", "ppo_actor/reward_raw"]
    keys += sorted(k for k in records[-1] if k.startswith("reward/"))
    for key in keys:
        if any(key in r for r in records):
            out[key] = windows(records, key, window)
    ev = [
        r["ppo_critic/explained_variance"] for r in records if "ppo_critic/explained_variance" in r
    ]
    if ev:
        out["explained_variance_max"] = round(max(ev), 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dirs", nargs="+")
    ap.add_argument("--window", type=int, default=20)
    args = ap.parse_args()
    for run_dir in args.run_dirs:
        print(json.dumps(summarize(run_dir, args.window)))


if __name__ == "__main__":
    main()
