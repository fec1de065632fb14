"""Time to accuracy: TRL's `GRPOTrainer` vs arealite's GRPO loop on a built-in task (`--task`).

Both start from the same SFT warm start (the tiny offline model fine-tuned by the task's SFT
config), train on the same prompts with the same batch, max length and reward (`arith`: sums of
three one-digit numbers, 16 prompts x 8 samples, 8 new tokens; `long_sums`: worked sums of 2-20
digits, 8 prompts x 8 samples, 320 new tokens; both temperature 1, exact match), lr 1e-4,
clip 0.2, no KL, fp32 weights computed in bf16 where it is native (arealite's `param_dtype:
auto`; TRL's `bf16=True` autocast), on this machine, one after the
other, each for `--minutes` of wall clock or `--steps` optimizer steps, whichever ends first. Both
decay the lr linearly to 0 over `--steps` (TRL's default schedule; the default, 1300, is about
what TRL does in 10 minutes on a 2-core CPU, so its schedule ends near its budget); `--steps 0`:
constant lr, no step limit (the earlier protocol: late in a run the accuracy of both swings).
Held-out accuracy (the task's held-out split) is taken every 60 s in both, as the task's GRPO
config's `evaluator` says (arith: one greedy answer; long_sums: avg@4 at temperature 1): TRL
through a callback that runs `model.generate`, arealite through its evaluator
(`evaluator.freq_secs=60`, through the server).

Figures (JSON lines): per system and seed the accuracy at each minute, seconds per step, and
CPU-seconds per informative sample (samples in groups whose rewards differ: the ones with a
gradient); then, over seeds, the mean time to reach each accuracy level and the ratios
TRL / arealite (> 1: arealite is faster), and per seed (`goal_per_seed`) when arealite first
reached that TRL run's final accuracy, as a fraction of that run's time (the goal: <= 2/3).
Needs the `bench` extra (`pip install -e .[bench]`).

    python bench/vs_trl.py [--task arith|long_sums] [--minutes 10] [--seeds 1,2,3] [--systems trl,arealite] [--workdir DIR]
                           [--gpu]  # both on GPU 0 (bf16 where it is native)
                           [--arealite-args "rollout.dynamic_sampling=false ..."]  # default on
                               # a CPU: allocation_mode=colocated+d1p1t1 ("" = the demo's server)
                           [--steps 1300] [--lr 1e-4]
                           [--runs-from earlier_output.jsonl]  # e.g. TRL's runs
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

from bench_io import (
    REPO,
    emit,
    emit_machine,
    launch_for,
    make_workdir,
    reaches,
    read_jsonl,
    training_clock_curve,
)
from e2e_async_vs_sync import build_warm_start

from arealite.utils.hardware import resolve_dtype

LR = 1e-4


@dataclass(frozen=True)
class TaskSpec:
    """What both arms share for one task: the configs, the batch shape and the accuracy levels."""

    grpo_config: str
    sft_config: str
    batch_prompts: int
    n_samples: int
    new_tokens: int
    levels: tuple[float, ...]

    def evaluation(self) -> tuple[float, int]:
        """(temperature, answers per prompt) of the GRPO config's held-out evaluation, which
        TRL's callback then matches: (0, 1) is one greedy answer, else avg@n sampled."""
        from omegaconf import OmegaConf

        cfg = OmegaConf.load(os.path.join(REPO, "examples", "configs", self.grpo_config))
        evaluator = cfg.get("evaluator") or {}
        return float(evaluator.get("temperature", 0.0)), int(evaluator.get("n_samples", 1))

    def rows(self, split: str, size: int):
        """The task's RL rows (messages, answer) from arealite's own loader."""
        from arealite.tasks import get_custom_dataset

        name = self.grpo_config.removesuffix("_grpo.yaml")
        options = {"max_digits": 1, "n_operands": 3} if name == "arith" else {}
        return get_custom_dataset(name, 0, 1, split=split, size=size, **options)


