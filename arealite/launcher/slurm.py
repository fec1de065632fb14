"""Slurm launcher: inference servers and torchrun trainers as Slurm jobs.

    python -m arealite.launcher.slurm SCRIPT --config YAML [key=value ...]

Validates the allocation against `cluster.n_nodes` x `cluster.n_gpus_per_node`, then writes and
submits (sbatch) two jobs, scripts kept under `<run_dir>/slurm/`:

- servers: one job, one `srun` step per inference server. Each step runs the server through
  `python -m arealite.launcher.slurm register-and-run`, which picks a port on its node, waits
  for the server's health and registers `host:port` in name_resolve; the launcher waits there.
- trainer: `srun` one torchrun per node (same ranks on every node), c10d rendezvous on the first
  node of the job, server addresses in AREAL_LLM_SERVER_ADDRS.

It follows both jobs (squeue, then scontrol/sacct for the final state), streams the trainer's log
to this terminal, and cancels every job (scancel) when the trainer finishes, when any job fails
(exiting non-zero naming it) and on Ctrl-C. `<run_dir>` must be on a filesystem every node sees.
Cluster options come from `launcher.slurm` (partition, account, time, container_image,
extra_srun_args). The job scripts are written by `slurm_scripts.py`; what runs on the node
(`register-and-run`) is `slurm_node.py`; this module submits, follows and cancels.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
import time

from arealite.api.cli_args import to_yaml
from arealite.launcher.name_resolve import make_repository, servers_root, trial_root
from arealite.launcher.placement import ClusterPlan, plan_cluster
from arealite.launcher.preflight import load_and_check
from arealite.launcher.process import (
    LaunchError,
    LogFollower,
    failed_ranks_summary,
    install_signal_handlers,
    log_tail,
    run_launcher,
)
from arealite.launcher.servers import needs_servers, share_server_api_key
from arealite.launcher.slurm_node import register_and_run
from arealite.launcher.slurm_scripts import servers_script, trainer_script
from arealite.lifecycle.lifeline import LAUNCHER_HEARTBEAT_ENV, HeartbeatWriter

logger = logging.getLogger("arealite.launcher")

ACTIVE_STATES = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED")
POLL = 1.0


# ---------------------------------------------------------------------------- Slurm commands


def _cmd(args: list[str], timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout)


def sbatch(script_path: str) -> str:
    p = _cmd(["sbatch", "--parsable", script_path], timeout=60)
    if p.returncode != 0:
        raise LaunchError(f"sbatch {script_path} failed: {p.stderr.strip() or p.stdout.strip()}")
    return p.stdout.strip().split(";")[0]


def job_state(job_id: str, attempts: int = 5) -> tuple[str, str]:
    """(state, exit code 'N:S'): squeue while Slurm holds the job, then scontrol, then sacct;
    retried a few times so a busy slurmctld is not mistaken for a lost job."""
    for attempt in range(attempts):
        p = _cmd(["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T"])
        state = p.stdout.strip().split("\n")[0] if p.returncode == 0 else ""
        if state in ACTIVE_STATES:
            return state, ""
        p = _cmd(["scontrol", "show", "job", "-o", job_id])
        found = re.search(r"JobState=(\S+).*?ExitCode=(\S+)", p.stdout)
        if p.returncode == 0 and found:
            return found.group(1), found.group(2)
        p = _cmd(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State,ExitCode"])
        line = p.stdout.strip().split("\n")[0] if p.returncode == 0 else ""
        if "|" in line:
            st, code = line.split("|", 1)
            return st.split()[0], code
        if state:
            return state, ""
        if attempt + 1 < attempts:
            time.sleep(2)
    return "UNKNOWN", ""


class SlurmRun:
    """The jobs of one run: submit, follow, cancel."""

    def __init__(self, config, plan: ClusterPlan):
        self.config, self.plan = config, plan
        self.run_dir = os.path.abspath(config.run_dir)
        self.log_dir = os.path.join(self.run_dir, "logs")
        self.script_dir = os.path.join(self.run_dir, "slurm")
        self.jobs: dict[str, str] = {}  # name -> job id

    def submit(self, name: str, text: str) -> str:
        path = os.path.join(self.script_dir, f"{name}.sbatch")
        with open(path, "w") as f:
            f.write(text)
        job_id = sbatch(path)
        self.jobs[name] = job_id
        logger.info("submitted %s job %s (%s)", name, job_id, path)
        return job_id

    def check_alive(self, name: str) -> str:
        """The job's state; LaunchError naming it when it ended."""
        state, code = job_state(self.jobs[name])
        if state not in ACTIVE_STATES:
            raise LaunchError(self.failure(name, state, code))
        return state

    def failure(self, name: str, state: str, code: str) -> str:
        job = f"{name} job {self.jobs[name]}"
        if name == "servers":
            dead = self.dead_servers()
            which = f" ({', '.join(dead)})" if dead else ""
            logs = [os.path.join(self.log_dir, f"{d}.log") for d in dead] or [
                os.path.join(self.log_dir, f"slurm-servers-{self.jobs[name]}.log")
            ]
            tail = "".join(f"log tail ({p}):\n{log_tail(p)}" for p in logs)
            return f"{job} ended{which}: state {state}, exit code {code or '?'}; {tail}"
        path = os.path.join(self.log_dir, "trainer.log")
        return (
            f"trainer failed: {job} ended with state {state}, exit code {code or '?'} "
            f"({failed_ranks_summary(path)}); log tail ({path}):\n{log_tail(path)}"
        )

    def dead_servers(self) -> list[str]:
        dead = []
        for i in range(self.config.allocation.gen_n_servers):
            tail = log_tail(os.path.join(self.log_dir, f"server{i}.log"), 10)
            if "[register-and-run] " in tail and ("exited with code" in tail or "failed" in tail):
                dead.append(f"server{i}")
        return dead

    def wait_servers(self) -> list[str]:
        """Wait for every server's name_resolve entry; the startup clock starts when the job runs."""
        cfg = self.config
        n = cfg.allocation.gen_n_servers
        repo = make_repository(cfg.cluster.name_resolve, cfg.cluster.fileroot)
        prefix = servers_root(cfg.experiment_name, cfg.trial_name)
        deadline = None
        while True:
            addrs = repo.get_subtree(prefix)
            if len(addrs) == n:
                return addrs
            state = self.check_alive("servers")
            if state == "RUNNING" and deadline is None:
                deadline = time.monotonic() + cfg.server.startup_timeout + 30
            if deadline is not None and time.monotonic() > deadline:
                raise LaunchError(
                    f"servers job {self.jobs['servers']}: {len(addrs)}/{n} server(s) registered "
                    f"within {cfg.server.startup_timeout:.0f}s; logs in {self.log_dir}"
                )
            time.sleep(POLL)

    def wait_trainer(self, follower: LogFollower) -> None:
        follower.start()
        try:
            while True:
                state, code = job_state(self.jobs["trainer"])
                if state == "COMPLETED":
                    return
                if state not in ACTIVE_STATES:
                    raise LaunchError(self.failure("trainer", state, code))
                if "servers" in self.jobs:
                    self.check_alive("servers")
                time.sleep(POLL)
        finally:
            follower.stop()

    def cancel_all(self, timeout: float = 60) -> None:
        """scancel every job still active and wait until Slurm has ended them."""
        active = [j for j in self.jobs.values() if job_state(j)[0] in ACTIVE_STATES]
        if not active:
            return
        _cmd(["scancel", *active])
        logger.info("cancelled job(s) %s", ", ".join(active))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(job_state(j)[0] not in ACTIVE_STATES for j in active):
                return
            time.sleep(0.5)
        logger.warning("job(s) %s still active %.0fs after scancel", ", ".join(active), timeout)


