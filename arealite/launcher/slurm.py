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
extra_srun_args).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time

from arealite.api.cli_args import NameResolveConfig, to_yaml
from arealite.launcher.local import failed_ranks_summary, trainer_env
from arealite.launcher.preflight import ClusterPlan, load_and_check, plan_cluster
from arealite.launcher.process import (
    LaunchError,
    LogFollower,
    install_signal_handlers,
    log_tail,
    run_launcher,
)
from arealite.launcher.servers import (
    server_command,
    share_server_api_key,
    wait_healthy,
    weight_roots,
)
from arealite.utils.lifeline import (
    LAUNCHER_HEARTBEAT_ENV,
    HeartbeatWriter,
    die_with_parent,
    watch_parent,
)
from arealite.utils.name_resolve import make_repository, server_key, servers_root, trial_root
from arealite.utils.network import find_free_port

logger = logging.getLogger("arealite.launcher")

# Placeholders in a server command line, filled in on the node by `register-and-run`.
HOST, PORT = "{host}", "{port}"
ACTIVE_STATES = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED")
SERVER_KEEPALIVE_TTL = 30.0
POLL = 1.0


# ---------------------------------------------------------------------------- sbatch scripts


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
            _python(config), "-m", "arealite.launcher.slurm", "register-and-run",
            "--key", server_key(config.experiment_name, config.trial_name, i),
            "--name-resolve-type", nr.type, "--name-resolve-root", nr_root,
            "--host", host, "--timeout", str(config.server.startup_timeout), "--",
        ]  # fmt: skip
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
        py, "-m", "torch.distributed.run",
        "--nnodes", str(plan.train_nodes), "--nproc-per-node", str(plan.ranks_per_node),
        "--rdzv-backend", "c10d",
    ]  # fmt: skip
    rdzv = '--rdzv-id "arealite-$SLURM_JOB_ID" --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT"'
    user = shlex.join([os.path.abspath(script), *script_args])
    lines.append(f"{shlex.join(step + torchrun)} {rdzv} {user}")
    return "\n".join(lines) + "\n"


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
        addrs = []
        if not config.allocation.train_only:
            job.submit("servers", servers_script(config, plan, job.log_dir))
            addrs = job.wait_servers()
            logger.info("%d server(s) registered: %s", len(addrs), ", ".join(addrs))
        follower = LogFollower(os.path.join(job.log_dir, "trainer.log"))  # before it can grow
        job.submit("trainer", trainer_script(config, plan, job.log_dir, script, script_args, addrs))
        job.wait_trainer(follower)
        logger.info("trainer finished; logs in %s", job.log_dir)
        return 0
    finally:
        job.cancel_all()
        heartbeat.stop()


# ---------------------------------------------------------------------------- on the node


def node_address() -> str:
    """This node's address as other nodes reach it: the source address of its default route
    (a UDP connect sends nothing), else what its hostname resolves to (Debian maps the
    hostname to 127.0.1.1, hence not first)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            ip = s.getsockname()[0]
        if not ip.startswith("127."):
            return ip
    except OSError:
        pass
    return socket.gethostbyname(socket.gethostname())


def register_and_run(argv: list[str]) -> int:
    """Run a server command on this node: fill in host/port, wait for health, register the
    address in name_resolve, then live as long as the server (forwarding SIGTERM to it)."""
    p = argparse.ArgumentParser(prog="python -m arealite.launcher.slurm register-and-run")
    p.add_argument("--key", required=True)
    p.add_argument("--name-resolve-type", default="nfs")
    p.add_argument("--name-resolve-root", default="")
    p.add_argument("--host", default="auto", help="bind address; auto = this node's address")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        p.error("missing the server command after --")
    host = node_address() if args.host == "auto" else args.host
    port = find_free_port(host)
    cmd = [a.replace(HOST, host).replace(PORT, str(port)) for a in cmd]
    address = f"{host}:{port}"
    print(f"[register-and-run] starting {shlex.join(cmd)}", flush=True)
    child = subprocess.Popen(cmd, preexec_fn=die_with_parent)
    watch_parent()  # the launcher's heartbeat: a killed launcher ends this server too

    def forward(signum, frame):
        child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    if not wait_healthy(address, args.timeout, lambda: child.poll() is None):
        why = f"exited with code {child.returncode}" if child.poll() is not None else "timed out"
        print(
            f"[register-and-run] server at {address} failed before becoming healthy ({why})",
            flush=True,
        )
        child.kill()
        child.wait()
        return 1
    nr_config = NameResolveConfig(
        type=args.name_resolve_type, nfs_record_root=args.name_resolve_root
    )
    repo = make_repository(nr_config, "")
    repo.add(
        args.key, address, replace=True, delete_on_exit=True, keepalive_ttl=SERVER_KEEPALIVE_TTL
    )
    print(f"[register-and-run] {address} healthy, registered as {args.key}", flush=True)
    rc = child.wait()
    print(f"[register-and-run] server exited with code {rc}", flush=True)
    return rc


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["register-and-run"]:
        sys.exit(register_and_run(argv[1:]))
    run_launcher(run, argv)


if __name__ == "__main__":
    main()
