"""The preflight memory plan (arealite/launcher/memory_plan.py): parameters from config.json as
the real model counts them, a layout that cannot fit refused before anything starts (naming the
knobs), the GPU bench's dry mode, and the trainer estimate against a real train step's peak
resident memory on CPU (bench/memory_plan.py --measure; within 20%)."""

import json
import os
import subprocess
import sys

import pytest
from _launch import example_argv

from arealite.api.cli_args import ConfigError, GRPOConfig
from arealite.api.config_loader import load_expr_config
from arealite.launcher.memory_plan import GIB, ModelShape, check_plan, plan_memory, read_model_shape
from arealite.launcher.preflight import load_and_check

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench", "memory_plan.py")
GSM8K = os.path.join(ROOT, "examples", "configs", "gsm8k_grpo.yaml")
sys.path.insert(0, os.path.dirname(BENCH))

from memory_plan import QWEN_SHAPES  # noqa: E402  (bench/memory_plan.py: the dry mode's shapes)

QWEN15 = QWEN_SHAPES["Qwen2.5-1.5B"]


def test_parameters_match_the_real_models():
    assert ModelShape.from_hf_config(QWEN15).params == 1_543_714_304  # Qwen2.5-1.5B's count
    q05 = dict(
        QWEN15,
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        intermediate_size=4864,
    )
    assert ModelShape.from_hf_config(q05).params == 494_032_768  # Qwen2.5-0.5B's


@pytest.mark.parametrize("tied", [True, False])
def test_parameters_of_a_built_model(tmp_path, tied):
    import torch
    from transformers import AutoModelForCausalLM

    from arealite.testing.tiny_model import build_tiny_model

    path = build_tiny_model(str(tmp_path), tie_word_embeddings=tied, model_vocab_size=2000)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert read_model_shape(path).params == sum(p.numel() for p in model.parameters())


def gsm8k(*overrides) -> GRPOConfig:
    args = ["--config", GSM8K, "actor.path=unused", "cluster.gpu_memory_gb=79.6"]
    return load_expr_config([*args, *overrides], GRPOConfig)


def test_shipped_gsm8k_fits_and_one_shared_gpu_is_refused_naming_the_knobs():
    shape = ModelShape.from_hf_config(QWEN15)
    warnings = []
    check_plan(plan_memory(gsm8k(), shape, 79.6 * GIB), warnings.append)  # 2 GPUs: fits
    shared = gsm8k("cluster.n_gpus_per_node=1", "cluster.share_gpus=true")
    with pytest.raises(ConfigError) as e:
        check_plan(plan_memory(shared, shape, 79.6 * GIB), warnings.append)
    msg = str(e.value)
    assert "needs 100.7 GiB but has 79.6" in msg
    for knob in (
        "actor.mb_spec.max_tokens_per_mb",
        "server.mem_fraction_static",
        "cluster.share_gpus=false",
        "cluster.gpu_memory_gb",
    ):
        assert knob in msg
    smaller = gsm8k(
        "cluster.n_gpus_per_node=1", "cluster.share_gpus=true", "server.mem_fraction_static=0.4"
    )
    check_plan(plan_memory(smaller, shape, 79.6 * GIB), warnings.append)  # 86%: no warning
    check_plan(plan_memory(smaller, shape, 72 * GIB), warnings.append)
    assert len(warnings) == 1 and "91%" in warnings[0]


def test_activation_knobs_shrink_the_trainer():
    shape = ModelShape.from_hf_config(QWEN15)
    peak = lambda *o: plan_memory(gsm8k(*o), shape, None).trainer["peak"]  # noqa: E731
    base = peak()
    assert peak("actor.mb_spec.max_tokens_per_mb=4096") < base - 5 * GIB  # the logits
    assert peak("actor.gradient_checkpointing=false") > base + 20 * GIB
    two = peak("allocation_mode=sglang.d1p1t1+d2p1t1", "cluster.n_gpus_per_node=3")
    assert two < base - 8 * GIB  # FSDP halves the weights and Adam's states


def test_preflight_refuses_before_anything_starts(tmp_path, tiny_model_dir):
    argv = example_argv(
        "grpo.py",
        "arith_grpo.yaml",
        f"cluster.fileroot={tmp_path}",
        f"actor.path={tiny_model_dir}",
        "cluster.n_gpus_per_node=2",
    )
    load_and_check([*argv, "cluster.gpu_memory_gb=8"])
    with pytest.raises(ConfigError, match="GPU with trainer rank needs .* GiB but has 0.5"):
        load_and_check([*argv, "cluster.gpu_memory_gb=0.5"])


def test_gpu_bench_dry_mode_prints_the_plans(tmp_path):
    """`bash bench/gpu_run.sh OUT dry`: the GPU bench's CPU mode (bench/memory_plan.py --dry)."""
    script = os.path.join(ROOT, "bench", "gpu_run.sh")
    out = subprocess.run(
        ["bash", script, str(tmp_path), "dry"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env={**os.environ, "PY": sys.executable},
    ).stdout
    assert (tmp_path / "memory_plan.log").read_text() == out
    for model in ("Qwen2.5-0.5B", "Qwen2.5-1.5B"):
        assert f"== {model}, as shipped (server GPU 0, trainer GPU 1): fits" in out
        assert f"== {model}, one GPU, shared: refused" in out
    assert "1.54B parameters" in out and "GPU with server + trainer rank" in out


@pytest.mark.integration
def test_the_trainer_estimate_is_within_20_percent_of_the_measured_peak():
    """Two real fp32 train steps per case (bench/memory_plan.py): a model with gradient
    checkpointing, and one whose logits (a 16k vocabulary x 2048 tokens) dominate."""
    out = subprocess.run(
        [sys.executable, BENCH, "--measure", "checkpointing", "logits"],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    ).stdout
    recs = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [r["case"] for r in recs] == ["checkpointing", "logits"]
    for r in recs:
        assert 0.8 <= r["plan_over_measured"] <= 1.2, r


def test_a_tensor_group_is_planned_as_one():
    """d1t2 is one data-parallel replica over two ranks: the same batch per rank as d1t1, the
    parameters and optimizer states halved, and the plan says dp 1 x tp 2."""
    shape = ModelShape.from_hf_config(QWEN15)

    def plan(mode):
        config = gsm8k(f"allocation_mode={mode}", "cluster.n_gpus_per_node=3")
        return plan_memory(config, shape, None)

    t1, t2 = plan("sglang.d1p1t1+d1p1t1"), plan("sglang.d1p1t1+d1p1t2")
    assert t2.setup.mb_tokens == t1.setup.mb_tokens and t2.setup.dp == 1
    for term in ("optimizer", "grads"):
        assert t2.trainer[term] == pytest.approx(t1.trainer[term] / 2)
    assert t2.trainer["logits"] < t1.trainer["logits"]  # vocabulary-parallel
    assert "dp 1 x tp 2" in t2.describe() and "tp" not in t1.describe().split("\n")[1]
