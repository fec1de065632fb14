"""`dtype: auto`: bf16 only where the device multiplies it natively (capability mocked both ways)."""

import logging

import pytest
import torch

from arealite.api.cli_args import FSDPConfig, ServerConfig
from arealite.server.model_runner import server_dtype
from arealite.utils import hardware


@pytest.fixture
def cpu_with(monkeypatch):
    """Pretend this CPU has exactly the given /proc/cpuinfo flags."""

    def set_flags(*flags):
        monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset(["avx2", "fma", *flags]))
        monkeypatch.setattr(hardware, "_isa_cap", lambda: "")  # torch/oneDNN not capped
        monkeypatch.setattr(hardware, "_logged", set())

    return set_flags


@pytest.mark.parametrize("flag", ["avx512_bf16", "amx_bf16"])
def test_auto_is_bf16_on_a_cpu_with_native_bf16(cpu_with, flag):
    cpu_with("avx512f", flag)
    assert hardware.resolve_dtype("auto", "cpu") == "bfloat16"
    assert server_dtype("auto", torch.device("cpu")) == torch.bfloat16


def test_auto_is_fp32_on_an_avx2_only_cpu(cpu_with, caplog):
    cpu_with("avx512f")  # AVX512 without its BF16 extension still emulates bf16
    with caplog.at_level(logging.INFO, "arealite.hardware"):
        assert hardware.resolve_dtype("auto", "cpu", "trainer compute") == "float32"
        hardware.resolve_dtype("auto", "cpu", "trainer compute")
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1, "logged once, not per call"
    assert "float32" in said[0] and "avx512_bf16" in said[0]
    assert server_dtype("auto", torch.device("cpu")) == torch.float32


@pytest.mark.parametrize(
    ("capability", "onednn", "cap"),
    [("AVX2", "", "ATEN_CPU_CAPABILITY"), ("AVX512", "AVX2", "ONEDNN_MAX_CPU_ISA=AVX2")],
)
def test_capped_isa_emulates_bf16_so_auto_is_fp32(monkeypatch, capability, onednn, cap):
    """ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 make an AMX CPU an AVX2 one (measured:
    bf16 matmul 1230 -> 2.4 GFLOP/s): `auto` must follow what torch will really run."""
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset(["avx2", "amx_bf16"]))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", onednn)
    native, why = hardware.native_bf16("cpu")
    assert not native and cap in why
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert hardware.native_bf16("cpu")[0]


@pytest.mark.parametrize("explicit", ["float32", "bfloat16", "float16"])
def test_explicit_dtype_wins(cpu_with, explicit):
    cpu_with()
    assert hardware.resolve_dtype(explicit, "cpu") == explicit
    cpu_with("amx_bf16")
    assert hardware.resolve_dtype(explicit, "cpu") == explicit


@pytest.mark.parametrize(
    ("capability", "native"), [((7, 0), False), ((7, 5), False), ((8, 0), True), ((9, 0), True)]
)
def test_cuda_capability_decides_on_gpu(capability, native):
    assert hardware.native_bf16("cuda", capability)[0] is native


def test_auto_is_the_default_for_trainer_compute_and_servers():
    assert FSDPConfig().param_dtype == "auto"
    assert ServerConfig().dtype == "auto"


@pytest.mark.parametrize(("flags", "expected"), [((), "float32"), (("amx_bf16",), "bfloat16")])
def test_fsdp_engine_resolves_auto_to_what_the_cpu_computes(
    tiny_model_dir, build_engine, cpu_with, flags, expected
):
    """The engine computes in the resolved dtype: fp32 on an AVX2-only CPU, never emulated bf16."""
    from _torchrun_fsdp import engine_config

    from arealite.engine.fsdp_engine import FSDPEngine

    cpu_with(*flags)
    engine = build_engine(FSDPEngine, engine_config(tiny_model_dir, fsdp=FSDPConfig()))
    assert engine.config.fsdp.param_dtype == expected
    layer = next(m for m in engine.model.modules() if hasattr(m, "_get_fsdp_state"))
    assert layer._get_fsdp_state()._mp_policy.param_dtype == getattr(torch, expected)


def test_sdpa_without_cudnn_turns_the_cudnn_kernel_off_only_inside():
    """The server's and the trainer's attention never pick cuDNN SDPA (a graph build per new
    shape); the flags are process-wide, so the context must restore them."""
    assert torch.backends.cuda.cudnn_sdp_enabled()
    with hardware.sdpa_without_cudnn():
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled()
        assert torch.backends.cuda.mem_efficient_sdp_enabled()
        assert torch.backends.cuda.math_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled()
