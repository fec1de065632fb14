"""The local launcher: fast config failures, torchrun ranks, teardown on failure."""

import json
import os
import subprocess
import sys
import time

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "rank_probe.py")


def launch(args, env=None, timeout=120):
    t0 = time.monotonic()
    p = subprocess.run(
        [sys.executable, "-m", "arealite.launcher.local", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    return p, time.monotonic() - t0


@pytest.fixture
def sft_args(tmp_path, tiny_model_dir):
    return [
        SCRIPT,
        "experiment_name=probe",
        "trial_name=t",
        f"cluster.fileroot={tmp_path}",
        f"model.path={tiny_model_dir}",
        "train_dataset.path=arith",
        "allocation_mode=d2p1t1",
    ]


@pytest.mark.parametrize(
    "override,needle",
    [
        ("model.lrr=1", "did you mean 'model.optimizer.lr'"),
        ("allocation_mode=d2p2t1", "no pipeline parallelism"),
        ("train_dataset.path=/no/such/data.jsonl", "train_dataset.path='/no/such/data.jsonl'"),
        ("model.path=/no/such/model", "model.path='/no/such/model'"),
    ],
)
def test_bad_config_fails_fast_before_starting(sft_args, tmp_path, override, needle):
    p, _ = launch([*sft_args, override])
    assert p.returncode == 2, p.stderr
    assert needle in p.stderr
    # Fast means before anything starts (no wall-clock bound: CI machines are loaded).
    assert not (tmp_path / "probe" / "t" / "logs").exists()


def test_missing_script_named(tmp_path):
    p, _ = launch(["/no/script.py", "experiment_name=a", "trial_name=b"])
    assert p.returncode == 2 and "/no/script.py" in p.stderr


@pytest.mark.integration
def test_two_torchrun_ranks_and_logs(sft_args, tmp_path):
    p, _ = launch(sft_args)
    assert p.returncode == 0, p.stdout + p.stderr
    run_dir = tmp_path / "probe" / "t"
    ranks = [json.loads((run_dir / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["WORLD_SIZE"] for r in ranks] == ["2", "2"]
    assert "rank 1 ok" in (run_dir / "logs" / "trainer.log").read_text()
    assert (run_dir / "config.yaml").exists()


@pytest.mark.integration
def test_failing_rank_fails_the_run(sft_args):
    p, _ = launch(sft_args, env={"PROBE_FAIL_RANK": "1"})
    assert p.returncode == 1
    assert "trainer failed" in p.stderr and "rank 1 exited with code 3" in p.stderr


@pytest.mark.integration
def test_one_rank_starts_without_torchrun_unless_asked(sft_args, tmp_path):
    """A lone rank gets torchrun's environment without its agent (one Python start-up fewer);
    its own exit code names it. `launcher.single_rank_agent=true` puts the agent back."""
    one_rank = [*sft_args, "allocation_mode=d1p1t1"]
    probe = tmp_path / "probe" / "t" / "rank0.json"
    p, _ = launch(one_rank, env={"PROBE_FAIL_RANK": "0"})
    assert p.returncode == 1 and "rank 0 exited with code 3" in p.stderr, p.stderr
    rank = json.loads(probe.read_text())
    assert (rank["RANK"], rank["WORLD_SIZE"], rank["LOCAL_RANK"]) == ("0", "1", "0")
    assert rank["MASTER_PORT"] and not rank["under_agent"]
    p, _ = launch([*one_rank, "launcher.single_rank_agent=true"])
    assert p.returncode == 0, p.stderr
    assert json.loads(probe.read_text())["under_agent"]


# ---- children die with their parent ---------------------------------------------------------------

PARENT = """
import os, subprocess, sys, time
from arealite.lifecycle.lifeline import die_with_parent
child = [sys.executable, "-c", sys.argv[1]]
kw = {"preexec_fn": die_with_parent} if sys.argv[2] == "pdeathsig" else {}
# stderr: a pipe that dies with us, as the launcher's pipe to torchrun does (a write raises)
p = subprocess.Popen(child, stdout=sys.stdout, stderr=subprocess.PIPE, **kw)
time.sleep(600)
"""
WATCHER = """
import subprocess, sys, time
from arealite.lifecycle.lifeline import watch_parent
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
watch_parent(interval=0.2)
print(grandchild.pid, flush=True)
time.sleep(600)
"""
SLEEPER = "import os, time; print(os.getpid(), flush=True); time.sleep(600)"


def gone_within(pids, seconds: float) -> bool:
    import psutil

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        alive = [
            p
            for p in pids
            if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
        ]
        if not alive:
            return True
        time.sleep(0.1)
    return False


def start_parent(child_code: str, how: str, env=None):
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, child_code, how],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    return parent, int(parent.stdout.readline())


@pytest.mark.parametrize("how,child_code", [("pdeathsig", SLEEPER), ("plain", WATCHER)])
def test_children_die_within_seconds_of_a_kill_9_of_their_parent(how, child_code):
    """pdeathsig: how launchers start servers and torchrun agents; watch_parent: how trainer
    workers (started by torchrun, not by us) notice, taking their own children along."""
    import psutil

    parent, pid = start_parent(child_code, how)
    watched = [pid, *(c.pid for c in psutil.Process(parent.pid).children(recursive=True))]
    parent.kill()
    parent.wait()
    assert gone_within(watched, 5), [
        psutil.Process(p).cmdline() for p in watched if psutil.pid_exists(p)
    ]


def test_a_stale_launcher_heartbeat_ends_the_job(tmp_path):
    """Jobs on other nodes (Slurm) cannot see the launcher's pid: its heartbeat file stops."""
    import psutil

    beat = tmp_path / "launcher.heartbeat"
    beat.write_text("")
    env = {"AREAL_LAUNCHER_HEARTBEAT": str(beat), "AREAL_LAUNCHER_HEARTBEAT_TTL": "1"}
    parent, grandchild = start_parent(WATCHER, "plain", env)
    try:
        watcher = psutil.Process(parent.pid).children()[0].pid
        assert gone_within([watcher, grandchild], 5)
        assert parent.poll() is None  # the parent lives: only the heartbeat stopped
    finally:
        parent.kill()
        parent.wait()


@pytest.mark.integration
def test_a_server_that_cannot_start_is_named_and_the_trainer_stopped(tmp_path, tiny_model_dir):
    """The trainer starts while the servers load; a server that dies first fails the run with
    its own error, and the trainer (waiting for it) goes down with the run."""
    grpo = os.path.join(os.path.dirname(SCRIPT), "..", "..", "examples", "grpo.py")
    config = os.path.join(os.path.dirname(grpo), "configs", "arith_grpo.yaml")
    p, _ = launch(
        [
            grpo,
            "--config",
            config,
            "experiment_name=bad",
            "trial_name=t",
            f"cluster.fileroot={tmp_path}",
            f"actor.path={tiny_model_dir}",
            "server.extra_args=[--no-such-flag]",
        ],
        timeout=300,
    )
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    assert "inference server 0 at" in p.stderr and "exited" in p.stderr
    assert "--no-such-flag" in p.stderr  # the server's own error, from its log tail
    assert (tmp_path / "bad" / "t" / "logs" / "trainer.log").exists()  # started beside it


def test_the_launcher_imports_no_torch():
    """Every run pays the launcher's start-up once more: config checks need no torch (1.3 s)."""
    code = "import sys, arealite.launcher.local; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr
