"""Staleness ablation: does the decoupled PPO loss keep asynchronous GRPO learning at eta >= 4?

The claim behind arealite (AReaL, arXiv 2505.24298): rollouts up to eta versions stale, corrected
by the decoupled loss, learn as well per step as synchronous training (eta = 0) and faster per
second, while naive PPO (the trust region centred on the stale behaviour policy) degrades. One
seed proves nothing, so every arm runs 3 seeds.

Arms, on the demo (examples/grpo.py + examples/configs/arith_grpo.yaml, dynamic sampling on as
the demo has it: it applies to every arm alike) from one SFT warm start:
- eta0: rollout.max_head_offpolicyness=0 (synchronous; decoupled loss on, behaviour = proximal policy);
- etaK_decoupled, K in 1 2 4 8: max_head_offpolicyness=K, use_decoupled_loss=true;
- etaK_naive: use_decoupled_loss=false, recompute_logprob=false, so PPO's old policy is the
  behaviour policy. (recompute_logprob=true would make old = the current weights with one
  minibatch: ratio 1, no clip, no correction at all; that is not PPO.)
Each run gets the same budget of training seconds (total_train_secs: it then ends itself with
a last evaluation) with greedy held-out accuracy (200 problems) every `--eval-secs`.

Output: a JSON line per arm and seed (appended to WORKDIR/results.jsonl; an arm + seed + budget
found there is not re-run), a JSON line and a table row per arm (mean +- std over seeds of the
accuracy at the end, at half budget and at the largest step every run reached; steps per second;
behaviour KL(behaviour || current) k1; mean importance weight current / behaviour; fraction of
tokens masked by the cap `behav_imp_weight_cap`; PPO clip fraction), and WORKDIR/
staleness_ablation.png (accuracy vs wall time and vs step, one colour per arm).

Sizes: 9 arms x 3 seeds = 27 runs of --budget 90 s; each also spends ~15 s starting and one
evaluation past the budget, so ~2 minutes a run and ~55 minutes in all on a 2-core CPU
(plus ~30 s for the warm start). --quick: one seed, eta4_decoupled vs eta4_naive, 120 s each:
about 5 minutes with the warm start.

    python bench/staleness_ablation.py [--quick] [--budget 90] [--eval-secs 15] [--seeds 1,2,3]
        [--arms eta0,eta4_decoupled,...] [--model-path DIR] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics

import bench_io
from bench_io import (
    emit,
    emit_machine,
    ends_by_the_clock,
    launch_for,
    make_workdir,
    read_jsonl,
)
from e2e_async_vs_sync import build_warm_start

ETAS = (0, 1, 2, 4, 8)
ARMS = {"eta0": (0, True)} | {
    f"eta{k}_{kind}": (k, kind == "decoupled") for k in ETAS[1:] for kind in ("decoupled", "naive")
}
QUICK_ARMS = ("eta4_decoupled", "eta4_naive")


def arm_overrides(
    arm: str, seed: int, model: str, workdir: str, eval_secs: int, budget: float
) -> list[str]:
    eta, decoupled = ARMS[arm]
    return [
        f"cluster.fileroot={workdir}",
        "experiment_name=staleness",
        f"trial_name={arm}_s{seed}",
        f"actor.path={model}",
        f"seed={seed}",
        *ends_by_the_clock(budget, eval_secs),
        # A time budget, not a step count: a constant lr (the demo's decays over its 130 steps).
        "actor.optimizer.lr=1e-4",
        "actor.optimizer.lr_scheduler_type=constant",
        f"rollout.max_head_offpolicyness={eta}",
        f"actor.use_decoupled_loss={str(decoupled).lower()}",
        f"actor.recompute_logprob={str(decoupled).lower()}",
    ]


def run_arm(arm: str, seed: int, model: str, args) -> list[dict]:
    """The launcher, for the budget of training seconds (then a last evaluation); its records."""
    run = f"{arm}_s{seed}"
    return launch_for(
        "arith_grpo.yaml",
        arm_overrides(arm, seed, model, args.workdir, args.eval_secs, args.budget),
        os.path.join(args.workdir, "staleness", run, "metrics.jsonl"),
        os.path.join(args.workdir, f"{run}.log"),
        args.budget,
    )


def summarize_run(arm: str, seed: int, recs: list[dict], budget: float) -> dict:
    """One run's figures. Off-policy statistics are means over steps 1.. (step 0 is on-policy).
    Decoupled: behave_kl_k1 / behave_imp_weight (proximal / behaviour, over kept tokens),
    capped = 1 - behave_mask_ratio. Naive: old = behaviour, so importance_weight is current /
    behaviour and KL(behaviour || current) k1 = -approx_kl; the cap never applies."""
    eta, decoupled = ARMS[arm]
    evals = bench_io.eval_curve(recs)
    half = min(evals, key=lambda e: abs(e[0] - budget / 2))
    later = recs[1:] or recs
    run = dict(arm=arm, eta=eta, decoupled=decoupled, seed=seed, budget_s=budget)
    return {
        **run,
        **bench_io.run_figures(recs, decoupled),
        "acc_half": half[2],
        "staleness": bench_io.mean_of(later, "staleness"),
        "imp_weight": bench_io.mean_of(
            later, "behave_imp_weight" if decoupled else "importance_weight"
        ),
        "clip_ratio": bench_io.mean_of(later, "clip_ratio"),
        "reward": bench_io.mean_of(later, "ppo_actor/reward_raw"),
    }


def acc_at_step(curve: list, step: int) -> float:
    """Held-out accuracy at `step`, linearly interpolated between evaluations."""
    for (_, s0, a0), (_, s1, a1) in zip(curve, curve[1:]):
        if s0 <= step <= s1:
            return a0 + (a1 - a0) * (step - s0) / max(s1 - s0, 1)
    return curve[-1][2]


def mean_std(vals: list[float]) -> tuple[float, float]:
    return statistics.mean(vals), statistics.stdev(vals) if len(vals) > 1 else 0.0


def arm_table(results: list[dict]) -> list[dict]:
    """Per arm over seeds; the per-step view compares all arms at the largest step every
    run's last evaluation reached."""
    common = min(r["accuracy_curve"][-1][1] for r in results)
    rows = []
    for arm in [a for a in ARMS if any(r["arm"] == a for r in results)]:
        rs = [r for r in results if r["arm"] == arm]
        row = {"arm": arm, "seeds": len(rs), "common_step": common}
        for key, vals in (
            ("acc_end", [r["acc_end"] for r in rs]),
            ("acc_half", [r["acc_half"] for r in rs]),
            ("acc_at_common_step", [acc_at_step(r["accuracy_curve"], common) for r in rs]),
        ):
            m, s = mean_std(vals)
            row[key], row[f"{key}_std"] = round(m, 4), round(s, 4)
        for key in ("steps_per_s", "behave_kl_k1", "imp_weight", "capped_frac", "clip_ratio"):
            vals = [r[key] for r in rs if r.get(key) is not None]  # older files: masked_frac
            row[key] = round(statistics.mean(vals), 5) if vals else None
        rows.append(row)
        emit("arm", **row)
    return rows


