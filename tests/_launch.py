"""Tests start runs the way users do: the local launcher on an example script and YAML, and
multi-rank checks under torchrun on 127.0.0.1 over gloo."""

from __future__ import annotations

import os
import subprocess
import sys

from arealite.utils.network import find_free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def local_launch(script: str, yaml: str, *overrides: str, ok: bool = True, timeout: float = 300):
    """`python -m arealite.launcher.local examples/SCRIPT --config examples/configs/YAML
    overrides` from the repository root (one OpenMP thread a process); the finished process,
    output captured, checked for success (`ok`) with its output's tail."""
    cmd = [sys.executable, "-m", "arealite.launcher.local", os.path.join("examples", script)]
    cmd += ["--config", os.path.join("examples", "configs", yaml), *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
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
