"""Ray launcher: inference servers and trainer ranks as Ray actors on a Ray cluster.

    python -m arealite.launcher.ray SCRIPT --config YAML [key=value ...]

Connects to `launcher.ray_address` (or `$RAY_ADDRESS`; a local Ray instance when neither is
set), reserves the allocation with placement groups (GPUs where the cluster has them, small CPU
shares otherwise), starts every server as a subprocess of an actor that registers its address in
name_resolve once healthy, then runs one actor per trainer rank executing `python SCRIPT args`
with the torchrun environment (MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK, ...). Output goes
to `<run_dir>/logs/` (the run directory must be on a filesystem every node sees) and, for the
trainer, to this terminal. When any server or rank fails, everything is torn down and the
launcher exits non-zero naming it.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
import time

from arealite.api.cli_args import ConfigError, to_yaml
from arealite.launcher import process
from arealite.launcher.environment import trainer_env
from arealite.launcher.name_resolve import make_repository, server_key, servers_root, trial_root
from arealite.launcher.placement import ClusterPlan, plan_cluster
from arealite.launcher.preflight import load_and_check
from arealite.launcher.servers import (
    needs_servers,
    server_command,
    share_server_api_key,
    wait_healthy,
    weight_roots,
)
from arealite.lifecycle.lifeline import die_with_parent
from arealite.utils.network import find_free_port

logger = logging.getLogger("arealite.launcher")

# CPU share of one server / trainer rank on CPU-only clusters: bookkeeping only (nothing binds
# cores), kept small so a laptop-sized Ray instance fits a whole run.
CPU_SHARE = 0.25
# Driver environment variables that follow the processes to other nodes (plus launcher.env_vars).
FORWARDED_ENV_PREFIXES = (
    "AREAL_",
    "HF_",
    "TOKENIZERS_",
    "WANDB_",
    "SWANLAB_",
    "NCCL_",
    "PYTHONPATH",
)
PLACEMENT_TIMEOUT = 300.0
SERVER_KEEPALIVE_TTL = 30.0
# Stands for the Python of the Ray worker (the node's own interpreter) in a command line.
PYTHON = "{python}"


class ProcessActor:
    """One command line on a Ray node, watched from inside an actor.

    Output goes to a log file under the run directory (on the shared filesystem), which the
    driver follows; nothing goes through Ray's log forwarding, which drops lines at shutdown."""

    def __init__(self, name: str, log_path: str):
        self.name, self.log_path = name, log_path
        self.popen: subprocess.Popen | None = None
        self.returncode: int | None = None
        self.done = threading.Event()
        self.repo = None
        self.key: str | None = None

    def __repr__(self) -> str:
        return self.name

    def node_info(self) -> dict:
        import ray

        ip = ray.util.get_node_ip_address()
        return {"ip": ip, "gpus": [str(g) for g in ray.get_gpu_ids()], "port": find_free_port(ip)}

    def start(self, cmd: list[str], env: dict[str, str], cwd: str | None) -> int:
        """Start the process (its monitor thread lives exactly as long as it does); its pid."""
        cmd = [sys.executable if a == PYTHON else a for a in cmd]
        started, box = threading.Event(), {}
        args = (cmd, env, cwd, started, box)
        threading.Thread(target=self._monitor, args=args, daemon=True).start()
        started.wait()
        if "error" in box:
            raise RuntimeError(f"{self.name}: cannot start {cmd[0]!r}: {box['error']}")
        return box["pid"]

    def _monitor(self, cmd, env, cwd, started, box) -> None:
        os.makedirs(os.path.dirname(self.log_path), exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"$ {shlex.join(cmd)}\n".encode())
            log.flush()
            try:
                self.popen = subprocess.Popen(
                    cmd,
                    env={**os.environ, **env},
                    cwd=cwd,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=die_with_parent,
                )
            except OSError as e:
                box["error"] = e
                started.set()
                self.done.set()
                return
            box["pid"] = self.popen.pid
            started.set()
            for line in iter(self.popen.stdout.readline, b""):
                log.write(line)
                log.flush()
            self.returncode = self.popen.wait()
            log.write(f"[launcher] {self.name} exited with code {self.returncode}\n".encode())
        if self.repo is not None:
            try:
                self.repo.delete(self.key)
            except Exception:  # noqa: BLE001 - the keepalive TTL expires it anyway
                pass
        self.done.set()

    def serve(self, backend, server_cfg, tp, weight_roots, key, nr_config, fileroot, cwd, env):
        """Start an inference server on this node, wait for its health, register its address."""
        import ray

        host = ray.util.get_node_ip_address()
        port = find_free_port(host)
        on_gpu = bool(ray.get_gpu_ids())
        cmd, server_env = server_command(
            backend, server_cfg, host, port, tp, weight_roots, on_gpu=on_gpu
        )
        self.start(cmd, {**env, **server_env}, cwd)
        address = f"{host}:{port}"
        timeout = server_cfg.startup_timeout
        if not wait_healthy(address, timeout, lambda: not self.done.is_set()):
            state = "exited" if self.done.is_set() else f"did not become healthy in {timeout:.0f}s"
            raise RuntimeError(
                f"inference {self.name} at {address} {state}; log tail ({self.log_path}):\n"
                f"{process.log_tail(self.log_path)}"
            )
        self.repo, self.key = make_repository(nr_config, fileroot), key
        self.repo.add(key, address, replace=True, keepalive_ttl=SERVER_KEEPALIVE_TTL)
        return address

    def wait(self) -> int | None:
        self.done.wait()
        return self.returncode

    def stop(self, grace: float = 10.0) -> None:
        if self.popen is None or self.popen.poll() is not None:
            return
        for sig, timeout in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.popen.pid, sig)
                self.popen.wait(timeout=timeout)
                return
            except ProcessLookupError:
                return
            except subprocess.TimeoutExpired:
                continue


