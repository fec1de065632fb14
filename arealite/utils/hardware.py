"""What this machine computes fast: `dtype: auto` and the CPU facts the benches report.

bf16 is worth it only where the hardware multiplies it natively: CUDA capability >= 8.0, or a CPU
with AVX512-BF16 / AMX. Elsewhere (AVX2-only CPUs, Volta/Turing GPUs) torch emulates bf16 matmuls
on CPU ~50x slower than fp32, so `auto` picks fp32 there. fp16 is never chosen silently: its
range needs loss scaling, which the user asks for explicitly.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("arealite.hardware")

AUTO = "auto"
_CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags of /proc/cpuinfo (empty where there is none, e.g. macOS)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_model() -> str:
    """The CPU's marketing name, for benchmark reports."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_summary() -> dict:
    """Model, torch's SIMD level and native bf16, as every bench prints them."""
    import torch

    return {
        "cpu": cpu_model(),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "native_bf16": native_bf16("cpu")[0],
    }


def native_bf16(device_type: str, cuda_capability: tuple[int, int] | None = None) -> tuple:
    """(does this device multiply bf16 natively, why) for `device_type` 'cpu' or 'cuda'."""
    if device_type == "cuda":
        if cuda_capability is None:
            import torch

            cuda_capability = torch.cuda.get_device_capability()
        ok = tuple(cuda_capability) >= (8, 0)
        return (
            ok,
            f"CUDA capability {cuda_capability[0]}.{cuda_capability[1]} ({'>=' if ok else '<'} 8.0)",
        )
    found = [f for f in _CPU_BF16_FLAGS if f in cpu_flags()]
    if not found:
        return (
            False,
            "CPU has no avx512_bf16/amx_bf16 (bf16 would be emulated, ~50x slower than fp32)",
        )
    capped = _isa_cap()
    if capped:
        return False, f"CPU has {'/'.join(found)} but {capped} (bf16 would be emulated)"
    return True, f"CPU has {'/'.join(found)}"


def _isa_cap() -> str:
    """Why torch may not use the CPU's bf16 instructions although it has them: kernels capped
    below AVX512 (ATEN_CPU_CAPABILITY) or oneDNN's matmuls capped (ONEDNN_MAX_CPU_ISA). Both
    caps together make a native-bf16 CPU behave as an AVX2-only one (how the suite is checked
    for AVX2 machines on this one); '' when nothing is capped."""
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    if not capability.startswith("AVX512"):
        return f"torch's CPU kernels are capped at {capability} (ATEN_CPU_CAPABILITY)"
    onednn = os.environ.get("ONEDNN_MAX_CPU_ISA", "").lower()
    if onednn and onednn != "all" and "bf16" not in onednn and "amx" not in onednn:
        return f"oneDNN is capped at ONEDNN_MAX_CPU_ISA={onednn.upper()}"
    return ""


_logged: set[tuple[str, str, str]] = set()


def resolve_dtype(name: str, device_type: str, what: str = "compute") -> str:
    """`auto` -> 'bfloat16' where `device_type` computes it natively, else 'float32'; an
    explicit name is returned unchanged. Logged once per (what, device, result) with the reason."""
    if name != AUTO:
        return name
    ok, why = native_bf16(device_type)
    chosen = "bfloat16" if ok else "float32"
    if (what, device_type, chosen) not in _logged:
        _logged.add((what, device_type, chosen))
        logger.info("%s dtype auto -> %s on %s: %s", what, chosen, device_type, why)
    return chosen


def attention_dtype(dtype: torch.dtype, device_type: str) -> torch.dtype:
    """The dtype attention computes in: at least fp32 on CPU, since torch's CPU flash kernel
    runs 1.1-2.6x slower in bf16 than in fp32 (forward + backward, 25-270 tokens, on
    AVX512-BF16 and AVX2 alike) and its math kernel is slower still in fp32 (docs/guide.md,
    "Trainer speed"); the model's own dtype elsewhere."""
    import torch

    if device_type == "cpu" and dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return dtype


def sdpa_without_cudnn():
    """torch SDPA restricted to flash / memory-efficient / math. cuDNN's kernel (torch's first
    choice on Hopper) builds a graph for every new shape: ~50 ms on an H200, paid at every
    decoding step (the KV length grows by one) and at every new length a packed batch brings.
    A context manager; it sets process-wide flags, so hold it only around one call."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(
        [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    )
