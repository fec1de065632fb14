"""FSDPEngine: an HF model trained with PyTorch FSDP2 over all trainer ranks.

One rank per process (torchrun), gloo on CPU and NCCL on GPU; a 1-D data-parallel device mesh,
or with `tensor_parallel_size` T > 1 (allocation_mode ...dNtT) a 2-D one: DTensor tensor
parallelism inside each replica, FSDP2 across replicas (tensor_parallel.py).
Also where weights leave the trainer: HF checkpoints (export, disk weight sync), DCP
checkpoints (recovery, with optimizer / LR schedule / RNG; dcp_checkpoint.py), and the NCCL
broadcast to SGLang.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from arealite.api.cli_args import TrainEngineConfig
from arealite.api.io_struct import FinetuneSpec, ParamSpec, SaveLoadMeta, WeightUpdateMeta
from arealite.checkpoint.save_load import (
    atomic_dir,
    copy_non_weight_files,
    load_safetensors_dir,
    write_safetensors_shards,
)
from arealite.engine.base_hf_engine import BaseHFEngine, logger
from arealite.engine.dcp_checkpoint import load_dcp, save_dcp
from arealite.engine.fsdp import iter_full_buckets, plan_buckets
from arealite.engine.hf_model import load_hf_model
from arealite.engine.lora import adapter_weights, apply_lora, merge_lora_weights
from arealite.engine.optimizer import build_optimizer
from arealite.engine.tensor_parallel import TensorParallelMixin
from arealite.utils import distributed as du
from arealite.utils.hardware import resolve_dtype
from arealite.utils.tensor_handles import serialize_named_tensors
from arealite.utils.vision import checkpoint_to_module_names


class FSDPEngine(TensorParallelMixin, BaseHFEngine):
    """`FSDPEngine(config).initialize(addr=None, ft_spec=spec)`; see BaseHFEngine for the
    training API and TrainEngine for the contract."""

    def __init__(self, config: TrainEngineConfig):
        super().__init__(config)
        self.mesh = self.tp_mesh = None
        self._dist_joined = False
        self._weight_group = None  # (key, group): trainer rank 0 + inference servers

    # -- lifecycle ---------------------------------------------------------------------------

    def initialize(self, addr: str | None = None, ft_spec: FinetuneSpec | None = None) -> None:
        du.init_distributed(addr)
        self._dist_joined = True
        try:
            self._build(ft_spec)
        except BaseException:  # a bad config must not leave the process group joined
            self.destroy()
            raise

    def _build(self, ft_spec: FinetuneSpec | None) -> None:
        self.device = du.current_device()
        self.mesh = self._device_mesh()
        fs = self.config.fsdp  # `auto` becomes what this device computes natively
        fs.param_dtype = resolve_dtype(fs.param_dtype, self.device.type, "trainer compute")
        if self.device.type == "cpu" and fs.param_dtype != "float32":
            logger.info(
                "FSDP computes in %s on CPU: logprobs differ from an fp32 server by ~1e-2; "
                "set fsdp.param_dtype=float32 for exact train/inference agreement",
                fs.param_dtype,
            )
        model = load_hf_model(self.config)
        if self.config.lora is not None:  # adapters first: FSDP2 then wraps the PEFT model
            model = apply_lora(model, self.config.lora)
        self.model = self._shard(model)  # TP in each replica (tensor_parallel.py), then FSDP2
        if self.config.optimizer is not None:
            self.optimizer, self.lr_scheduler = build_optimizer(
                self.model, self.config.optimizer, ft_spec
            )

    def destroy(self) -> None:
        self.model = self.optimizer = self.lr_scheduler = None
        if self._weight_group is not None:
            dist.destroy_process_group(self._weight_group[1])
            self._weight_group = None
        gc.collect()
        if self._dist_joined:
            self._dist_joined = False
            du.release_distributed()

    # -- HF checkpoints ----------------------------------------------------------------------

    def save(self, meta: SaveLoadMeta) -> None:
        """HF: safetensors shards + config + tokenizer files into meta.path (atomically).
        DCP: sharded model (+ optimizer and LR schedule with `with_optim`) + RNG states."""
        self._require_model()
        if meta.weight_format == "hf":
            lora = self.config.lora
            if lora is None or lora.save_merged:
                self._save_hf(meta.path, meta.tokenizer, meta.base_model_path)
            if lora is not None:  # the PEFT adapter beside (or instead of) the merged model
                self.save_adapter(os.path.join(meta.path, "adapter"))
        else:
            optim = (self.optimizer, self.lr_scheduler) if meta.with_optim else (None, None)
            save_dcp(meta.path, self.model, self._version, *optim)

    def load(self, meta: SaveLoadMeta) -> None:
        self._require_model()
        if meta.weight_format == "hf":
            self._load_hf(meta.path)
        else:
            optim = (self.optimizer, self.lr_scheduler) if meta.with_optim else (None, None)
            self._version = load_dcp(meta.path, self.model, *optim)

    def _bucket_bytes(self, mb: int | None = None) -> int:
        return int((mb or self.config.weight_update_bucket_mb) * (1 << 20))

    def _save_hf(
        self, path: str, tokenizer: Any = None, base_model_path: str | None = None
    ) -> None:
        """Gather one bucket of full tensors at a time; rank 0 writes it as one safetensors
        shard, so peak extra memory is about one bucket, not a second model copy."""
        buckets = plan_buckets(self.model, self._bucket_bytes())
        gathered = iter_full_buckets(buckets, device=self.device, to_cpu=du.is_main())
        if not du.is_main():
            for _ in gathered:  # take part in the collectives only
                pass
            du.barrier()
            return
        with atomic_dir(path) as tmp:
            copy_non_weight_files(base_model_path or self.config.path, tmp)
            if self.config.lora is not None:  # one merged shard: A, B and W may sit apart
                full = {k: v for b in gathered for k, v in b.items()}
                write_safetensors_shards([merge_lora_weights(full, self.config.lora)], 1, tmp)
            else:
                shards = (_to_original_names(self.model, b) for b in gathered)
                write_safetensors_shards(shards, len(buckets), tmp)
            if self.config.is_critic:  # the head's class, so from_pretrained(path) rebuilds it
                archs = self.model.config.architectures or []
                self.model.config.architectures = [
                    a.replace("ForCausalLM", "ForTokenClassification") for a in archs
                ]
            self.model.config.save_pretrained(tmp)
            gen_cfg = getattr(self.model, "generation_config", None)
            if gen_cfg is not None and not self.config.is_critic:
                gen_cfg.save_pretrained(tmp)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
        du.barrier()

    def save_adapter(self, path: str) -> None:
        """The LoRA adapter in PEFT format (rank 0 writes; a collective)."""
        from safetensors.torch import save_file

        if self.config.lora is None:
            raise ValueError("save_adapter: this engine has no LoRA adapters (config.lora)")
        buckets = plan_buckets(self.model, self._bucket_bytes())
        gathered = iter_full_buckets(buckets, device=self.device, to_cpu=du.is_main())
        full = {k: v for b in gathered for k, v in b.items() if ".lora_" in k}
        if du.is_main():
            with atomic_dir(path) as tmp:
                save_file(adapter_weights(full), os.path.join(tmp, "adapter_model.safetensors"))
                self.model.peft_config["default"].save_pretrained(tmp)
        du.barrier()

    def _load_hf(self, path: str) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        names = self.model.state_dict(keep_vars=True)
        # VLMs save model.layers.* but hold model.language_model.layers.* (transformers 5).
        renamed = checkpoint_to_module_names(self.model)
        full = {renamed.get(k, k): v for k, v in load_safetensors_dir(path).items()}
        by_id = {}
        for name, t in names.items():  # tied weights: fill aliases from the stored name
            by_id.setdefault(id(t), name)
            if name not in full and by_id[id(t)] in full:
                full[name] = full[by_id[id(t)]]
        missing = sorted(set(names) - set(full))
        if missing:
            raise KeyError(f"HF checkpoint {path} lacks {len(missing)} weights, e.g. {missing[:4]}")
        opts = StateDictOptions(full_state_dict=True, strict=False)
        set_model_state_dict(self.model, {k: full[k] for k in names}, options=opts)

    # -- weight sync to inference servers ----------------------------------------------------

    def upload_weights(self, meta: WeightUpdateMeta) -> None:
        """disk: an HF checkpoint at meta.path (atomic; rank 0 writes), then a barrier so the
        caller may tell the servers to reload. nccl: broadcast to the servers (GPU)."""
        self._require_model()
        if meta.type == "disk":
            self._save_hf(meta.path)
        elif meta.type == "nccl":
            if self.config.lora is not None:
                raise ValueError(
                    "LoRA weights sync through disk (merged) only: use WeightUpdateMeta.from_disk"
                )
            self._broadcast_weights(meta)
        else:
            raise ValueError(f"unknown weight update type {meta.type!r}")

    def full_weight_buckets(self, bucket_size_mb: int | None = None) -> Iterator[dict]:
        """The full weights under their checkpoint names, one bucket at a time, on every rank
        and on the trainer's device (a collective: every rank iterates; one rank: views of the
        live parameters, no copy). A LoRA model's come as one bucket, merged (W + BA)."""
        self._require_model()
        bucket_bytes = self._bucket_bytes(bucket_size_mb)
        return checkpoint_buckets(self.model, self.config.lora, self.device, bucket_bytes)

    @contextmanager
    def weight_handles(self, bucket_size_mb: int | None = None) -> Iterator[list[str]]:
        """Rank 0: one payload per bucket of full weights (`arealite.utils.tensor_handles`)
        for servers on this machine's devices to open, valid until the block ends (one rank:
        views of the live parameters, no copy). Other ranks take part in the gathers, get []."""
        if self.config.lora is not None:
            raise ValueError("LoRA weights sync through disk (merged) only: weight_update=disk")
        held = []
        for bucket in self.full_weight_buckets(bucket_size_mb):
            if du.is_main():
                held.append(list(bucket.items()))
        if held and self.device.type == "cuda":
            torch.cuda.synchronize()  # the last optimizer step's writes land first
        payloads = [serialize_named_tensors(named) for named in held]
        try:
            yield payloads
        finally:
            held.clear()

    def nccl_param_specs(self, bucket_size_mb: int | None = None) -> list[list[ParamSpec]]:
        """The broadcast plan: buckets of (checkpoint name, shape, dtype) in send order. Goes
        into `WeightUpdateMeta.nccl_param_specs` so the rollout side can tell each server what
        to receive while `upload_weights` sends it (metadata only, no collective)."""
        plan = []
        for bucket in plan_buckets(self.model, self._bucket_bytes(bucket_size_mb)):
            meta_tensors = {
                n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in bucket
            }
            named = _to_original_names(self.model, meta_tensors)
            plan.append([ParamSpec.of((n, t.shape, t.dtype)) for n, t in named.items()])
        return plan

    def _broadcast_weights(self, meta: WeightUpdateMeta) -> None:
        """SGLang's distributed update, trainer side. The rollout engine makes the servers join
        group `meta.nccl_group_name` (/init_weights_update_group) and receive bucket after
        bucket (/update_weights_from_distributed, from meta.nccl_param_specs); here all ranks
        gather each bucket and rank 0 broadcasts it (src 0) in that group. NCCL on GPU; gloo on
        CPU (the embedded server accepts backend 'gloo')."""
        specs = self.nccl_param_specs(meta.bucket_size_mb)
        if meta.nccl_param_specs and meta.param_buckets() != specs:
            raise ValueError(
                "meta.nccl_param_specs differ from this trainer's plan (bucket_size_mb or model "
                "mismatch): fill them with engine.nccl_param_specs(meta.bucket_size_mb)"
            )
        if du.is_main():
            self._join_weight_group(meta)
        buckets = plan_buckets(self.model, self._bucket_bytes(meta.bucket_size_mb))
        for bucket in iter_full_buckets(buckets, device=self.device, to_cpu=False):
            if du.is_main():
                for t in _to_original_names(self.model, bucket).values():
                    dist.broadcast(t.contiguous(), src=0, group=self._weight_group[1])
            del bucket
        du.barrier()

    def _join_weight_group(self, meta: WeightUpdateMeta) -> None:
        """Rank 0 of the group (and its TCP store) is trainer rank 0; servers follow."""
        key = (meta.nccl_master_address, meta.nccl_master_port, meta.nccl_group_name)
        if self._weight_group is not None and self._weight_group[0] == key:
            return
        if not meta.nccl_world_size:
            raise ValueError(
                "nccl weight update needs meta.nccl_world_size (trainer rank 0 plus every "
                "server's tensor-parallel ranks): fill it with the rollout engine's "
                "nccl_world_size()"
            )
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if meta.nccl_backend != backend:
            raise ValueError(
                f"meta.nccl_backend={meta.nccl_backend!r} but this trainer's weights are on "
                f"{self.device.type}, which needs {backend!r}: the servers would join another "
                "kind of group"
            )
        group = du.init_custom_process_group(
            backend,
            f"tcp://{meta.nccl_master_address}:{meta.nccl_master_port}",
            meta.nccl_world_size,
            0,
            meta.nccl_group_name,
        )
        self._weight_group = (key, group)


def checkpoint_buckets(model, lora, device, bucket_bytes: int) -> Iterator[dict]:
    """FSDPEngine.full_weight_buckets: gather bucket by bucket, rename to checkpoint names;
    LoRA: everything first (A, B and W may sit in different buckets), then merge."""
    gathered = iter_full_buckets(plan_buckets(model, bucket_bytes), device=device, to_cpu=False)
    if lora is not None:
        yield merge_lora_weights({k: v for b in gathered for k, v in b.items()}, lora)
        return
    for bucket in gathered:
        yield _to_original_names(model, bucket)


def _to_original_names(model, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Module names -> the checkpoint names HF would save (they differ for some models, e.g.
    VLMs renamed in transformers 5); identity where no conversion is registered."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # older transformers: module names are checkpoint names
        return tensors
    return revert_weight_conversion(model, tensors)