TASKS = {
    "arith": TaskSpec(
        "arith_grpo.yaml", "arith_sft.yaml", 16, 8, 8, (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
    ),
    "long_sums": TaskSpec(
        "long_sums_grpo.yaml",
        "long_sums_sft.yaml",
        8,
        8,
        320,
        (0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.5, 0.6, 0.7, 0.8),
    ),
}
# On a CPU no server: the trainer generates in process, one core each for training and generation
# (docs/results.md, "Against TRL": the setting that first met the 2/3-time goal).
CPU_DEFAULT = "allocation_mode=colocated+d1p1t1"


def cpu_seconds_of_children() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


# ----------------------------------------------------------------------------- arealite


def lr_schedule(steps: int) -> tuple[int, str]:
    """(step limit, schedule) shared by both arms: linear to 0 over `steps`, or constant."""
    return (steps, "linear") if steps > 0 else (10**6, "constant")


def run_arealite(
    model: str,
    seed: int,
    minutes: float,
    workdir: str,
    steps: int,
    extra=(),
    lr: float = LR,
    task: TaskSpec = TASKS["arith"],
) -> dict:
    """The launcher on the task's GRPO config (plus `extra` overrides), stopped (SIGTERM) once an
    evaluation past the budget is logged (or done after its steps, evaluating the last one);
    the evaluations are read from its metrics.jsonl."""
    run = f"seed{seed}"
    max_steps, schedule = lr_schedule(steps)
    args = [
        f"cluster.fileroot={workdir}",
        "experiment_name=vs-trl",
        f"trial_name={run}",
        f"actor.path={model}",
        f"seed={seed}",
        f"total_train_steps={max_steps}",
        "total_train_epochs=1000",  # the step limit binds, not the dataset's 1,250 batches
        "evaluator.freq_steps=null",
        "evaluator.freq_secs=60",
        f"actor.optimizer.lr={lr}",
        f"actor.optimizer.lr_scheduler_type={schedule}",
        *extra,
    ]
    metrics = os.path.join(workdir, "vs-trl", run, "metrics.jsonl")
    log = os.path.join(workdir, f"arealite_{run}.log")
    cpu0 = cpu_seconds_of_children()
    recs = launch_for(task.grpo_config, args, metrics, log, minutes * 60)
    evals = [(0.0, recs[0]["eval/accuracy_before_training"])] if recs else []
    evals += [
        (r["wall_time"], r["eval/accuracy"]) for r in recs if r.get("eval/accuracy") is not None
    ]
    informative = (
        sum(
            r.get("rollout/groups_generated", task.batch_prompts)
            - r.get("rollout/groups_dropped", 0)
            - r.get("rollout/groups_accepted_uninformative", 0)
            for r in recs
        )
        * task.n_samples
    )
    wall = [r["wall_time"] for r in recs]
    rec = summarize(
        "arealite",
        seed,
        evals,
        len(recs),
        wall[-1] - wall[0] if wall else 0,
        cpu_seconds_of_children() - cpu0,
        informative,
        task.levels,
    )
    if recs:  # TRL's clock leaves its evaluations out: arealite's, on the same terms
        rec["accuracy_by_training_minute"] = [
            [round(t / 60, 2), round(a, 3)] for t, _, a in training_clock_curve(recs)
        ]
    return rec


# ----------------------------------------------------------------------------- TRL


def require_trl() -> None:
    """Fail before any run when TRL is missing, not after hours of the other arms."""
    if importlib.util.find_spec("trl") is None:
        sys.exit(
            "the TRL arm needs the `bench` extra: pip install -e '.[bench]' (trl, peft, accelerate)"
        )


def run_trl(
    model: str,
    seed: int,
    minutes: float,
    workdir: str,
    steps: int,
    gpu=False,
    lr: float = LR,
    task_name: str = "arith",
) -> dict:
    """TRL in a child process (its own threads and memory); it writes its evaluations."""
    out = os.path.join(workdir, f"trl_seed{seed}.jsonl")
    cmd = [
        sys.executable,
        __file__,
        "--trl-child",
        model,
        "--seeds",
        str(seed),
        "--minutes",
        str(minutes),
        "--steps",
        str(steps),
        "--workdir",
        out,
        "--lr",
        str(lr),
        "--task",
        task_name,
        *(["--gpu"] if gpu else []),
    ]
    cpu0 = cpu_seconds_of_children()
    with open(os.path.join(workdir, f"trl_seed{seed}.log"), "w") as log:
        subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, check=True)
    recs = read_jsonl(out)
    evals = [(r["t"], r["accuracy"]) for r in recs if "accuracy" in r]
    steps = [r for r in recs if "step_time" in r]
    task = TASKS[task_name]
    informative = sum(r.get("informative_groups", 0) for r in recs) * task.n_samples
    return summarize(
        "trl",
        seed,
        evals,
        len(steps),
        sum(r["step_time"] for r in steps),
        cpu_seconds_of_children() - cpu0,
        informative,
        task.levels,
    )


