"""Tests start runs the way users do: configs as the command line makes them, the local
launcher on an example script and YAML, and multi-rank checks under torchrun on 127.0.0.1 over
gloo."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from arealite.utils.network import find_free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def grpo_config(fileroot, *overrides: str):
    """A GRPOConfig as the loader makes it from these overrides (model "x", run e/t)."""
    from arealite.api.cli_args import GRPOConfig
    from arealite.api.config_loader import load_expr_config

    base = [f"cluster.fileroot={fileroot}", "actor.path=x", "experiment_name=e", "trial_name=t"]
    return load_expr_config([*base, *overrides], GRPOConfig)


def example_argv(script: str, yaml: str, *overrides: str) -> list[str]:
    """The launcher's arguments for examples/SCRIPT on examples/configs/YAML (or an absolute
    YAML path), absolute so that any working directory will do."""
    examples = os.path.join(REPO, "examples")
    config = os.path.join(examples, "configs", yaml)
    return [os.path.join(examples, script), "--config", config, *overrides]


def launcher_command(script: str, yaml: str, *overrides: str) -> list[str]:
    """`python -m arealite.launcher.local` on `example_argv(...)`."""
    return [
        sys.executable,
        "-m",
        "arealite.launcher.local",
        *example_argv(script, yaml, *overrides),
    ]


def local_launch(
    script: str, yaml: str, *overrides: str, ok: bool = True, timeout: float = 300, env=None
):
    """`python -m arealite.launcher.local examples/SCRIPT --config examples/configs/YAML
    overrides` from the repository root (YAML may be an absolute path; one OpenMP thread a
    process, plus `env`); the finished process, output captured, checked for success (`ok`)
    with its output's tail."""
    cmd = launcher_command(script, yaml, *overrides)
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if ok:
        assert p.returncode == 0, (
            f"launcher exited with {p.returncode}:\n{(p.stdout + p.stderr)[-6000:]}"
        )
    return p


def torchrun(script, n_ranks: int, *args, timeout: float = 600, **env: str):
    """`script args` on `n_ranks` local ranks (a free master port, one OpenMP thread a rank
    unless `env` says otherwise); the finished process, output captured, checked for success
    with its stderr's tail."""
    rendezvous = ["--master-addr", "127.0.0.1", "--master-port", str(find_free_port())]
    ranks = ["--nproc-per-node", str(n_ranks), *rendezvous]
    cmd = [sys.executable, "-m", "torch.distributed.run", *ranks, str(script), *map(str, args)]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    proc = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def read_metrics(run_dir, after_kill: bool = False) -> list[dict]:
    """A run's metrics.jsonl records. `after_kill`: the file may be missing and a line torn by
    the kill (the resume rewrites it), so both are skipped; otherwise both fail the test."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if after_kill and not os.path.exists(path):
        return []
    records = []
    with open(path) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                if not after_kill:
                    raise
    return records