def import_ray():
    try:
        import ray
    except ImportError:
        raise ConfigError(
            "the Ray launcher needs Ray: pip install 'ray[default]' (the `ray` extra of arealite)"
        ) from None
    return ray


def forwarded_env(config) -> dict[str, str]:
    """What every process gets on any node: selected driver variables + launcher.env_vars."""
    env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV_PREFIXES)}
    env.update(kv.split("=", 1) for kv in config.launcher.env_vars)
    return env


class RayRun:
    """The actors and placement groups of one run, and their teardown."""

    def __init__(self, ray, config, plan: ClusterPlan):
        self.ray, self.config, self.plan = ray, config, plan
        self.run_dir = os.path.abspath(config.run_dir)
        self.log_dir = os.path.join(self.run_dir, "logs")
        self.actors: dict[str, object] = {}
        self.pgs: list = []
        self.followers: list[process.LogFollower] = []

    # -- resources
    def bundles(self) -> tuple[list[dict], list[dict]]:
        """(server bundles, trainer bundles: one per trainer node)."""
        alloc, plan = self.config.allocation, self.plan
        tp = alloc.gen.tensor_parallel_size if alloc.gen else 1
        if plan.gpu:
            servers = [{"CPU": plan.cpus_per_server, "GPU": tp}] * alloc.gen_n_servers
            node = {"CPU": plan.cpus_per_train_node, "GPU": plan.ranks_per_node}
        else:
            servers = [{"CPU": CPU_SHARE}] * alloc.gen_n_servers
            node = {"CPU": CPU_SHARE * plan.ranks_per_node}
        return servers, [dict(node) for _ in range(plan.train_nodes)]

    def check_capacity(self) -> None:
        """Fail at once when the cluster cannot hold the allocation at all."""
        servers, trainers = self.bundles()
        total = self.ray.cluster_resources()
        for res in ("CPU", "GPU"):
            need = sum(b.get(res, 0) for b in servers + trainers)
            if need > total.get(res, 0) + 1e-9:
                raise process.LaunchError(
                    f"allocation_mode={self.config.allocation_mode!r} needs {need:g} {res} on the "
                    f"Ray cluster, which has {total.get(res, 0):g} ({total})"
                )

    def reserve(self, bundles: list[dict], strategy: str, what: str):
        from ray.util.placement_group import placement_group

        pg = placement_group(bundles, strategy=strategy)
        self.pgs.append(pg)
        try:
            self.ray.get(pg.ready(), timeout=PLACEMENT_TIMEOUT)
        except self.ray.exceptions.GetTimeoutError:
            raise process.LaunchError(
                f"Ray could not reserve {what} ({strategy} {bundles}) within {PLACEMENT_TIMEOUT:.0f}s; "
                f"available: {self.ray.available_resources()}"
            ) from None
        return pg

    def actor(self, name: str, pg, bundle: int, num_cpus: float, num_gpus: float):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle)
        cls = self.ray.remote(ProcessActor)
        handle = cls.options(
            num_cpus=num_cpus, num_gpus=num_gpus, max_concurrency=4, scheduling_strategy=strategy
        ).remote(name, os.path.join(self.log_dir, f"{name}.log"))
        self.actors[name] = handle
        return handle

    # -- servers
    def start_servers(self, env: dict[str, str]) -> list[str]:
        """Every server healthy and registered in name_resolve; their addresses in index order."""
        cfg, alloc = self.config, self.config.allocation
        bundles, _ = self.bundles()
        pg = self.reserve(bundles, "PACK", f"{alloc.gen_n_servers} inference server(s)")
        tp = alloc.gen.tensor_parallel_size
        refs = {}
        for i, b in enumerate(bundles):
            a = self.actor(f"server{i}", pg, i, b["CPU"], b.get("GPU", 0))
            key = server_key(cfg.experiment_name, cfg.trial_name, i)
            ref = a.serve.remote(
                alloc.gen_backend,
                cfg.server,
                tp,
                weight_roots(cfg),
                key,
                cfg.cluster.name_resolve,
                os.path.abspath(cfg.cluster.fileroot),
                os.getcwd(),
                env,
            )
            refs[ref] = f"server{i}"
        pending = list(refs)
        while pending:
            ready, pending = self.ray.wait(pending, num_returns=1)
            address = self._result(ready[0], refs[ready[0]])
            logger.info("%s healthy at %s", refs[ready[0]], address)
        repo = make_repository(cfg.cluster.name_resolve, cfg.cluster.fileroot)
        addrs = repo.get_subtree(servers_root(cfg.experiment_name, cfg.trial_name))
        if len(addrs) != alloc.gen_n_servers:
            raise process.LaunchError(
                f"name_resolve holds {len(addrs)} server address(es), expected {alloc.gen_n_servers}"
            )
        return addrs

    def _result(self, ref, name: str):
        try:
            return self.ray.get(ref)
        except self.ray.exceptions.RayTaskError as e:
            raise process.LaunchError(str(getattr(e, "cause", None) or e)) from None
        except self.ray.exceptions.RayActorError as e:
            raise process.LaunchError(f"the Ray actor of {name} died: {e}") from None

    # -- trainer
    def start_trainers(self, script: str, script_args: list[str], env: dict[str, str]) -> None:
        plan = self.plan
        _, bundles = self.bundles()
        strategy = "STRICT_SPREAD" if plan.train_nodes > 1 else "PACK"
        pg = self.reserve(bundles, strategy, f"{plan.train_nodes} trainer node(s)")
        ranks = []
        for node, b in enumerate(bundles):
            for local in range(plan.ranks_per_node):
                rank = node * plan.ranks_per_node + local
                share = b["CPU"] / plan.ranks_per_node
                ranks.append(self.actor(f"rank{rank}", pg, node, share, int(plan.gpu)))
                self.followers.append(
                    process.LogFollower(
                        os.path.join(self.log_dir, f"rank{rank}.log"), f"[rank{rank}] "
                    )
                )
        infos = self.ray.get([a.node_info.remote() for a in ranks])
        master_port = self.config.launcher.trainer_port or infos[0]["port"]
        world = len(ranks)
        cmd = [PYTHON, os.path.abspath(script), *script_args]
        for rank, a in enumerate(ranks):
            node, local = divmod(rank, plan.ranks_per_node)
            node_infos = infos[node * plan.ranks_per_node : (node + 1) * plan.ranks_per_node]
            rank_env = {
                **env,
                "MASTER_ADDR": infos[0]["ip"],
                "MASTER_PORT": str(master_port),
                "RANK": str(rank),
                "WORLD_SIZE": str(world),
                "LOCAL_RANK": str(local),
                "LOCAL_WORLD_SIZE": str(plan.ranks_per_node),
                "GROUP_RANK": str(node),
                "NODE_RANK": str(node),
            }
            if plan.gpu:  # LOCAL_RANK indexes the node's trainer GPUs, as under torchrun
                rank_env["CUDA_VISIBLE_DEVICES"] = ",".join(
                    g for i in node_infos for g in i["gpus"]
                )
            self.ray.get(a.start.remote(cmd, rank_env, os.getcwd()))
        for f in self.followers:
            f.start()
        logger.info("started %d trainer rank(s); master %s:%s", world, infos[0]["ip"], master_port)

    def wait(self) -> None:
        """Until every rank exits 0; LaunchError naming the first rank or server that fails."""
        refs = {a.wait.remote(): name for name, a in self.actors.items()}
        ranks_left = {n for n in self.actors if n.startswith("rank")}
        while ranks_left:
            ready, _ = self.ray.wait(list(refs), num_returns=1, timeout=1.0)
            for ref in ready:
                name = refs.pop(ref)
                rc = self._result(ref, name)
                path = os.path.join(self.log_dir, f"{name}.log")
                if name.startswith("server"):
                    raise process.LaunchError(
                        f"inference {name} exited with code {rc} during training; "
                        f"log tail ({path}):\n{process.log_tail(path)}"
                    )
                if rc != 0:
                    raise process.LaunchError(
                        f"trainer failed: rank {name[4:]} exited with code {rc}; "
                        f"log tail ({path}):\n{process.log_tail(path)}"
                    )
                ranks_left.discard(name)
        for f in self.followers:  # show the ranks' last lines before the launcher's summary
            f.stop()

    def teardown(self) -> None:
        from ray.util.placement_group import remove_placement_group

        stops = [a.stop.remote() for a in self.actors.values()]
        if stops:
            self.ray.wait(stops, num_returns=len(stops), timeout=30)
        for f in self.followers:
            f.stop()
        for a in self.actors.values():
            self.ray.kill(a)
        for pg in self.pgs:
            remove_placement_group(pg)


