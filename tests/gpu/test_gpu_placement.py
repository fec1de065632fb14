"""Placement on a real GPU node: the launcher's device count matches CUDA's, and a trainer
rank pinned by the plan sees exactly its own GPU."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from arealite.launcher.local import visible_gpu_count
from arealite.launcher.placement import plan_gpus, visible_devices


def test_the_launcher_counts_the_gpus_cuda_sees():
    if "CUDA_VISIBLE_DEVICES" not in os.environ:
        assert visible_gpu_count() == torch.cuda.device_count()


def test_a_rank_pinned_by_the_plan_sees_only_its_gpu():
    devices = visible_devices(visible_gpu_count(), os.environ.get("CUDA_VISIBLE_DEVICES"))
    plan = plan_gpus(0, 1, 1, devices)
    code = "import torch; print(torch.cuda.device_count(), torch.cuda.get_device_name(0))"
    env = {**os.environ, **plan.trainer_env()}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "1"