def print_table(rows: list[dict]) -> None:
    step = rows[0]["common_step"]
    print(
        f"| arm | seeds | acc end | acc half | acc @ step {step} | steps/s | behave KL k1 "
        "| IW cur/behav | masked by cap | clip frac |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        pm = [
            f"{r[k]:.3f} ± {r[k + '_std']:.3f}"
            for k in ("acc_end", "acc_half", "acc_at_common_step")
        ]
        rest = [
            f"{r[k]:.4g}" if r[k] is not None else "-"
            for k in ("steps_per_s", "behave_kl_k1", "imp_weight", "capped_frac", "clip_ratio")
        ]
        print("| " + " | ".join([r["arm"], str(r["seeds"]), *pm, *rest]) + " |", flush=True)


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = plt.get_cmap("tab10")
    for i, arm in enumerate(a for a in ARMS if any(r["arm"] == a for r in results)):
        for j, r in enumerate(r for r in results if r["arm"] == arm):
            t, s, a = zip(*r["accuracy_curve"])
            kw = dict(
                color=colors(i % 10),
                alpha=0.8,
                lw=1.2,
                label=arm if j == 0 else None,
                ls="--" if arm.endswith("naive") else "-",
            )
            ax_t.plot(t, a, **kw)
            ax_s.plot(s, a, **kw)
    for ax, xlabel in ((ax_t, "wall time (s)"), (ax_s, "training step")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("greedy held-out accuracy")
        ax.grid(alpha=0.3)
    ax_t.legend(fontsize=8)
    fig.suptitle("Staleness ablation (one line per seed)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def warm_start(args) -> str:
    """--model-path, or the warm start built by an earlier run in this workdir, or a new one."""
    if args.model_path:
        return args.model_path
    found = glob.glob(os.path.join(args.workdir, "bench-sft", "warm", "checkpoints", "final", "*"))
    return found[0] if found else build_warm_start(args.workdir, [])


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="one seed, eta4 decoupled vs naive")
    p.add_argument(
        "--budget", type=float, default=None, help="training seconds per run (90; quick 120)"
    )
    p.add_argument("--eval-secs", type=int, default=None, help="eval period (15; quick 20)")
    p.add_argument("--seeds", default=None, help="comma-separated (1,2,3; quick 1)")
    p.add_argument("--arms", default=None, help=f"comma-separated of {','.join(ARMS)}")
    p.add_argument("--model-path", default=None, help="warm start (default: build one)")
    p.add_argument("--workdir", default=None, help="results and runs (resumable)")
    args = p.parse_args()
    q = args.quick
    args.budget = args.budget or (120.0 if q else 90.0)
    args.eval_secs = args.eval_secs or (20 if q else 15)
    args.seeds = [int(s) for s in (args.seeds or ("1" if q else "1,2,3")).split(",")]
    args.arms = args.arms.split(",") if args.arms else list(QUICK_ARMS if q else ARMS)
    if bad := [a for a in args.arms if a not in ARMS]:
        p.error(f"unknown arms {bad}; choose from {list(ARMS)}")
    args.workdir = make_workdir(args.workdir, "staleness_")
    return args


def main() -> None:

    args = parse_args()
    emit_machine(workdir=args.workdir)
    results_path = os.path.join(args.workdir, "results.jsonl")
    model = warm_start(args)
    done = {(r["arm"], r["seed"], r["budget_s"]): r for r in read_jsonl(results_path)}
    results = []
    for seed in args.seeds:  # seed-major: a cut-short bench still has every arm at seed 1
        for arm in args.arms:
            if (arm, seed, args.budget) not in done:
                rec = summarize_run(arm, seed, run_arm(arm, seed, model, args), args.budget)
                with open(results_path, "a") as f:
                    f.write(json.dumps(rec) + "\n")
                done[(arm, seed, args.budget)] = rec
                emit("run", **rec)
            results.append(done[(arm, seed, args.budget)])
    print_table(arm_table(results))
    plot(results, os.path.join(args.workdir, "staleness_ablation.png"))
    emit("done", png=os.path.join(args.workdir, "staleness_ablation.png"), runs=len(results))


if __name__ == "__main__":
    main()
