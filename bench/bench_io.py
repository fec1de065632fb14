"""What every benchmark shares: one JSON line per figure, and runs through the local launcher.

Benchmarks run as scripts (`python bench/X.py`), so this directory is on sys.path and they
import it as `bench_io`.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(REPO, "examples")


def make_workdir(path: str | None, prefix: str) -> str:
    """A bench's folder for its runs and resume file: `path` (created), or a fresh temporary one."""
    import tempfile

    path = os.path.abspath(path or tempfile.mkdtemp(prefix=prefix))
    os.makedirs(path, exist_ok=True)
    return path


def emit(figure: str, **values) -> None:
    print(json.dumps({"figure": figure, **values}), flush=True)


def emit_machine(**extra) -> None:
    """The `machine` figure every bench starts with: the CPU, and how quiet it is. With the
    kernel's autogroup on, a niced process in another session still takes an equal share of
    the cores (a 1024^3 fp32 matmul here fell from 172 to 64 GFLOP/s beside niced tests), so a
    busy machine is said on stderr before any timing. Busy is the cores in use over the last
    half second: the 1-minute load average still counts a run that ended a minute ago."""
    import psutil

    from arealite.utils.hardware import cpu_summary

    cores = os.cpu_count() or 1
    busy_cores = psutil.cpu_percent(interval=0.5) / 100 * cores
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled") as f:
            autogroup = f.read().strip() == "1"
    except OSError:
        autogroup = None
    emit(
        "machine",
        cores=cores,
        busy_cores=round(busy_cores, 2),
        load_1min=round(os.getloadavg()[0], 2),
        autogroup=autogroup,
        **cpu_summary(),
        **extra,
    )
    if busy_cores > 0.5:
        print(
            f"warning: {busy_cores:.1f} of {cores} cores busy before the bench: "
            "timings will be low"
            + (" (autogroup is on: nice does not isolate other sessions)" if autogroup else ""),
            file=sys.stderr,
        )


def launcher_command(script: str, config: str, overrides: list[str]) -> list[str]:
    """`python -m arealite.launcher.local examples/SCRIPT --config examples/configs/CONFIG ...`."""
    example = os.path.join(EXAMPLES, script)
    yaml = os.path.join(EXAMPLES, "configs", config)
    return [sys.executable, "-m", "arealite.launcher.local", example, "--config", yaml, *overrides]


def launch(script: str, config: str, overrides: list[str], log_path: str) -> float:
    """Run the local launcher (output to `log_path`); returns its wall seconds."""
    cmd = launcher_command(script, config, overrides)
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        rc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        tail = open(log_path, errors="replace").read()[-4000:]
        sys.exit(f"{script} failed with exit code {rc}; launcher log {log_path}:\n{tail}")
    return time.monotonic() - t0


