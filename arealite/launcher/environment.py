"""The environment of a run's processes, built once for every launcher: the trainer's (the
user's `launcher.env_vars`, CPU threads, the NCCL settings the servers run with, the servers'
addresses, the local launcher's GPUs) and the OpenMP settings of a process on a CPU-only node.
"""

from __future__ import annotations

import os

from arealite.api.launch_config import SERVER_ADDRS_ENV, SERVERS_STARTUP_ENV
from arealite.launcher.placement import GpuPlan, trainer_nccl_env
from arealite.lifecycle.lifeline import WATCH_PARENT_ENV


def cpu_thread_env(config, n_busy_together: int) -> dict[str, str]:
    """OpenMP settings of one process on a CPU-only node, one of `n_busy_together` processes of
    its side (trainer ranks, or servers) that compute at the same time (README "Performance").

    `shared`: the asynchronous loop mostly alternates - generation waits at the staleness bound
    while the trainer trains, the trainer waits for a batch or for weights while generation runs
    - so each side gets every core and idle pools sleep instead of spinning (a spinning pool
    steals the cores the busy side needs). `split`: a fixed cores // all processes each.
    Colocated generation counts as a second busy side of each rank where it overlaps training."""
    cores = os.cpu_count() or 1
    alloc = config.allocation
    if config.launcher.cpu_threads == "split":
        busy = alloc.gen_n_servers + alloc.train_world_size * compute_threads_per_rank(config)
        return {"OMP_NUM_THREADS": str(max(1, cores // busy))}
    return {"OMP_NUM_THREADS": str(max(1, cores // n_busy_together)), "OMP_WAIT_POLICY": "PASSIVE"}


def compute_threads_per_rank(config) -> int:
    """Threads of one trainer rank that compute at once: 2 where colocated generation runs
    beside training (eta >= 1: the next batch is generated while this one trains; measured
    0.27 vs 0.32 s/step on 2 cores with one core each instead of both for both), else 1."""
    rollout = getattr(config, "rollout", None)
    overlaps = rollout is not None and rollout.max_head_offpolicyness > 0
    return 2 if config.allocation.colocated and overlaps else 1


def trainer_env(config, server_addrs: list[str], gpus: GpuPlan | None = None) -> dict[str, str]:
    """Environment of the trainer's torchrun: the user's launcher.env_vars, CPU threads, the
    NCCL settings the servers run with, and (local launcher) the trainer's GPUs."""
    env = dict(kv.split("=", 1) for kv in config.launcher.env_vars)
    busy = config.allocation.train_world_size * compute_threads_per_rank(config)
    for key, value in cpu_thread_env(config, busy).items():
        env.setdefault(key, value)
    env.update(trainer_nccl_env(env))
    if gpus is not None:
        env.update(gpus.trainer_env())
    env["PYTHONUNBUFFERED"] = "1"
    env[WATCH_PARENT_ENV] = "1"  # a rank exits when its parent (torchrun or the launcher) dies
    if server_addrs:
        env[SERVER_ADDRS_ENV] = ",".join(server_addrs)
        env[SERVERS_STARTUP_ENV] = str(config.server.startup_timeout)  # they may still load
    return env
