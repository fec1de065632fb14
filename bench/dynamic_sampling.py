"""The demo's GRPO with and without dynamic sampling (DAPO's informative-groups filter).

Both runs go through the local launcher (`examples/grpo.py` + `examples/configs/arith_grpo.yaml`)
from the same warm start with the same seed, one after the other, and differ only in
`rollout.dynamic_sampling`. With it on, a group whose samples all got the same reward is dropped
before it reaches the trainer and replaced by a new one (bounded by
`rollout.dynamic_sampling_max_oversample`): generation does more, the trainer spends every step on
groups with a gradient.

Figures (JSON lines): per run wall seconds (launcher start to exit), steps, seconds per step,
held-out accuracy before / after, groups generated / dropped; then the ratios off / on.

    python bench/dynamic_sampling.py [--model-path DIR] [--steps 150] [--seed 1] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import os

from bench_io import emit, emit_machine, launch, make_workdir
from e2e_async_vs_sync import build_warm_start, read_metrics


def run(model: str, dynamic: bool, steps: int, seed: int, workdir: str) -> dict:
    name = "filter_on" if dynamic else "filter_off"  # not on/off: YAML reads those as booleans
    overrides = [
        f"cluster.fileroot={workdir}",
        "experiment_name=dynamic-sampling",
        f"trial_name={name}",
        f"actor.path={model}",
        f"seed={seed}",
        f"total_train_steps={steps}",
        f"rollout.dynamic_sampling={str(dynamic).lower()}",
        f"evaluator.freq_steps={steps}",
    ]
    secs = launch("grpo.py", "arith_grpo.yaml", overrides, os.path.join(workdir, f"{name}.log"))
    recs = read_metrics(os.path.join(workdir, "dynamic-sampling", name))
    evals = [r["eval/accuracy"] for r in recs if r.get("eval/accuracy") is not None]
    rec = {
        "dynamic_sampling": dynamic,
        "wall_s": round(secs, 1),
        "steps": len(recs),
        "sec_per_step": round(
            (recs[-1]["wall_time"] - recs[0]["wall_time"]) / max(1, len(recs) - 1), 3
        ),
        "accuracy_before": recs[0].get("eval/accuracy_before_training"),
        "accuracy_after": evals[-1] if evals else None,
        "groups_generated": sum(r.get("rollout/groups_generated", 0) for r in recs),
        "groups_dropped": sum(r.get("rollout/groups_dropped", 0) for r in recs),
    }
    emit("run", **rec)
    return rec


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default=None, help="a warm start (default: build one)")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--workdir", default=None)
    args = p.parse_args()
    workdir = make_workdir(args.workdir, "bench_dynamic_sampling_")
    emit_machine()
    model = args.model_path or build_warm_start(workdir, [])
    off, on = (run(model, d, args.steps, args.seed, workdir) for d in (False, True))
    emit(
        "ratio",
        wall_off_over_on=round(off["wall_s"] / on["wall_s"], 2),
        sec_per_step_off_over_on=round(off["sec_per_step"] / on["sec_per_step"], 2),
        accuracy_gain_off=round(off["accuracy_after"] - off["accuracy_before"], 3),
        accuracy_gain_on=round(on["accuracy_after"] - on["accuracy_before"], 3),
    )


if __name__ == "__main__":
    main()