def run(argv: list[str]) -> int:
    script, script_args, config = load_and_check(argv)
    plan = plan_cluster(config)
    share_server_api_key(config)
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")  # every rank's lines, not "repeated 2x"
    ray = import_ray()
    os.makedirs(os.path.join(config.run_dir, "logs"), exist_ok=True)
    with open(os.path.join(config.run_dir, "config.yaml"), "w") as f:
        f.write(to_yaml(config))
    process.install_signal_handlers(
        lambda signum: logger.warning("signal %d: stopping the run", signum)
    )
    t0 = time.monotonic()
    ray.init(address=config.launcher.ray_address, log_to_driver=True)
    logger.info("connected to Ray in %.1fs: %s", time.monotonic() - t0, ray.cluster_resources())
    job = RayRun(ray, config, plan)
    try:
        job.check_capacity()
        repo = make_repository(config.cluster.name_resolve, config.cluster.fileroot)
        repo.clear_subtree(trial_root(config.experiment_name, config.trial_name))
        env = forwarded_env(config)
        addrs = job.start_servers(env) if needs_servers(config) else []
        job.start_trainers(script, script_args, {**trainer_env(config, addrs), **env})
        job.wait()
        logger.info("trainer finished; logs in %s", job.log_dir)
        return 0
    finally:
        job.teardown()
        ray.shutdown()


def main(argv: list[str] | None = None) -> None:
    process.run_launcher(run, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    # Run through the importable module so Ray pickles ProcessActor by reference.
    from arealite.launcher.ray import main as _main

    _main()
