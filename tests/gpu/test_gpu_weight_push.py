"""The NCCL weight push into the embedded server on CUDA: trainer on one GPU, server on
another (NCCL refuses two members of a group on one device); it then serves what a server
loading the same weights from disk serves (that one on the CPU, so 2 GPUs suffice)."""

from __future__ import annotations

import pytest
import requests
import torch
from _gpu import need_gpus
from _torchrun_fsdp import engine_config, make_batch

from arealite.api.cli_args import InferenceEngineConfig
from arealite.api.train_config import FSDPConfig
from arealite.engine.fsdp_engine import FSDPEngine
from arealite.engine.sft.lm_engine import sft_loss_fn, sft_loss_weight
from arealite.inference.sglang_remote import RemoteSGLangEngine
from arealite.rollout import WorkflowExecutor
from arealite.trainer.weight_sync import WeightSync


def greedy(url: str, prompt: list[int]) -> list[float]:
    body = {"input_ids": prompt, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}}  # fmt: skip
    out = requests.post(url + "/generate", json=body, timeout=120).json()
    return [x[0] for x in out["meta_info"]["output_token_logprobs"]]


@pytest.mark.integration
def test_nccl_push_equals_disk_push(tiny_model_dir, build_engine, tmp_path):
    need_gpus(2)  # trainer, server pushed over NCCL
    from arealite.server.process import launch_server

    fsdp = FSDPConfig(param_dtype="float32", reduce_dtype="float32")
    actor = build_engine(FSDPEngine, engine_config(tiny_model_dir, fsdp=fsdp,
                                                   weight_update_bucket_mb=1))  # fmt: skip
    nccl = {"NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "0"}
    extra = ["--allowed-weight-roots", str(tmp_path)]
    with (
        launch_server(tiny_model_dir, dtype="float32", env={"CUDA_VISIBLE_DEVICES": "1", **nccl}) as a,
        launch_server(tiny_model_dir, dtype="float32", extra_args=extra,
                      env={"CUDA_VISIBLE_DEVICES": ""}) as b,
    ):  # fmt: skip
        executors = []
        for server in (a, b):
            engine = RemoteSGLangEngine(InferenceEngineConfig(consumer_batch_size=1))
            engine.initialize([server.url.removeprefix("http://")])
            executors.append(WorkflowExecutor(engine.config, engine))
            executors[-1].initialize()
        try:
            actor.train_batch(make_batch(n=4), sft_loss_fn, sft_loss_weight)
            WeightSync("distributed", actor, executors[0], str(tmp_path / "x")).push(1)
            WeightSync("disk", actor, executors[1], str(tmp_path / "w")).push(1)
            prompt = make_batch(n=1, seed=3)["input_ids"][0, :6].tolist()
            got_a, got_b = torch.tensor(greedy(a.url, prompt)), torch.tensor(greedy(b.url, prompt))
            assert (got_a - got_b).abs().max() < 1e-3  # GPU vs CPU fp32 kernels
        finally:
            for ex in executors:
                ex.destroy()
                ex.engine.destroy()
