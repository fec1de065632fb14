"""End-to-end GRPO on the arithmetic task: asynchronous (eta = 4) vs synchronous (eta = 0).

Both runs go through the local launcher (`examples/grpo.py` + `examples/configs/
arith_grpo.yaml`) from the same warm-start model with the same seeds, one after the other in
this process, and differ only in `rollout.max_head_offpolicyness` (0 = synchronous).

Figures (one JSON line each, then the ratios), read from each run's metrics.jsonl:
- sec_per_step: (wall_time[last] - wall_time[0]) / (steps - 1): step 0 is left out because it
  carries the pre-training evaluation and the first-call warm-ups; periodic evaluations are in
  (identical work in both runs). sec_per_step_median: median step-to-step gap (eval steps are
  outliers there). timeperf_*: mean seconds per step in each phase (rollout = waiting for the
  batch, the time asynchrony hides).
- time_to_target_s / steps_to_target: wall_time (seconds since the run's stats logger started,
  which includes the pre-training evaluation in both runs) and step count of the first
  evaluation with eval/accuracy >= --target-accuracy; null when not reached.
- ratio: sync / async for seconds per step (the speedup of asynchrony) and time to target;
  with --rounds N > 1 the runs alternate order (async first, then sync first, ...) and the
  ratios are of the medians over rounds.

Without --model-path a warm start is built first: the tiny offline model
(arealite.testing.tiny_model) fine-tuned by examples/sft.py with its YAML defaults.

    python bench/e2e_async_vs_sync.py [--model-path DIR] [--steps 80] [--eval-every 10]
        [--target-accuracy 0.15] [--eta 4] [--rounds 1] [--workdir DIR] [--set key=value ...]

Timings are noisy on shared machines: compare the ratios, and repeat before trusting one.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics

from bench_io import emit, launch, make_workdir, reaches


def read_metrics(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def build_warm_start(workdir: str, extra: list[str], sft_config: str = "arith_sft.yaml") -> str:
    """Tiny model + SFT with `sft_config`'s defaults; returns the exported checkpoint."""
    from arealite.testing.tiny_model import build_tiny_model

    tiny = build_tiny_model(os.path.join(workdir, "tiny_model"))
    args = [
        f"cluster.fileroot={workdir}",
        "experiment_name=bench-sft",
        "trial_name=warm",
        f"model.path={tiny}",
        *extra,
    ]
    secs = launch("sft.py", sft_config, args, os.path.join(workdir, "sft.log"))
    run_dir = os.path.join(workdir, "bench-sft", "warm")
    (path,) = glob.glob(os.path.join(run_dir, "checkpoints", "final", "*"))
    records = read_metrics(run_dir)
    emit(
        "sft_warm_start",
        seconds=round(secs, 1),
        steps=len(records),
        final_loss=records[-1].get("loss"),
        model_path=path,
    )
    return path


def summarize(name: str, records: list[dict], target: float, launcher_s: float) -> dict:
    """The figures of one run from its per-step records."""
    wall = [r["wall_time"] for r in records]
    gaps = [b - a for a, b in zip(wall, wall[1:])]
    evals = [
        (r["step"], r["wall_time"], r["eval/accuracy"])
        for r in records
        if r.get("eval/accuracy") is not None
    ]
    hit = next(((s, t) for s, t, acc in evals if reaches(acc, target)), None)
    later = records[1:] or records
    phases = ("rollout", "compute_logp", "train_step", "update_weights")
    return {
        "run": name,
        "steps": len(records),
        "sec_per_step": round((wall[-1] - wall[0]) / max(1, len(wall) - 1), 3),
        "sec_per_step_median": round(statistics.median(gaps), 3) if gaps else None,
        **{
            f"timeperf_{p}": round(statistics.mean(r.get(f"timeperf/{p}") or 0 for r in later), 3)
            for p in phases
        },
        "staleness_mean": round(statistics.mean(r.get("staleness") or 0 for r in records), 3),
        "accuracy_before": records[0].get("eval/accuracy_before_training"),
        "accuracy_curve": [[s, round(t, 1), round(a, 4)] for s, t, a in evals],
        "final_accuracy": evals[-1][2] if evals else None,
        "target_accuracy": target,
        "target_met_before_training": reaches(
            records[0].get("eval/accuracy_before_training"), target
        ),
        "steps_to_target": hit[0] + 1 if hit else None,
        "time_to_target_s": round(hit[1], 1) if hit else None,
        "reward_mean": round(
            statistics.mean(r.get("ppo_actor/reward_raw") or 0 for r in records), 4
        ),
        "launcher_wall_s": round(launcher_s, 1),
    }


def run_grpo(args, workdir: str, model: str, name: str, eta: int) -> dict:
    overrides = [
        f"cluster.fileroot={workdir}",
        "experiment_name=bench-grpo",
        f"trial_name={name}",
        f"actor.path={model}",
        f"total_train_steps={args.steps}",
        f"evaluator.freq_steps={args.eval_every}",
        "saver.freq_steps=null",
        f"rollout.max_head_offpolicyness={eta}",
        *args.set,
    ]
    secs = launch("grpo.py", "arith_grpo.yaml", overrides, os.path.join(workdir, f"{name}.log"))
    records = read_metrics(os.path.join(workdir, "bench-grpo", name))
    return summarize(name, records, args.target_accuracy, secs)


def ratio(a, b):
    return round(a / b, 3) if a is not None and b else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", help="warm-start model (default: build one with SFT)")
    p.add_argument("--steps", type=int, default=80, help="GRPO steps per run")
    p.add_argument("--eval-every", type=int, default=10, help="held-out evaluation period")
    p.add_argument(
        "--target-accuracy",
        type=float,
        default=0.15,
        help="held-out accuracy to reach (the YAML-default warm start begins near 0.1)",
    )
    p.add_argument("--eta", type=int, default=4, help="max_head_offpolicyness of the async run")
    p.add_argument("--rounds", type=int, default=1, help="async/sync pairs, order alternating")
    p.add_argument("--workdir", help="keep runs here (default: a fresh temp dir)")
    p.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="extra GRPO overrides for both runs",
    )
    p.add_argument(
        "--sft-set",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="overrides for the warm-start SFT",
    )
    args = p.parse_args()
    if args.eta < 1:
        p.error("--eta must be >= 1 (the sync run is eta = 0)")
    workdir = make_workdir(args.workdir, "e2e_async_vs_sync_")
    model = args.model_path or build_warm_start(workdir, args.sft_set)

    runs: dict[str, list[dict]] = {"async": [], "sync": []}
    for r in range(args.rounds):  # alternate the order: load drifts on shared machines
        order = [("async", args.eta), ("sync", 0)]
        for kind, eta in order if r % 2 == 0 else order[::-1]:
            name = f"{kind}_eta{eta}" + (f"_r{r}" if args.rounds > 1 else "")
            runs[kind].append(run_grpo(args, workdir, model, name, eta))
            emit(f"grpo_{name}", **runs[kind][-1])

    def med(kind: str, key: str):
        vals = [x[key] for x in runs[kind] if x[key] is not None]
        return statistics.median(vals) if vals else None

    emit(
        "ratio",
        rounds=args.rounds,
        **{
            f"{key}_sync_over_async": ratio(med("sync", key), med("async", key))
            for key in (
                "sec_per_step",
                "sec_per_step_median",
                "time_to_target_s",
                "steps_to_target",
            )
        },
        workdir=workdir,
    )


if __name__ == "__main__":
    main()
