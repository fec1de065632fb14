"""Attention for packed micro-batches on GPU: varlen reads the sequence lengths from the
device once per micro-batch (not once per layer, a GPU sync each), and flash_attention_2
without its package fails naming the package and the alternative."""

import importlib.util

import pytest
import torch
from transformers import AutoModelForCausalLM

from arealite.engine import varlen_attention
from arealite.engine.hf_model import check_attn_impl


def test_lengths_are_read_once_per_micro_batch_not_per_layer(tiny_model_dir, monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa_varlen")
    assert model.config.num_hidden_layers > 1
    lengths = [5, 3, 7]
    cu = torch.tensor([0, 5, 8, 15], dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    reads = []
    original = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(1) or original(t))
    with torch.no_grad():
        out = model(
            input_ids=torch.randint(0, 100, (1, 15)),
            position_ids=positions,
            cu_seq_lens_q=cu,
            cu_seq_lens_k=cu,
            max_length_q=7,
            max_length_k=7,
        )
    assert out.logits.shape[1] == 15
    assert len(reads) == 1  # one device read for all layers
    assert varlen_attention.packed_lengths(cu) == tuple(lengths)


def test_flash_attention_2_without_its_package_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "flash_attn" else real(n, *a)
    )
    with pytest.raises(ValueError, match="needs the flash-attn package.*attn_impl=sdpa_varlen"):
        check_attn_impl("flash_attention_2")
    check_attn_impl("sdpa_varlen")  # no package needed
