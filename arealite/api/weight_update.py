"""`weight_update: auto`: the fastest transport the run's layout allows, chosen from the config.

Measured on one H200 (docs/results.md): tensor handles made a GRPO step 6.5x faster than the
disk round trip, which was 85% of the step. So `auto` takes the fastest path that works where
the servers are: CUDA IPC handles when they share the trainer's GPU (`cluster.share_gpus`), the
NCCL broadcast when they sit on other GPUs of the node, and disk where neither applies (a CPU run,
servers on other nodes, vLLM, a LoRA actor, colocated generation). The rule reads the config
only, so the launcher (which resolves it once, logs the reason and passes the result to the
trainer as an override) and a trainer started without a launcher pick the same transport.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("arealite.weight_update")

AUTO = "auto"
WEIGHT_UPDATE_CHOICES = (AUTO, "disk", "distributed", "tensor")


def choose_weight_update(config) -> tuple[str, str]:
    """(mode, why) that `weight_update: auto` means for `config` (a GRPOConfig)."""
    alloc, cluster = config.allocation, config.cluster
    if getattr(config, "mode", "train") != "train":
        return "disk", f"mode={config.mode} pushes no weights"
    if alloc.colocated:
        return "disk", "colocated generation: each rank copies its weights in memory"
    if alloc.gen_backend == "vllm":
        return "disk", "vLLM servers have no SGLang weight endpoints"
    if getattr(getattr(config, "actor", None), "lora", None) is not None:
        return "disk", "a LoRA actor syncs merged weights through disk"
    if not cluster.n_gpus_per_node:
        return "disk", "CPU run (cluster.n_gpus_per_node=0): no CUDA handles, no NCCL"
    return _choose_on_gpus(alloc, cluster)


def _choose_on_gpus(alloc, cluster) -> tuple[str, str]:
    tp = alloc.gen.tensor_parallel_size if alloc.gen is not None else 1
    if cluster.share_gpus and tp == 1:
        return "tensor", "servers share the trainer's GPU (cluster.share_gpus): CUDA IPC handles"
    if cluster.share_gpus:
        return "disk", (
            f"servers of TP {tp} share the trainer's GPUs: handles need TP 1 and "
            "NCCL refuses two members on one device"
        )
    if cluster.n_nodes > 1:
        return "disk", (
            f"cluster.n_nodes={cluster.n_nodes}: servers may be on other nodes, with "
            "no NCCL group set up across them (weight_update=distributed where "
            "they reach trainer rank 0)"
        )
    return "distributed", "servers on other GPUs of this node: trainer rank 0 broadcasts over NCCL"


_logged: set[tuple[str, str]] = set()


def resolve_weight_update(config) -> str:
    """`config.weight_update`, with `auto` replaced (in place) by `choose_weight_update`'s mode
    and the reason logged once per process; an explicit mode is returned unchanged."""
    if config.weight_update != AUTO:
        return config.weight_update
    mode, why = choose_weight_update(config)
    config.weight_update = mode
    if (mode, why) not in _logged:
        _logged.add((mode, why))
        logger.info("weight_update auto -> %s: %s", mode, why)
    return mode
