"""Two trainer ranks on one GPU are refused at start with an error naming the problem
(NCCL would refuse the duplicate device later, or FSDP would run out of memory)."""

from __future__ import annotations

import os
import subprocess
import sys

from arealite.utils.network import find_free_port

SCRIPT = "from arealite.utils.distributed import init_distributed\ninit_distributed()\n"


def test_two_ranks_on_one_gpu_fail_clearly(tmp_path):
    script = tmp_path / "two_ranks.py"
    script.write_text(SCRIPT)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(find_free_port()),
        str(script),
    ]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0"}
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode != 0
    assert "each rank needs its own GPU" in p.stdout + p.stderr
