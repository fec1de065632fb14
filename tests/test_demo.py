"""`make demo` end to end, shortened: examples/run_arith_demo.sh through the local
launcher (SFT, then GRPO with the embedded server and a reward pool), a few steps each. A normal
run must exit 0 and print no traceback, no "Exception ignored" block and no Python warning
anywhere: a user reads one at the end of a run as "it crashed", and a warning block as trouble."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALARMS = ("Traceback", "Exception ignored", "Warning: ")  # the last: Python warnings

SFT_ARGS = "total_train_steps=3 train_dataset.batch_size=16"
# Few steps, a small held-out set; the demo's settings otherwise (dynamic sampling included).
GRPO_ARGS = (
    "total_train_steps=2 train_dataset.batch_size=4 valid_dataset.options.size=16 "
    "valid_dataset.batch_size=16"
)


def run_demo(root: str, tiny_model: str) -> tuple[subprocess.CompletedProcess, float]:
    """The demo script on the session's tiny model (the script builds one only when absent)."""
    os.makedirs(os.path.join(root, "demo"))
    os.symlink(tiny_model, os.path.join(root, "demo", "tiny_model"))
    env = {
        **os.environ,
        "PY": sys.executable,
        "DEMO_SFT_ARGS": SFT_ARGS,
        "DEMO_GRPO_ARGS": GRPO_ARGS,
    }
    start = time.monotonic()
    p = subprocess.run(
        ["bash", "examples/run_arith_demo.sh", root],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return p, time.monotonic() - start


def alarms_in(name: str, text: str) -> list[str]:
    """`name: line` for each line of `text` that carries a traceback, an ignored exception or a
    Python warning."""
    return [f"{name}: {line}" for line in text.splitlines() if any(a in line for a in ALARMS)]


@pytest.mark.integration
def test_the_demo_exits_cleanly_with_no_traceback_anywhere(tmp_path, tiny_model_dir):
    p, secs = run_demo(str(tmp_path), tiny_model_dir)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-6000:]
    assert "held-out accuracy:" in p.stdout, out[-3000:]
    found = alarms_in("stdout", p.stdout) + alarms_in("stderr", p.stderr)
    logs = glob.glob(os.path.join(str(tmp_path), "demo", "*", "demo", "logs", "*.log"))
    assert logs  # the trainer's and the server's own logs are read too
    for log in logs:
        found += alarms_in(os.path.relpath(log, str(tmp_path)), open(log).read())
    assert not found, "\n".join(found) + "\n" + out[-6000:]
    print(f"demo (shortened) in {secs:.1f}s")