def read_jsonl(path: str) -> list[dict]:
    """Complete lines only: a running job may be writing the last one."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip().endswith("}")]


def mean_of(recs: list[dict], key: str, sign: float = 1.0) -> float | None:
    """Mean of `key` over the records that logged it (rounded for the bench's JSONL)."""
    vals = [sign * r[key] for r in recs if r.get(key) is not None]
    return round(statistics.mean(vals), 5) if vals else None


def reaches(accuracy: float | None, level: float) -> bool:
    """Whether a held-out accuracy is at least `level`, ties included: runs before 2026-11-29
    logged it through float32, so 228 of 400 read 0.5699999928 and missed a level of 0.57."""
    return accuracy is not None and accuracy >= level - 1e-6


def eval_curve(recs: list[dict]) -> list[tuple]:
    """(wall seconds, steps trained, held-out accuracy): the warm start's evaluation at (0, 0),
    then every step that evaluated."""
    evals = [(0.0, 0, recs[0].get("eval/accuracy_before_training"))]
    evals += [
        (r["wall_time"], r["step"] + 1, r["eval/accuracy"])
        for r in recs
        if r.get("eval/accuracy") is not None
    ]
    return evals


def training_clock_curve(recs: list[dict]) -> list[tuple]:
    """`eval_curve` against the training clock: each evaluation's wall time less the seconds
    every evaluation so far took (`timeperf/eval`, its own included). Evaluations stall the
    trainer for different times in different arms (an asynchronous run's shares the server with
    in-flight rollouts), so time to an accuracy is reported on both clocks."""
    spent, curve = 0.0, [(0.0, 0, recs[0].get("eval/accuracy_before_training"))]
    for r in recs:
        spent += r.get("timeperf/eval", 0.0)
        if r.get("eval/accuracy") is not None:
            curve.append((r["wall_time"] - spent, r["step"] + 1, r["eval/accuracy"]))
    return curve


def rate(amount: float, wall: list[float]) -> float | None:
    """`amount` per second of wall time between the first and last record (None below two)."""
    return round(amount / (wall[-1] - wall[0]), 4) if len(wall) > 1 else None


def run_figures(recs: list[dict], decoupled: bool) -> dict:
    """The figures every GRPO arm reports: steps and their rate, the held-out curve, and
    KL(behaviour || current) k1 over steps 1.. (step 0 is on-policy). Decoupled runs log it as
    behave_kl_k1; in the others old = behaviour, so it is -approx_kl. capped_frac: tokens whose
    behaviour weight passed the decoupled loss's cap (the others have no cap)."""
    evals = eval_curve(recs)
    later = recs[1:] or recs
    kl_key, sign = ("behave_kl_k1", 1.0) if decoupled else ("approx_kl", -1.0)
    kept = mean_of(later, "behave_mask_ratio")
    return {
        "steps": len(recs),
        "steps_per_s": rate(len(recs) - 1, [r["wall_time"] for r in recs]),
        "accuracy_curve": [[round(t, 1), s, a] for t, s, a in evals],
        "training_clock_curve": [[round(t, 1), s, a] for t, s, a in training_clock_curve(recs)],
        "eval_s": round(sum(r.get("timeperf/eval", 0.0) for r in recs), 1),
        "acc_before": evals[0][2],
        "acc_end": evals[-1][2],
        "behave_kl_k1": mean_of(later, kl_key, sign),
        "capped_frac": round(1 - kept, 5) if decoupled and kept is not None else 0.0,
    }


def ends_by_the_clock(budget_s: float, eval_secs: float) -> list[str]:
    """Overrides for a run that ends itself after `budget_s` seconds of training
    (total_train_secs: the step it runs out in evaluates), evaluating every `eval_secs` of
    wall time and saving no checkpoints: arms compared at equal wall clock."""
    return [
        "total_train_steps=100000",
        f"total_train_secs={budget_s}",
        "evaluator.freq_steps=null",
        f"evaluator.freq_secs={eval_secs}",
        "saver.freq_steps=null",
    ]


def launch_for(
    config: str,
    overrides: list[str],
    metrics: str,
    log_path: str,
    budget_s: float,
    grace_s: float = 300.0,
) -> list[dict]:
    """examples/grpo.py through the local launcher; returns the run's records from `metrics`
    (its metrics.jsonl). A run given `ends_by_the_clock`'s overrides ends itself (its last step
    evaluates and the export follows); otherwise it is stopped by SIGTERM once an evaluation
    past `budget_s` of its wall time is logged. Either way it is stopped `grace_s` past the
    budget. An earlier attempt's metrics are removed: runs start afresh."""
    import signal

    ends_itself = any(o.startswith("total_train_secs=") for o in overrides)
    if os.path.exists(metrics):
        os.remove(metrics)
    cmd = launcher_command("grpo.py", config, overrides)
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            time.sleep(2)
            if not ends_itself and any(
                r.get("eval/accuracy") is not None and r["wall_time"] >= budget_s
                for r in read_jsonl(metrics)
            ):
                break
            if time.monotonic() - t0 > budget_s + grace_s:
                break  # an evaluation that never comes must not hang the bench
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    recs = read_jsonl(metrics)
    if not any(r.get("eval/accuracy") is not None for r in recs):
        tail = open(log_path, errors="replace").read()[-3000:]
        sys.exit(f"no evaluation logged (exit {proc.returncode}); log {log_path}:\n{tail}")
    return recs
