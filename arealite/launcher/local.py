"""Local launcher: inference servers + torchrun trainer ranks on this machine.

    python -m arealite.launcher.local SCRIPT --config YAML [key=value ...]

Validates the config, starts the servers of the allocation mode and, while they load, the trainer
with torchrun (their addresses exported; its clients wait for them), waits for the servers'
health (a failure shows the server's log tail), keeps per-process logs under `<run_dir>/logs/`,
and tears everything down on exit, on Ctrl-C and as soon as any process fails. With
`recover.mode=auto|resume` a failed trainer is restarted up to `recover.retries` times (it
resumes from its last recover checkpoint).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys

from arealite.api.cli_args import to_yaml
from arealite.launcher.environment import cpu_thread_env, trainer_env
from arealite.launcher.placement import GpuPlan, check_resources, plan_local
from arealite.launcher.preflight import load_and_check
from arealite.launcher.process import (
    LaunchError,
    ProcessSet,
    failed_ranks_summary,
    install_signal_handlers,
    log_tail,
    run_launcher,
)
from arealite.launcher.servers import (
    needs_servers,
    plan_servers,
    share_server_api_key,
    wait_healthy,
    weight_roots,
)
from arealite.lifecycle.lifeline import WATCHED_PARENT_PID_ENV
from arealite.utils.network import find_free_port, find_free_ports

logger = logging.getLogger("arealite.launcher")


def visible_gpu_count() -> int:
    """GPUs on this node, without importing torch (keeps the launcher's start fast)."""
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
        return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
    except (OSError, subprocess.TimeoutExpired):
        return 0


def start_servers(procs: ProcessSet, config, gpus: GpuPlan | None) -> list[str]:
    """Start every inference server (not waiting for them: the trainer starts meanwhile, its
    imports and model load overlap theirs); returns their addresses."""
    alloc = config.allocation
    ports = find_free_ports(alloc.gen_n_servers, config.server.host)
    envs = [gpus.server_env(i) for i in range(alloc.gen_n_servers)] if gpus else None
    specs = plan_servers(alloc, config.server, ports, weight_roots(config), envs)
    threads = {} if gpus else cpu_thread_env(config, alloc.gen_n_servers)
    for s in specs:
        procs.start(f"server{s.index}", s.cmd, {**threads, **s.env}, critical=False)
    return [s.address for s in specs]


def wait_servers(procs: ProcessSet, config, addrs: list[str]) -> None:
    """Wait until every server is healthy; LaunchError with the log tail of one that exits or
    stays unhealthy for server.startup_timeout. Returns early when the trainer has exited (its
    own failure is the one to report)."""
    trainer = procs.children["trainer"]
    for index, address in enumerate(addrs):
        child = procs.children[f"server{index}"]

        def both_alive(child=child) -> bool:
            return child.alive() and trainer.alive()

        if not wait_healthy(address, config.server.startup_timeout, both_alive):
            if not trainer.alive():
                return
            state = "exited" if not child.alive() else "did not become healthy"
            raise LaunchError(
                f"inference server {index} at {address} {state} within "
                f"{config.server.startup_timeout:.0f}s; log tail ({child.log_path}):\n"
                f"{log_tail(child.log_path)}"
            )
        logger.info("server%d healthy at %s", index, address)


def trainer_command(
    script: str, script_args: list[str], n_ranks: int, port: int, agent: bool
) -> tuple[list[str], dict[str, str]]:
    """(command, rank environment). Several ranks (or `agent`) run under torchrun; a lone rank
    starts the script directly with the environment torchrun would give it, which saves the
    agent's own Python start-up with torch on every launch."""
    if n_ranks == 1 and not agent:
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "1"}
        env[WATCHED_PARENT_PID_ENV] = str(os.getpid())
        for key in ("RANK", "LOCAL_RANK", "GROUP_RANK", "NODE_RANK"):
            env[key] = "0"
        env["LOCAL_WORLD_SIZE"] = "1"
        return [sys.executable, script, *script_args], env
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(n_ranks),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
        script,
        *script_args,
    ]
    return cmd, {}


MAX_SERVER_RESTARTS = 5  # per server: one that keeps dying stays down (the others serve)


def restart_dead_server(procs: ProcessSet, config):
    """Restart a server that died, same command, environment and port; the trainer's client
    fails over meanwhile and re-admits it once it is healthy and has loaded the current
    weights."""
    restarts: dict[str, int] = {}

    def on_death(child):
        n = restarts.get(child.name, 0)
        if n == MAX_SERVER_RESTARTS:
            restarts[child.name] = n + 1
            logger.error(
                "%s died %d times; leaving it down (log: %s)", child.name, n + 1, child.log_path
            )
        if n >= MAX_SERVER_RESTARTS:
            return
        restarts[child.name] = n + 1
        logger.warning(
            "%s died (code %s); restarting it (restart %d/%d)",
            child.name,
            child.popen.returncode,
            n + 1,
            MAX_SERVER_RESTARTS,
        )
        procs.start(child.name, child.cmd, child.env, critical=False)

    return on_death


def run(argv: list[str]) -> int:
    script, script_args, config = load_and_check(argv)
    check_resources(config)
    n_physical = visible_gpu_count() if config.cluster.n_gpus_per_node else 0
    gpus = plan_local(config, n_physical, os.environ.get("CUDA_VISIBLE_DEVICES"))
    logger.info("%s", gpus.describe() if gpus else "CPU run (cluster.n_gpus_per_node=0)")
    share_server_api_key(config)
    log_dir = os.path.join(config.run_dir, "logs")
    os.makedirs(log_dir, exist_ok=True)
    with open(os.path.join(config.run_dir, "config.yaml"), "w") as f:
        f.write(to_yaml(config))
    procs = ProcessSet(log_dir)
    install_signal_handlers(lambda signum: logger.warning("signal %d: stopping the run", signum))
    try:
        addrs = start_servers(procs, config, gpus) if needs_servers(config) else []
        attempts = 1 + (config.recover.retries if config.recover.mode != "disabled" else 0)
        for attempt in range(attempts):
            port = config.launcher.trainer_port or find_free_port()
            n_ranks = config.allocation.train_world_size
            cmd, rank_env = trainer_command(
                script, script_args, n_ranks, port, config.launcher.single_rank_agent
            )
            env = {**trainer_env(config, addrs, gpus), **rank_env}
            procs.start("trainer", cmd, env, stream=True, watches_parent=bool(rank_env))
            if attempt == 0:
                wait_servers(procs, config, addrs)
            rc = procs.wait("trainer", on_death=restart_dead_server(procs, config))
            procs.kill_group("trainer")  # no worker of this attempt outlives its agent
            if rc == 0:
                logger.info("trainer finished; logs in %s", log_dir)
                return 0
            logger.error("trainer exited with code %d (attempt %d/%d)", rc, attempt + 1, attempts)
        log_path = procs.children["trainer"].log_path
        direct = bool(rank_env)  # the exit code is rank 0's own, not torchrun's
        failed = f"rank 0 exited with code {rc}" if direct else failed_ranks_summary(log_path)
        raise LaunchError(
            f"trainer failed with exit code {rc} ({failed}); "
            f"log tail ({log_path}):\n{log_tail(log_path)}"
        )
    finally:
        procs.stop_all()


def main(argv: list[str] | None = None) -> None:
    run_launcher(run, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
