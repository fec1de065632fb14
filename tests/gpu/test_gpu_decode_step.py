"""The embedded server's decoding step on CUDA, GRPO groups of long_sums prompts (8 rows each)
decoded for the first time: a step costs the model's kernels, not a per-shape set-up. With
torch's default SDPA choice on an H200 a step cost 50-68 ms for a 4-layer and a 24-layer model
alike (cuDNN built a graph for every new KV length; docs/results.md, GPU: the long regime)."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from server_decode_profile import decode_all, requests  # noqa: E402

from arealite.server.model_runner import ModelRunner  # noqa: E402


def test_padded_group_decode_step_is_milliseconds(tiny_model_dir):
    runner = ModelRunner(str(tiny_model_dir), device="cuda")
    decode_all(runner, requests(runner, 8, 8, 8))  # warm-up: kernels, allocator
    steps = decode_all(runner, requests(runner, 64, 64, 8))
    assert runner.batch is None
    median_ms = 1e3 * statistics.median(s for _, s in steps[1:])
    assert median_ms < 20, f"a decoding step of a 4-layer model took {median_ms:.1f} ms"
