"""Loading an HF model for training: causal LM, vision-language model, or a critic (the same
backbone with a 1-output value head), identical on every rank before sharding."""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

from arealite.api.cli_args import TrainEngineConfig
from arealite.engine.fsdp import torch_dtype
from arealite.engine.vlm_inputs import vlm_attn_implementation
from arealite.utils.vision import is_vlm_config


def check_attn_impl(attn_impl: str) -> None:
    """flash_attention_2 needs a GPU and the flash-attn package (not a dependency): say so
    before loading, instead of transformers' error deep in model construction."""
    if attn_impl != "flash_attention_2":
        return
    if not torch.cuda.is_available():
        raise ValueError("attn_impl=flash_attention_2 needs a GPU; use sdpa_varlen on CPU")
    if importlib.util.find_spec("flash_attn") is None:
        raise ValueError(
            "attn_impl=flash_attention_2 needs the flash-attn package, which is not installed "
            "(pip install flash-attn --no-build-isolation); or use attn_impl=sdpa_varlen "
            "(exact packed attention without it)"
        )


def load_hf_model(config: TrainEngineConfig) -> nn.Module:
    """The HF model at `config.path` on CPU: a causal LM, a vision-language model (config with
    vision_config), or (critic) the same backbone with a 1-output token-classification head.
    Random parts (init_from_scratch, value head) use a fixed seed so every rank builds
    identical weights before sharding."""
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoModelForTokenClassification,
    )

    check_attn_impl(config.attn_impl)
    if not config.path:
        raise ValueError("TrainEngineConfig.path is empty: set it to an HF model directory")
    hf_config = AutoConfig.from_pretrained(config.path)
    cls = AutoModelForCausalLM
    if config.is_critic:
        cls = AutoModelForTokenClassification
        hf_config.num_labels = 1
        hf_config.classifier_dropout = 0.0  # a value head must be deterministic
    kw = dict(dtype=torch_dtype(config.dtype), attn_implementation=config.attn_impl)
    if is_vlm_config(hf_config):
        if config.is_critic:
            raise ValueError("a critic (value head) on a vision-language model is not supported")
        cls = AutoModelForImageTextToText
        kw["attn_implementation"] = vlm_attn_implementation(config.attn_impl)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        if config.init_from_scratch:
            model = cls.from_config(hf_config, **kw)
        else:
            model = cls.from_pretrained(config.path, config=hf_config, **kw)
    model.config.use_cache = False
    if config.gradient_checkpointing:
        kwargs = {"use_reentrant": False}  # the variant PyTorch recommends with FSDP2
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model
