"""Recovery: kill a run at any moment (SIGKILL), rerun the same command, and it ends exactly
where an uninterrupted run ends: same final weights, same metrics for every step.

The runs go through the real local launcher (torchrun ranks, embedded inference servers) on the
tiny model; the kill lands wherever the run happens to be once step k is logged (mid-step,
mid-checkpoint or between steps), so the tests cover whatever moment that is.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMING_KEYS = ("wall_time", "time")  # prefixes of keys that legitimately differ between runs


# ----------------------------------------------------------------------------- helpers


def launcher_cmd(script: str, config: str, fileroot, trial: str, overrides: list[str]):
    return [
        sys.executable, "-m", "arealite.launcher.local", os.path.join(ROOT, "examples", script),
        "--config", os.path.join(ROOT, "examples", "configs", config),
        "experiment_name=recover", f"trial_name={trial}", f"cluster.fileroot={fileroot}",
        *overrides,
    ]  # fmt: skip


def start(cmd, log_path) -> subprocess.Popen:
    log = open(log_path, "ab")  # noqa: SIM115 - the child owns it; closed with the test
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


def finish(proc: subprocess.Popen, log_path, timeout: float = 300) -> None:
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        raise
    assert rc == 0, open(log_path, errors="replace").read()[-6000:]


def kill_tree(pid: int) -> None:
    """SIGKILL a process and everything below it: the machine 'dies' (the launcher puts its
    children in sessions of their own, so killing its group would not reach them)."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs[1:], timeout=10)  # the root is the caller's Popen: it reaps it


def trainer_workers(launcher_pid: int, script: str) -> list[psutil.Process]:
    """The torchrun worker processes (not torchrun itself) of a launcher."""
    out = []
    for p in psutil.Process(launcher_pid).children(recursive=True):
        try:
            cmd = p.cmdline()
        except psutil.NoSuchProcess:
            continue
        if any(a.endswith(script) for a in cmd) and "torch.distributed.run" not in cmd:
            out.append(p)
    return out


def metrics(run_dir) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    records = []
    for line in open(path):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # torn by the kill
    return records


def wait_for_step(proc, run_dir, k: int, log_path, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while len(metrics(run_dir)) < k:
        if proc.poll() is not None:
            raise AssertionError(
                f"run ended (rc {proc.returncode}) before step {k}:\n"
                + open(log_path, errors="replace").read()[-4000:]
            )
        if time.monotonic() > deadline:
            kill_tree(proc.pid)
            raise AssertionError(f"step {k} not reached in {timeout}s")
        time.sleep(0.05)


def comparable(records: list[dict]) -> list[dict]:
    """Per-step values that must not depend on the kill (timings and wall time do)."""
    return [
        {k: v for k, v in r.items() if not k.startswith(TIMING_KEYS)}
        for r in sorted(records, key=lambda r: r["step"])
    ]


def final_weights(run_dir, steps: int) -> dict[str, torch.Tensor]:
    path = os.path.join(run_dir, "checkpoints", "final", f"epoch0globalstep{steps}")
    return load_file(os.path.join(path, "model.safetensors"))


def assert_same_run(ref_dir, run_dir, steps: int, atol: float = 1e-6) -> None:
    a, b = comparable(metrics(ref_dir)), comparable(metrics(run_dir))
    assert [r["step"] for r in b] == list(range(steps)), "each step logged exactly once"
    assert a == b
    wa, wb = final_weights(ref_dir, steps), final_weights(run_dir, steps)
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], atol=atol, rtol=0, msg=k)


# ----------------------------------------------------------------------------- SFT


SFT_STEPS = 12


def sft_cmd(tmp_path, model_dir, trial):
    return launcher_cmd(
        "arith_sft.py", "arith_sft.yaml", tmp_path, trial,
        [f"model.path={model_dir}", f"total_train_steps={SFT_STEPS}", "train_dataset.size=512",
         "train_dataset.batch_size=16", "recover.mode=auto", "recover.freq_steps=1",
         "recover.retries=2", "stats_logger.print_every=1"],
    )  # fmt: skip


@pytest.mark.integration
def test_sft_killed_twice_resumes_to_the_same_weights_and_metrics(tmp_path, tiny_model_dir):
    """A trainer rank SIGKILLed after step 3 is restarted by the launcher (same process
    tree); then the whole run is SIGKILLed after step 7 and the same command is rerun."""
    ref_dir, run_dir = tmp_path / "recover" / "ref", tmp_path / "recover" / "killed"
    log = tmp_path / "ref.log"
    finish(start(sft_cmd(tmp_path, tiny_model_dir, "ref"), log), log)

    log = tmp_path / "killed.log"
    cmd = sft_cmd(tmp_path, tiny_model_dir, "killed")
    proc = start(cmd, log)
    wait_for_step(proc, run_dir, 3, log)
    for w in trainer_workers(proc.pid, "arith_sft.py"):
        w.send_signal(signal.SIGKILL)
    wait_for_step(proc, run_dir, 8, log)  # the launcher's retry resumed and went on
    kill_tree(proc.pid)
    assert proc.wait() == -signal.SIGKILL
    finish(start(cmd, log), log)

    text = open(log).read()
    assert "trainer exited with code" in text and "attempt 1/3" in text
    assert text.count("resumed from") == 2
    assert_same_run(ref_dir, run_dir, SFT_STEPS)
    ckpt = run_dir / "recover" / "checkpoint"
    assert json.loads((ckpt / "rank0.json").read_text())["next_step"] == SFT_STEPS
    files = [f for _, _, fs in os.walk(ckpt) for f in fs]
    assert not [f for f in files if f.endswith((".pt", ".pkl", ".bin"))], files
