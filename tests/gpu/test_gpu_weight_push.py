"""Weight pushes into the embedded server on CUDA: over NCCL (trainer on one GPU, server on
another: NCCL refuses two members of a group on one device), or as CUDA IPC handles (trainer
and server share one GPU). The server then serves what a server loading the same weights from
disk serves (that one on the CPU, so 2 GPUs, or 1, suffice)."""

from __future__ import annotations

import pytest
import requests
import torch
from _gpu import need_gpus
from _torchrun_fsdp import engine_config, make_batch

from arealite.api.cli_args import RolloutConfig
from arealite.api.train_config import FSDPConfig
from arealite.engine.fsdp_engine import FSDPEngine
from arealite.engine.sft.lm_engine import sft_loss_fn, sft_loss_weight
from arealite.inference.sglang_remote import RemoteSGLangEngine
from arealite.rollout import WorkflowExecutor
from arealite.trainer.weight_sync import WeightSync


def greedy(url: str, prompt: list[int]) -> list[float]:
    body = {
        "input_ids": prompt,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True},
    }
    out = requests.post(url + "/generate", json=body, timeout=120).json()
    return [x[0] for x in out["meta_info"]["output_token_logprobs"]]


def push_and_compare(mode: str, gpu_env: dict, build_engine, tiny_model_dir, tmp_path) -> None:
    """Train, push with `mode` into a server on the GPU (`gpu_env`) and from disk into one on
    the CPU, twice; both then serve the same greedy logprobs."""
    from arealite.server.process import launch_server

    fsdp = FSDPConfig(param_dtype="float32", reduce_dtype="float32")
    actor = build_engine(
        FSDPEngine, engine_config(tiny_model_dir, fsdp=fsdp, weight_update_bucket_mb=1)
    )
    extra = ["--allowed-weight-roots", str(tmp_path)]
    with (
        launch_server(tiny_model_dir, dtype="float32", env=gpu_env) as a,
        launch_server(
            tiny_model_dir, dtype="float32", extra_args=extra, env={"CUDA_VISIBLE_DEVICES": ""}
        ) as b,
    ):
        executors = []
        for server in (a, b):
            engine = RemoteSGLangEngine(RolloutConfig(consumer_batch_size=1))
            engine.initialize([server.url.removeprefix("http://")])
            executors.append(WorkflowExecutor(engine.config, engine))
            executors[-1].initialize()
        try:
            syncs = [
                WeightSync(mode, actor, executors[0], str(tmp_path / "x")),
                WeightSync("disk", actor, executors[1], str(tmp_path / "w")),
            ]
            prompt = make_batch(n=1, seed=3)["input_ids"][0, :6].tolist()
            for version in (1, 2):
                actor.train_batch(make_batch(n=4, seed=version), sft_loss_fn, sft_loss_weight)
                for sync in syncs:
                    sync.push(version)
                got_a = torch.tensor(greedy(a.url, prompt))
                got_b = torch.tensor(greedy(b.url, prompt))
                assert (got_a - got_b).abs().max() < 1e-3  # GPU vs CPU fp32 kernels
        finally:
            for ex in executors:
                ex.destroy()
                ex.engine.destroy()


@pytest.mark.integration
def test_nccl_push_equals_disk_push(tiny_model_dir, build_engine, tmp_path):
    need_gpus(2)  # trainer, server pushed over NCCL
    nccl = {"NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "0"}
    push_and_compare(
        "distributed", {"CUDA_VISIBLE_DEVICES": "1", **nccl}, build_engine, tiny_model_dir, tmp_path
    )


@pytest.mark.integration
def test_tensor_push_on_a_shared_gpu_equals_disk_push(tiny_model_dir, build_engine, tmp_path):
    """cluster.share_gpus: trainer and server on GPU 0; the server opens CUDA IPC handles of
    the trainer's weights (weight_update=tensor)."""
    need_gpus(1)
    push_and_compare(
        "tensor", {"CUDA_VISIBLE_DEVICES": "0"}, build_engine, tiny_model_dir, tmp_path
    )