def trl_sampling_precision(device: str, dtype):
    """What TRL samples in: accelerate wraps the policy's forward in autocast to `dtype` (bf16
    where native) only when train() prepares it, so without this TRL's first evaluation runs in
    fp32 and the later ones in bf16: a change of precision inside TRL's accuracy curve."""
    import torch

    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device, dtype=dtype)


def trl_child(
    model: str,
    seed: int,
    minutes: float,
    steps: int,
    out: str,
    gpu: bool,
    lr: float,
    task: TaskSpec,
) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from arealite.tasks.arith import last_integer

    tok = AutoTokenizer.from_pretrained(model)
    train = task.rows("train", 10000).map(lambda r: {"prompt": r["messages"]})
    test = list(task.rows("test", 200))
    device = "cuda" if gpu else "cpu"
    # fp32 master weights as arealite keeps them (its actor's dtype), bf16 compute by autocast
    # where native: bf16 weights would round away most Adam steps at these lrs (half an ulp of
    # a 0.05 weight is 1.2e-4), and TRL would hardly train.
    dtype = getattr(torch, resolve_dtype("auto", device))
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).to(device)
    log = open(out, "w")

    def reward(prompts, completions, answer, **_):
        return [float(last_integer(c[0]["content"]) == int(a)) for c, a in zip(completions, answer)]

    temperature, n_answers = task.evaluation()  # as arealite's evaluator (the GRPO config)
    sampling = (
        {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        if temperature > 0
        else {"do_sample": False}
    )

    def accuracy() -> float:
        tok.padding_side = "left"
        texts = [
            tok.apply_chat_template(r["messages"], tokenize=False, add_generation_prompt=True)
            for r in test
        ]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        policy.eval()
        with torch.no_grad(), trl_sampling_precision(device, dtype):
            gen = policy.generate(
                **enc,
                max_new_tokens=task.new_tokens,
                pad_token_id=tok.pad_token_id,
                num_return_sequences=n_answers,
                **sampling,
            )
        policy.train()
        outs = tok.batch_decode(gen[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        answers = [r["answer"] for r in test for _ in range(n_answers)]
        return sum(last_integer(o) == int(a) for o, a in zip(outs, answers)) / len(outs)

    class EveryMinute(TrainerCallback):
        """Evaluates every 60 s of training time: its own evaluations (HF `generate`, slow at
        long answers) are left out of TRL's clock, so they never cost TRL training time."""

        def __init__(self):
            self.t0 = self.last = time.monotonic()
            self.next_eval, self.evaluated, self.eval_s = 60.0, True, 0.0
            write({"t": 0.0, "accuracy": accuracy()})

        def on_step_end(self, args, state, control, **kw):
            now = time.monotonic()
            write({"step_time": now - self.last})
            clock = now - self.t0 - self.eval_s
            self.evaluated = clock >= self.next_eval
            if self.evaluated:
                write({"t": clock, "accuracy": accuracy()})
                self.eval_s += time.monotonic() - now
                self.next_eval += 60.0
            if clock >= minutes * 60:
                control.should_training_stop = True
            self.last = time.monotonic()

        def on_train_end(self, args, state, control, **kw):
            if not self.evaluated:  # done after its steps: the last step's weights
                write({"t": time.monotonic() - self.t0 - self.eval_s, "accuracy": accuracy()})

        def on_log(self, args, state, control, logs=None, **kw):
            frac = (logs or {}).get("frac_reward_zero_std")
            if frac is not None:
                write({"informative_groups": (1 - frac) * task.batch_prompts})

    def write(rec):
        log.write(json.dumps(rec) + "\n")
        log.flush()

    max_steps, schedule = lr_schedule(steps)
    args = GRPOConfig(
        output_dir=os.path.dirname(out),
        per_device_train_batch_size=task.batch_prompts * task.n_samples,
        num_generations=task.n_samples,
        max_completion_length=task.new_tokens,
        learning_rate=lr,
        lr_scheduler_type=schedule,
        beta=0.0,
        epsilon=0.2,
        temperature=1.0,
        loss_type="dapo",
        max_steps=max_steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=not gpu,
        bf16=dtype == torch.bfloat16,
        seed=seed,
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=policy,
        reward_funcs=reward,
        args=args,
        train_dataset=train,
        processing_class=tok,
        callbacks=[],
    )
    trainer.add_callback(EveryMinute())
    trainer.train()


# ----------------------------------------------------------------------------- report


def summarize(system, seed, evals, steps, train_s, cpu_s, informative, levels) -> dict:
    reached = {f"t_{lv}": next((round(t, 1) for t, a in evals if a >= lv), None) for lv in levels}
    rec = {
        "system": system,
        "seed": seed,
        "steps": steps,
        "sec_per_step": round(train_s / max(1, steps), 3),
        "accuracy_by_minute": [[round(t / 60, 2), round(a, 3)] for t, a in evals],
        "cpu_s_per_informative_sample": round(cpu_s / max(1, informative), 4),
        **reached,
    }
    emit("run", **rec)
    return rec


def compare(runs: list[dict], levels: tuple[float, ...], goal: float = 2 / 3) -> None:
    """Mean time to each level over seeds (only levels every seed of both systems reached);
    `goal`: the largest fraction of TRL's time the per-seed verdict accepts."""
    by = {s: [r for r in runs if r["system"] == s] for s in ("trl", "arealite")}
    start = max(r["accuracy_by_minute"][0][1] for r in runs)  # the shared warm start's accuracy
    for lv in (lv for lv in levels if lv > start):
        times = {s: [r[f"t_{lv}"] for r in rs] for s, rs in by.items()}
        if all(rs and None not in times[s] for s, rs in by.items()):
            mean = {s: statistics.mean(v) for s, v in times.items()}
            emit(
                "time_to_accuracy",
                level=lv,
                trl_s=round(mean["trl"], 1),
                arealite_s=round(mean["arealite"], 1),
                ratio_trl_over_arealite=round(mean["trl"] / max(mean["arealite"], 1e-9), 2),
            )
    if all(by.values()):
        time_to_trl_final(by, goal)
        sps = {s: statistics.mean(r["sec_per_step"] for r in rs) for s, rs in by.items()}
        final = {
            s: statistics.mean(r["accuracy_by_minute"][-1][1] for r in rs) for s, rs in by.items()
        }
        emit(
            "summary",
            trl_sec_per_step=round(sps["trl"], 3),
            arealite_sec_per_step=round(sps["arealite"], 3),
            steps_per_s_ratio_arealite_over_trl=round(sps["trl"] / sps["arealite"], 2),
            trl_final_accuracy=round(final["trl"], 3),
            arealite_final_accuracy=round(final["arealite"], 3),
        )


def load_runs(path: str | None) -> list[dict]:
    """The `run` figures of an earlier invocation's output (re-emitted, marked `reused`)."""
    if not path:
        return []
    runs = []
    with open(path) as f:
        for line in f:
            rec = json.loads(line) if line.startswith("{") else {}
            if rec.pop("figure", None) == "run":
                emit("run", **{**rec, "reused": path})
                runs.append(rec)
    return runs


def time_to_trl_final(by: dict[str, list[dict]], goal: float) -> None:
    """The goal's figure: when arealite first reaches TRL's final accuracy (mean over seeds of
    TRL's last evaluation), against TRL's whole budget; ratio > 1: arealite got there sooner."""
    target = statistics.mean(r["accuracy_by_minute"][-1][1] for r in by["trl"])
    budget = statistics.mean(r["accuracy_by_minute"][-1][0] for r in by["trl"]) * 60
    minutes = [first_minute(r["accuracy_by_minute"], target) for r in by["arealite"]]
    times = [None if m is None else round(m * 60, 1) for m in minutes]
    reached = None not in times and statistics.mean(times) > 0  # 0: the warm start was there
    emit(
        "time_to_trl_final_accuracy",
        trl_final_accuracy=round(target, 3),
        trl_budget_s=round(budget, 1),
        arealite_s_per_seed=times,
        ratio_trl_budget_over_arealite=(
            round(budget / statistics.mean(times), 2) if reached else None
        ),
    )
    per_seed_goal(by, goal)


def per_seed_goal(by: dict[str, list[dict]], goal: float) -> None:
    """The goal seed by seed: arealite's time to TRL's final accuracy *of the same seed*, as a
    fraction of that TRL run's time (within the goal: at most `goal`); None where never
    reached. On the wall clock (the verdict: it includes arealite's evaluations, which TRL's
    clock leaves out) and, where the run has it, on arealite's training clock (less its
    evaluations' seconds; an upper bound on the credit, as its server keeps generating
    rollouts while it evaluates)."""
    trl = {r["seed"]: r for r in by["trl"]}
    for r in (r for r in by["arealite"] if r["seed"] in trl):
        budget_min, target = trl[r["seed"]]["accuracy_by_minute"][-1]
        t = first_minute(r["accuracy_by_minute"], target)
        frac = round(t / budget_min, 2) if t is not None else None
        on_training_clock = {}
        if "accuracy_by_training_minute" in r:
            t_train = first_minute(r["accuracy_by_training_minute"], target)
            on_training_clock["fraction_on_training_clock"] = (
                round(t_train / budget_min, 2) if t_train is not None else None
            )
        emit(
            "goal_per_seed",
            seed=r["seed"],
            trl_final_accuracy=target,
            trl_time_s=round(budget_min * 60, 1),
            arealite_s=round(t * 60, 1) if t is not None else None,
            fraction_of_trl_time=frac,
            **on_training_clock,
            goal_fraction=round(goal, 3),
            within_goal=frac is not None and frac <= goal,
        )


def first_minute(curve: list, level: float) -> float | None:
    """The minute of the first evaluation at or above `level` on a [minute, accuracy] curve."""
    return next((m for m, a in curve if reaches(a, level)), None)


def gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name(0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--task", default="arith", choices=sorted(TASKS))
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument(
        "--steps",
        type=int,
        default=1300,
        help="both arms: lr linear to 0 over this many steps, and at most these; "
        "0 = constant lr, no step limit",
    )
    p.add_argument("--systems", default="trl,arealite")
    p.add_argument("--workdir", default=None)
    p.add_argument("--model-path", default=None, help="a warm start (default: build one)")
    p.add_argument(
        "--runs-from",
        default=None,
        help="JSON lines of an earlier invocation (same machine): its runs join the "
        "comparison, e.g. TRL's, while arealite's are re-run",
    )
    p.add_argument(
        "--arealite-args",
        default=None,
        help="overrides for arealite's arm (default on CPU: colocated generation, "
        'the fastest there; "" for the demo config\'s server)',
    )
    p.add_argument(
        "--gpu",
        action="store_true",
        help="both on the first GPU (arealite: server and trainer share it)",
    )
    p.add_argument("--lr", type=float, default=LR, help="both arms' peak learning rate")
    p.add_argument("--trl-child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.trl_child:
        return trl_child(
            args.trl_child,
            int(args.seeds),
            args.minutes,
            args.steps,
            args.workdir,
            args.gpu,
            args.lr,
            TASKS[args.task],
        )
    if "trl" in args.systems.split(","):
        require_trl()
    workdir = make_workdir(args.workdir, "bench_vs_trl_")
    emit_machine()
    task = TASKS[args.task]
    model = args.model_path or build_warm_start(workdir, [], task.sft_config)
    extra = (args.arealite_args if args.arealite_args is not None else CPU_DEFAULT).split()
    if args.gpu:
        emit("gpu", name=gpu_name())
        extra = [] if args.arealite_args is None else extra  # a server pushed to by handles
        extra = [
            "cluster.n_gpus_per_node=1",
            "cluster.share_gpus=true",
            "weight_update=tensor",
            *extra,
        ]
    runners = {
        "trl": lambda *a: run_trl(*a, gpu=args.gpu, lr=args.lr, task_name=args.task),
        "arealite": lambda *a: run_arealite(*a, extra=extra, lr=args.lr, task=task),
    }
    emit(
        "protocol",
        task=args.task,
        minutes=args.minutes,
        steps=args.steps,
        lr=args.lr,
        schedule=lr_schedule(args.steps)[1],
        arealite_args=extra,
    )
    runs = load_runs(args.runs_from)
    for seed in (int(s) for s in args.seeds.split(",")):
        for system in args.systems.split(","):
            runs.append(runners[system](model, seed, args.minutes, workdir, args.steps))
    compare(runs, task.levels)


if __name__ == "__main__":
    main()