def run(argv: list[str]) -> int:
    script, script_args, config = load_and_check(argv)
    plan = plan_cluster(config)
    share_server_api_key(config)
    missing = [c for c in ("sbatch", "squeue", "scancel", "scontrol") if shutil.which(c) is None]
    if missing:
        raise LaunchError(
            f"{', '.join(missing)} not found: run the Slurm launcher on a Slurm login node"
        )
    job = SlurmRun(config, plan)
    for d in (job.log_dir, job.script_dir):
        os.makedirs(d, exist_ok=True)
    with open(os.path.join(job.run_dir, "config.yaml"), "w") as f:
        f.write(to_yaml(config))
    install_signal_handlers(lambda signum: logger.warning("signal %d: cancelling the jobs", signum))
    repo = make_repository(config.cluster.name_resolve, config.cluster.fileroot)
    repo.clear_subtree(trial_root(config.experiment_name, config.trial_name))
    # The jobs (which inherit this environment) exit when this launcher stops beating: a
    # `kill -9` here runs no scancel, and they must not train on as orphans.
    heartbeat = HeartbeatWriter(os.path.join(job.run_dir, "launcher.heartbeat"))
    os.environ[LAUNCHER_HEARTBEAT_ENV] = heartbeat.path
    heartbeat.start()
    try:
        _submit_and_follow(job, script, script_args)
        return 0
    finally:
        job.cancel_all()
        heartbeat.stop()


def _submit_and_follow(job: SlurmRun, script: str, script_args: list[str]) -> None:
    """The servers job (until every server registered), then the trainer job to its end."""
    config, plan, addrs = job.config, job.plan, []
    if needs_servers(config):
        job.submit("servers", servers_script(config, plan, job.log_dir))
        addrs = job.wait_servers()
        logger.info("%d server(s) registered: %s", len(addrs), ", ".join(addrs))
    follower = LogFollower(os.path.join(job.log_dir, "trainer.log"))  # before it can grow
    job.submit("trainer", trainer_script(config, plan, job.log_dir, script, script_args, addrs))
    job.wait_trainer(follower)
    logger.info("trainer finished; logs in %s", job.log_dir)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["register-and-run"]:
        sys.exit(register_and_run(argv[1:]))
    run_launcher(run, argv)


if __name__ == "__main__":
    main()
