"""The two sbatch scripts of the Slurm launcher (`slurm.py`): the servers job and the trainer job.

- servers: one job, one `srun` step per inference server, each through `python -m
  arealite.launcher.slurm register-and-run` (`slurm_node.py`), which fills in `HOST` / `PORT`
  on its node; the job ends as soon as any server step ends.
- trainer: `srun` one torchrun per node (same ranks on every node), c10d rendezvous on the first
  node of the job, server addresses in AREAL_LLM_SERVER_ADDRS.
"""

from __future__ import annotations

import os
import shlex
import sys

from arealite.launcher.environment import trainer_env
from arealite.launcher.name_resolve import server_key
from arealite.launcher.placement import ClusterPlan
from arealite.launcher.servers import server_command, weight_roots

__all__ = ["HOST", "PORT", "servers_script", "trainer_script"]

# Placeholders in a server command line, filled in on the node by `register-and-run`.
HOST, PORT = "{host}", "{port}"


def _header(config, name: str, nodes: int, log: str, gres: int) -> list[str]:
    s = config.launcher.slurm
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name=arealite-{config.experiment_name}-{config.trial_name}-{name}",
        f"#SBATCH --output={log}",
        f"#SBATCH --nodes={nodes}",
        f"#SBATCH --time={s.time}",
    ]
    if gres:
        lines.append(f"#SBATCH --gres=gpu:{gres}")
    if s.partition:
        lines.append(f"#SBATCH --partition={s.partition}")
    if s.account:
        lines.append(f"#SBATCH --account={s.account}")
    return lines


def _srun_options(config) -> list[str]:
    s = config.launcher.slurm
    opts = list(s.extra_srun_args)
    if s.container_image:
        cwd, root = os.getcwd(), os.path.abspath(config.cluster.fileroot)
        opts += [
            f"--container-image={s.container_image}",
            f"--container-mounts={cwd}:{cwd},{root}:{root}",
            f"--container-workdir={cwd}",
        ]
    return opts


def _python(config) -> str:
    """Inside a container the image's python; otherwise this one (shared filesystem)."""
    return "python3" if config.launcher.slurm.container_image else sys.executable


def _exports(env: dict[str, str]) -> list[str]:
    return [f"export {k}={shlex.quote(v)}" for k, v in sorted(env.items())]


def servers_script(config, plan: ClusterPlan, log_dir: str) -> str:
    """One job, one step per server; the job ends (non-zero) as soon as any server step ends."""
    alloc = config.allocation
    tp = alloc.gen.tensor_parallel_size
    multi_node = config.cluster.n_nodes > 1
    host = "auto" if multi_node else config.server.host
    nr = config.cluster.name_resolve
    nr_root = nr.nfs_record_root or os.path.join(
        os.path.abspath(config.cluster.fileroot), "name_resolve"
    )
    gres = min(alloc.gen_n_servers, plan.servers_per_node) * tp if plan.gpu else 0
    lines = _header(config, "servers", plan.gen_nodes, f"{log_dir}/slurm-servers-%j.log", gres)
    lines += [
        f"#SBATCH --ntasks={alloc.gen_n_servers}",
        f"#SBATCH --cpus-per-task={plan.cpus_per_server}",
    ]
    lines += ["set -u", f"cd {shlex.quote(os.getcwd())}"]
    lines += _exports(dict(kv.split("=", 1) for kv in config.launcher.env_vars))
    roots = weight_roots(config)
    for i in range(alloc.gen_n_servers):
        cmd, env = server_command(
            alloc.gen_backend, config.server, HOST, PORT, tp, roots, on_gpu=plan.gpu
        )  # HOST/PORT: placeholders, filled in on the node by register-and-run
        cmd[0] = _python(config) if cmd[0] == sys.executable else cmd[0]
        wrapper = [
            _python(config),
            "-m",
            "arealite.launcher.slurm",
            "register-and-run",
            "--key",
            server_key(config.experiment_name, config.trial_name, i),
            "--name-resolve-type",
            nr.type,
            "--name-resolve-root",
            nr_root,
            "--host",
            host,
            "--timeout",
            str(config.server.startup_timeout),
            "--",
        ]
        step = ["srun", "--exclusive", "--nodes=1", "--ntasks=1"]
        step += [f"--cpus-per-task={plan.cpus_per_server}", f"--output={log_dir}/server{i}.log"]
        step.append("--open-mode=append")
        if plan.gpu:
            step.append(f"--gres=gpu:{tp}")
        step += _srun_options(config)
        step += ["env", *(f"{k}={v}" for k, v in env.items())] if env else []
        lines.append(shlex.join(step + wrapper + cmd) + " &")
    lines += [
        "wait -n",  # a server never ends by itself: the first step to end ends the job
        "rc=$?",
        'echo "a server step ended with code $rc; ending the servers job"',
        "exit $(( rc == 0 ? 1 : rc ))",
    ]
    return "\n".join(lines) + "\n"


def trainer_script(config, plan: ClusterPlan, log_dir: str, script, script_args, addrs) -> str:
    """srun one torchrun per node; rendezvous (c10d) on the job's first node."""
    gres = plan.ranks_per_node if plan.gpu else 0
    lines = _header(config, "trainer", plan.train_nodes, f"{log_dir}/slurm-trainer-%j.log", gres)
    lines += ["#SBATCH --ntasks-per-node=1", f"#SBATCH --cpus-per-task={plan.cpus_per_train_node}"]
    lines += ["set -u", f"cd {shlex.quote(os.getcwd())}"]
    lines += _exports(trainer_env(config, addrs))
    py = _python(config)
    port = config.launcher.trainer_port
    free_port = 'from arealite.utils.network import find_free_port as f; print(f("0.0.0.0"))'
    lines += [
        'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"MASTER_PORT={port}"
        if port
        else f"MASTER_PORT=$({shlex.quote(py)} -c {shlex.quote(free_port)})",
    ]
    step = ["srun", "--kill-on-bad-exit=1", f"--nodes={plan.train_nodes}", "--ntasks-per-node=1"]
    step += [f"--cpus-per-task={plan.cpus_per_train_node}", f"--output={log_dir}/trainer.log"]
    step.append("--open-mode=append")  # logs accumulate across runs of a trial, as locally
    step += _srun_options(config)
    torchrun = [
        py,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(plan.train_nodes),
        "--nproc-per-node",
        str(plan.ranks_per_node),
        "--rdzv-backend",
        "c10d",
    ]
    rdzv = '--rdzv-id "arealite-$SLURM_JOB_ID" --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT"'
    user = shlex.join([os.path.abspath(script), *script_args])
    lines.append(f"{shlex.join(step + torchrun)} {rdzv} {user}")
    return "\n".join(lines) + "\n"
