"""Helpers of the GPU tests."""

from __future__ import annotations

import pytest
import torch


def need_gpus(n: int) -> None:
    """Skip unless this machine shows at least `n` GPUs (naming how many it has)."""
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < n:
        pytest.skip(f"needs {n} GPUs, this machine shows {have}")
