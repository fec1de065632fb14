"""Preflight refuses configs that cannot work on a GPU before anything starts: bf16 master
weights with an lr below their resolution, and weight_update=distributed where it has no
protocol; the shipped GPU configs pass (fp32 master weights, bf16 compute, varlen attention)."""

import glob
import os

import pytest
from _launch import grpo_config

from arealite.api.cli_args import ConfigError, GRPOConfig, SFTConfig
from arealite.api.config_loader import load_expr_config
from arealite.launcher.preflight import check_master_weight_precision, check_weight_update

CONFIGS = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "configs"
)


def test_bf16_master_weights_with_a_tiny_lr_are_refused(tmp_path):
    cfg = grpo_config(tmp_path, "actor.dtype=bfloat16", "actor.optimizer.lr=1e-6")
    with pytest.raises(ConfigError) as e:
        check_master_weight_precision(cfg)
    msg = str(e.value)
    assert "actor.dtype=bfloat16 with actor.optimizer.lr=1e-06" in msg
    assert "actor.dtype=float32" in msg and "actor.fsdp.param_dtype=bfloat16" in msg


@pytest.mark.parametrize(
    "overrides",
    [
        ["actor.dtype=float32", "actor.optimizer.lr=1e-6", "actor.fsdp.param_dtype=bfloat16"],
        ["actor.dtype=bfloat16", "actor.optimizer.lr=1e-3"],  # large enough to move bf16 weights
    ],
)
def test_representable_updates_pass(tmp_path, overrides):
    check_master_weight_precision(grpo_config(tmp_path, *overrides))


def test_sft_models_are_checked_too(tmp_path):
    args = [
        f"cluster.fileroot={tmp_path}",
        "model.path=x",
        "experiment_name=e",
        "trial_name=t",
        "model.dtype=bfloat16",
        "model.optimizer.lr=1e-5",
    ]
    with pytest.raises(ConfigError, match="model.dtype=bfloat16"):
        check_master_weight_precision(load_expr_config(args, SFTConfig))


def test_distributed_weight_update_needs_sglangs_protocol(tmp_path):
    check_weight_update(grpo_config(tmp_path, "weight_update=distributed"))  # embedded server: fine
    cfg = grpo_config(tmp_path, "weight_update=distributed", "allocation_mode=vllm.d1p1t1+d1p1t1")
    with pytest.raises(ConfigError, match="with vllm use weight_update=disk"):
        check_weight_update(cfg)


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(CONFIGS, "gsm8k_*.yaml"))))
def test_shipped_gpu_configs_use_fp32_masters_bf16_compute_varlen(path):
    cls = GRPOConfig if "grpo" in path else SFTConfig
    cfg = load_expr_config(["--config", path], cls)
    check_master_weight_precision(cfg)
    model = cfg.actor if cls is GRPOConfig else cfg.model
    assert (model.dtype, model.fsdp.param_dtype) == ("float32", "bfloat16")
    assert model.attn_impl in ("sdpa_varlen", "flash_attention_2")
