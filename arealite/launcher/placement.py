"""Where each process of a run goes: one rule for every launcher.

`check_resources`: the allocation fits the cluster of `cluster.*`. `plan_cluster`: the cluster
launchers' (Ray, Slurm) nodes for servers and trainer ranks. `plan_local` / `plan_gpus`: the
local launcher's devices.

Devices are handed out from one counter over the GPUs this launcher may use (an existing
`CUDA_VISIBLE_DEVICES`, else every GPU of the node): first each inference server's
tensor-parallel group, then the trainer ranks, so no trainer rank ever lands next to a server
holding most of a GPU's memory, and no NCCL group ever has two members on one device. The
local launcher applies the plan itself; Ray and Slurm get the same disjointness from their
schedulers (`num_gpus` bundles, `--gres` steps), and every launcher gives trainer ranks the
NCCL settings SGLang sets in its own processes (`trainer_nccl_env`).
"""

from __future__ import annotations

from dataclasses import dataclass

from arealite.api.cli_args import ConfigError

# NCCL settings SGLang sets in its processes (sglang/srt/entrypoints/engine.py,
# `_set_envs_and_config`, default server args: no symmetric memory, no NVLS). Every member of
# the weight-update communicator must agree, or its creation can hang.
SGLANG_NCCL_ENV = {"NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "0"}


def trainer_nccl_env(user_env: dict[str, str] | None = None) -> dict[str, str]:
    """SGLang's NCCL settings for trainer ranks; a value the user set explicitly wins."""
    user_env = user_env or {}
    return {k: v for k, v in SGLANG_NCCL_ENV.items() if k not in user_env}


def visible_devices(n_physical: int, cuda_visible: str | None) -> list[str]:
    """The device ids this launcher may hand out: the entries of an existing
    CUDA_VISIBLE_DEVICES (indices or UUIDs, as CUDA reads them: up to the first invalid
    entry) or 0..n_physical-1. An empty CUDA_VISIBLE_DEVICES hides every GPU."""
    if cuda_visible is None:
        return [str(i) for i in range(n_physical)]
    out = []
    for entry in (e.strip() for e in cuda_visible.split(",")):
        if not entry or entry.startswith("-"):
            break  # CUDA ignores everything from the first invalid entry on
        out.append(entry)
    return out


@dataclass(frozen=True)
class GpuPlan:
    """Device ids (CUDA_VISIBLE_DEVICES entries) of each server and of the trainer ranks;
    trainer rank LOCAL_RANK uses the LOCAL_RANK-th of `trainer`. With tensor parallelism
    (`trainer_tp` > 1) consecutive ranks form a tensor group (the engine's mesh: tp inner)."""

    servers: tuple[tuple[str, ...], ...]
    trainer: tuple[str, ...]
    trainer_tp: int = 1

    def server_env(self, index: int) -> dict[str, str]:
        return {"CUDA_VISIBLE_DEVICES": ",".join(self.servers[index])}

    def trainer_env(self) -> dict[str, str]:
        return {"CUDA_VISIBLE_DEVICES": ",".join(self.trainer)}

    def describe(self) -> str:
        lines = [f"server{i}: GPU {','.join(d)}" for i, d in enumerate(self.servers)]
        tp = self.trainer_tp
        for r, d in enumerate(self.trainer):
            where = f" (tensor group {r // tp}, tp {r % tp})" if tp > 1 else ""
            lines.append(f"trainer rank {r}: GPU {d}{where}")
        return "GPU placement:\n  " + "\n  ".join(lines)


def plan_gpus(
    n_servers: int,
    tp: int,
    n_ranks: int,
    devices: list[str],
    share: bool = False,
    trainer_tp: int = 1,
) -> GpuPlan:
    """Servers first (`tp` devices each: a server's whole model-parallel group), then one device
    per trainer rank, from one counter; ConfigError naming the shortfall when `devices` are too
    few. `share` (cluster.share_gpus): the trainer ranks start again from the first device."""
    need = max(n_servers * tp, n_ranks) if share else n_servers * tp + n_ranks
    if need > len(devices):
        how, which = ("sharing GPUs with", "") if share else ("+", "distinct ")
        raise ConfigError(
            f"not enough GPUs: {n_servers} server(s) x {tp} GPU(s) {how} {n_ranks} trainer "
            f"rank(s) need {need} {which}GPUs, but {len(devices)} are available "
            f"({','.join(devices) or 'none'}); without cluster.share_gpus servers and trainer "
            "ranks never share a GPU (a shared GPU must hold both, and NCCL refuses two ranks on "
            "one device): shrink allocation_mode, add GPUs, or set cluster.share_gpus=true "
            "(with weight_update=tensor or disk)"
        )
    servers = tuple(tuple(devices[i * tp : (i + 1) * tp]) for i in range(n_servers))
    start = 0 if share else n_servers * tp
    return GpuPlan(servers, tuple(devices[start : start + n_ranks]), trainer_tp)


def plan_local(config, n_physical: int, cuda_visible: str | None) -> GpuPlan | None:
    """The local launcher's plan for `config`, or None for a CPU run (`cluster.n_gpus_per_node`
    is 0 or the node shows no GPU). Only the first `n_gpus_per_node` visible GPUs are used."""
    per_node = config.cluster.n_gpus_per_node
    devices = visible_devices(n_physical, cuda_visible)
    if not per_node:
        return None
    if per_node > len(devices):
        where = (
            f"CUDA_VISIBLE_DEVICES={cuda_visible!r}" if cuda_visible is not None else "this node"
        )
        raise ConfigError(
            f"cluster.n_gpus_per_node={per_node} but {where} shows {len(devices)} GPU(s); "
            "set cluster.n_gpus_per_node to the GPUs you mean to use (0: CPU only)"
        )
    alloc = config.allocation
    n_servers = alloc.gen_n_servers
    per_server = alloc.gen_world_size // n_servers if n_servers else 1
    share = config.cluster.share_gpus
    return plan_gpus(
        n_servers,
        per_server,
        alloc.train_world_size,
        devices[:per_node],
        share,
        alloc.train.tensor_parallel_size,
    )


def check_resources(config, n_gpus_available: int | None = None) -> None:
    """The allocation fits the cluster described in `cluster.*`."""
    alloc = config.allocation
    n_gpus = config.cluster.n_gpus_per_node * config.cluster.n_nodes
    share = config.cluster.share_gpus
    if share and getattr(config, "weight_update", "disk") == "distributed":
        raise ConfigError(
            "cluster.share_gpus=true needs weight_update=tensor (or disk): the NCCL weight-update "
            "group would put the trainer's rank 0 and a server on one device, which NCCL refuses"
        )
    if n_gpus:
        need = alloc.gen_world_size + alloc.train_world_size
        if share:
            need = max(alloc.gen_world_size, alloc.train_world_size)
        if need > n_gpus:
            raise ConfigError(
                f"allocation_mode={config.allocation_mode!r} needs {need} GPUs "
                f"({alloc.gen_world_size} for inference + {alloc.train_world_size} for training) "
                f"but cluster has {config.cluster.n_nodes} x {config.cluster.n_gpus_per_node} = {n_gpus}"
            )
        if n_gpus_available is not None and config.cluster.n_gpus_per_node > n_gpus_available:
            raise ConfigError(
                f"cluster.n_gpus_per_node={config.cluster.n_gpus_per_node} but this node has "
                f"{n_gpus_available} GPU(s)"
            )


@dataclass
class ClusterPlan:
    """Where a cluster launcher (Ray, Slurm) puts inference servers and trainer ranks.

    GPU clusters: a server's tensor-parallel group stays on one node; trainer ranks fill whole
    nodes (torchrun needs the same number of ranks on every node); servers and trainers get
    separate nodes unless everything fits on one. CPU-only runs put the trainer on one node and
    the servers on one node (possibly the same)."""

    gpu: bool
    gen_nodes: int
    servers_per_node: int
    train_nodes: int
    ranks_per_node: int
    cpus_per_server: int
    cpus_per_train_node: int
    nodes_needed: int


def plan_cluster(config) -> ClusterPlan:
    """Lay the allocation out on `cluster.n_nodes` x `cluster.n_gpus_per_node`, or fail naming
    the allocation, the cluster and what does not fit (before anything is submitted)."""
    alloc, cl = config.allocation, config.cluster
    gpn, W, n_servers = cl.n_gpus_per_node, alloc.train_world_size, alloc.gen_n_servers
    tp = alloc.gen.tensor_parallel_size if alloc.gen else 1
    where = (
        f"allocation_mode={config.allocation_mode!r} on cluster {cl.n_nodes} node(s) x {gpn} GPU(s)"
    )
    if not gpn:
        cpus_train = max(1, (cl.n_cpus_per_node or 0) - n_servers) if cl.n_cpus_per_node else 1
        gen_nodes = 1 if n_servers else 0
        return ClusterPlan(False, gen_nodes, n_servers, 1, W, 1, cpus_train, 1)
    if cl.share_gpus:
        raise ConfigError(f"{where}: cluster.share_gpus is for the local launcher only")
    check_resources(config)
    if tp > gpn:
        raise ConfigError(
            f"{where}: a server's tensor-parallel group (t{tp}) must fit on one node of {gpn} GPU(s)"
        )
    if W > gpn and W % gpn:
        raise ConfigError(
            f"{where}: {W} trainer ranks do not fill whole nodes of {gpn} GPU(s); use a multiple "
            f"of {gpn} (torchrun runs the same number of ranks on every node)"
        )
    cpus_per_gpu = max(1, (cl.n_cpus_per_node or gpn) // gpn)
    train_nodes, ranks_per_node = (1, W) if W <= gpn else (W // gpn, gpn)
    servers_per_node = gpn // tp
    gen_nodes = -(-n_servers // servers_per_node) if n_servers else 0
    fits_one = alloc.gen_world_size + W <= gpn
    needed = 1 if fits_one else gen_nodes + train_nodes
    if needed > cl.n_nodes:
        raise ConfigError(
            f"{where}: needs {gen_nodes} node(s) for {n_servers} server(s) of {tp} GPU(s) + "
            f"{train_nodes} node(s) for {W} trainer rank(s) = {needed} > cluster.n_nodes={cl.n_nodes}"
        )
    return ClusterPlan(
        True,
        gen_nodes,
        servers_per_node,
        train_nodes,
        ranks_per_node,
        tp * cpus_per_gpu,
        ranks_per_node * cpus_per_gpu,
        needed,
    )
