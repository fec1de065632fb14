"""The training loop's weight sync, written once: trainer -> inference servers.

Three transports (GRPOConfig.weight_update):
- `disk`: every rank takes part in writing an HF checkpoint under `<run_dir>/weight_sync`,
  then rank 0 tells the servers to reload it. The write must finish before the reload.
- `tensor`: servers on the trainer's own GPU (`cluster.share_gpus`) open CUDA IPC handles of
  its weights and copy them on the device (SGLang's /update_weights_from_tensor): no disk, and
  no NCCL group, which refuses two members on one device.
- `distributed`: trainer rank 0 and every server rank form one process group (NCCL on GPU,
  gloo on CPU) and rank 0 broadcasts the weights bucket by bucket (SGLang's
  /init_weights_update_group + /update_weights_from_distributed). Here the order is the
  reverse: the servers' side must already be waiting in the group's rendezvous when trainer
  rank 0 joins it, or rank 0 blocks hosting a store nobody connects to.

Colocated generation (`allocation_mode: colocated+...`) needs none of them: every rank copies
the gathered weights into its own in-process generator (ColocatedEngine.load_weights).

`WeightSync.push` does either in the right order, so a training script never orders the two
sides itself. Every trainer rank calls it (the upload gathers shards collectively).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from arealite.api.io_struct import WeightUpdateMeta
from arealite.utils import distributed as du
from arealite.utils.network import find_free_port, local_ip_towards

logger = logging.getLogger("arealite.weight_sync")

WEIGHT_UPDATE_MODES = ("disk", "distributed", "tensor")


class WeightSync:
    """Pushes the actor's weights to the rollout client's servers and moves every version
    counter (actor, executor, evaluation clients) together.

    actor: a train engine (upload_weights, nccl_param_specs, set_version, device, config);
    executor: the WorkflowExecutor whose engine is the rollout client (rank 0 drives it)."""

    def __init__(self, mode: str, actor, executor, weight_dir: str):
        if mode not in WEIGHT_UPDATE_MODES:
            raise ValueError(f"weight_update={mode!r}: expected one of {WEIGHT_UPDATE_MODES}")
        self.mode, self.actor, self.executor = mode, actor, executor
        self.rollout = executor.engine
        self.weight_dir = weight_dir
        self._group: tuple[str, int, int] | None = None  # (address, port, size): rank 0 only

    def push(self, version: int, followers: Iterable = ()) -> None:
        """Load the actor's current weights on every server, tagged `version`. New episodes
        wait meanwhile; `followers` (e.g. evaluation clients) then expect that version."""
        self.executor.pause()
        try:
            if getattr(self.rollout, "in_process", False):  # colocated: each rank its own copy
                self.rollout.load_weights(self.actor.full_weight_buckets(), version)
            elif self.mode == "disk":
                self._push_disk(version)
            elif self.mode == "tensor":
                self._push_tensor(version)
            else:
                self._push_distributed(version)
            du.barrier()  # every rank's clients then expect the new version
            self.actor.set_version(version)
            self.executor.set_version(version)
            for engine in followers:
                engine.expect_weight_version(version)
        finally:
            self.executor.resume()

    def _push_disk(self, version: int) -> None:
        meta = WeightUpdateMeta.from_disk(self.weight_dir, version)
        self.actor.upload_weights(meta)  # collective; returns once the checkpoint is complete
        if du.is_main():
            self.rollout.update_weights(meta).result()

    def _push_tensor(self, version: int) -> None:
        bucket_mb = self.actor.config.weight_update_bucket_mb
        with self.actor.weight_handles(bucket_mb) as payloads:  # collective
            if du.is_main():
                meta = WeightUpdateMeta(type="tensor", version=version, tensor_payloads=payloads)
                self.rollout.update_weights(meta).result()  # servers copied: handles may go

    def _push_distributed(self, version: int) -> None:
        meta = self.distributed_meta(version)
        if not du.is_main():
            self.actor.upload_weights(meta)  # gathers shards for rank 0's broadcast
            return
        pending = self.rollout.update_weights(meta)  # servers join, then wait for buckets
        self.actor.upload_weights(meta)  # hosts the group's store, broadcasts every bucket
        pending.result()

    def distributed_meta(self, version: int) -> WeightUpdateMeta:
        """The broadcast's metadata. Rank 0 fixes the group (its address as the servers see
        it, a free port, 1 + every server's TP ranks) on the first push and keeps it."""
        config = self.actor.config
        if config.lora is not None:
            raise ValueError(
                "weight_update: distributed sends full weights; LoRA runs sync merged weights "
                "through disk (weight_update: disk)"
            )
        bucket_mb = config.weight_update_bucket_mb
        if not du.is_main():
            return WeightUpdateMeta(type="nccl", version=version, bucket_size_mb=bucket_mb)
        if self._group is None:
            host = self.rollout.addresses[0].rsplit(":", 1)[0]
            address = local_ip_towards(host)
            self._group = (address, find_free_port("0.0.0.0"), self.rollout.nccl_world_size())
            logger.info("weight-update group: %s:%d, %d member(s)", *self._group)
        address, port, size = self._group
        meta = WeightUpdateMeta.from_nccl(address, port, version, bucket_mb, world_size=size)
        meta.nccl_param_specs = self.actor.nccl_param_specs(bucket_mb)
        meta.nccl_backend = "nccl" if self.actor.device.type == "cuda" else "gloo"
        return meta
