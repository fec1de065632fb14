"""What every benchmark shares: one JSON line per figure, and runs through the local launcher.

Benchmarks run as scripts (`python bench/X.py`), so this directory is on sys.path and they
import it as `bench_io`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(REPO, "examples")


def emit(figure: str, **values) -> None:
    print(json.dumps({"figure": figure, **values}), flush=True)


def launch(script: str, config: str, overrides: list[str], log_path: str) -> float:
    """Run the local launcher (output to `log_path`); returns its wall seconds."""
    cmd = [
        sys.executable, "-m", "arealite.launcher.local", os.path.join(EXAMPLES, script),
        "--config", os.path.join(EXAMPLES, "configs", config), *overrides,
    ]  # fmt: skip
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        rc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        tail = open(log_path, errors="replace").read()[-4000:]
        sys.exit(f"{script} failed with exit code {rc}; launcher log {log_path}:\n{tail}")
    return time.monotonic() - t0
