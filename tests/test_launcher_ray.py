"""The Ray launcher on a real local Ray head: torchrun environment, servers through name_resolve,
teardown when a rank or a server fails."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import psutil
import pytest
from test_launcher_slurm import check_grpo_metrics, check_two_ranks, small_grpo_args, wait_for_files

from arealite.utils.network import find_free_port

pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'ray[default]')")

HERE = os.path.dirname(__file__)
RANK_PROBE = os.path.join(HERE, "scripts", "rank_probe.py")
CLUSTER_PROBE = os.path.join(HERE, "scripts", "cluster_probe.py")
ROOT = os.path.dirname(HERE)
ENV = {"RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1"}

pytestmark = pytest.mark.integration


def _processes_matching(pattern: str) -> list[psutil.Process]:
    """Processes whose command line matches `pattern`, and all their descendants."""
    found = {}
    for p in psutil.process_iter(["cmdline"]):
        if re.search(pattern, " ".join(p.info["cmdline"] or [])):
            found[p.pid] = p
            try:
                found.update({c.pid: c for c in p.children(recursive=True)})
            except psutil.NoSuchProcess:
                pass
    return list(found.values())


@pytest.fixture(scope="module")
def ray_address():
    """A Ray head of our own (2 CPUs), stopped by pid: only the processes of this cluster."""
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # Ray's socket paths must stay short
    port = find_free_port()
    cmd = [
        ray_cli,
        "start",
        "--head",
        "--node-ip-address",
        "127.0.0.1",
        "--num-cpus",
        "2",
        "--port",
        str(port),
        "--temp-dir",
        temp_dir,
        "--include-dashboard=false",
        "--disable-usage-stats",
    ]
    p = subprocess.run(cmd, env={**os.environ, **ENV}, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, f"ray start failed:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}"
    yield f"127.0.0.1:{port}"
    # Our cluster's processes name its temp dir, or (the client server) its GCS port.
    procs = _processes_matching(rf"{re.escape(temp_dir)}|--address=\S+:{port}\b")
    for proc in procs:
        try:
            proc.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=5)
    for proc in alive:
        proc.kill()
    shutil.rmtree(temp_dir, ignore_errors=True)


def launch(args, wait=True, timeout=300):
    cmd = [sys.executable, "-m", "arealite.launcher.ray", *args]
    kw = dict(env={**os.environ, **ENV}, cwd=ROOT, text=True)
    if not wait:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)
    return subprocess.run(cmd, capture_output=True, timeout=timeout, **kw)


def base_args(script, tmp_path, ray_address, trial="t"):
    return [
        script,
        "experiment_name=ray",
        f"trial_name={trial}",
        f"cluster.fileroot={tmp_path}",
        "train_dataset.path=arith",
        f"launcher.ray_address={ray_address}",
    ]


def assert_dead(pids, timeout=30):
    deadline = time.monotonic() + timeout
    alive = [p for p in pids if psutil.pid_exists(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [
            p
            for p in alive
            if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
        ]
    assert not alive, f"processes still running after the launcher exited: {alive}"


def test_two_ranks_get_the_torchrun_environment(tmp_path, tiny_model_dir, ray_address):
    args = base_args(RANK_PROBE, tmp_path, ray_address)
    p = launch([*args, f"model.path={tiny_model_dir}", "allocation_mode=d2p1t1"])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    run_dir = tmp_path / "ray" / "t"
    ranks = check_two_ranks(run_dir)
    assert ranks[0]["MASTER_PORT"] == ranks[1]["MASTER_PORT"]
    assert "[rank1] rank 1 ok" in p.stdout  # forwarded to the launcher's stdout
    assert "rank 0 ok" in (run_dir / "logs" / "rank0.log").read_text()
    assert (run_dir / "config.yaml").exists()


def test_failing_rank_is_named_and_the_others_are_stopped(tmp_path, tiny_model_dir, ray_address):
    args = base_args(CLUSTER_PROBE, tmp_path, ray_address)
    env_vars = "launcher.env_vars=[PROBE_FAIL_RANK=1,PROBE_FAIL_DELAY=2,PROBE_HANG=1]"
    p = launch([*args, f"model.path={tiny_model_dir}", "allocation_mode=d2p1t1", env_vars])
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    assert "rank 1 exited with code 3" in p.stderr
    rank0 = json.loads((tmp_path / "ray" / "t" / "probe" / "rank0.json").read_text())
    assert_dead([rank0["pid"]])  # it was sleeping: the launcher stopped it


def start_two_hanging_ranks(tmp_path, tiny_model_dir, ray_address):
    """The probe on two ranks that sleep once up: the launcher process and each rank's record."""
    args = base_args(CLUSTER_PROBE, tmp_path, ray_address)
    extra = [
        f"model.path={tiny_model_dir}",
        "allocation_mode=d2p1t1",
        "launcher.env_vars=[PROBE_HANG=1]",
    ]
    proc = launch([*args, *extra], wait=False)
    return proc, wait_for_files(str(tmp_path / "ray" / "t" / "probe" / "rank*.json"), 2, proc)


def test_killed_rank_stops_everything(tmp_path, tiny_model_dir, ray_address):
    proc, ranks = start_two_hanging_ranks(tmp_path, tiny_model_dir, ray_address)
    os.kill(ranks[1]["pid"], signal.SIGKILL)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, out[-3000:] + err[-3000:]
    assert "rank 1 exited with code -9" in err
    assert_dead([ranks[0]["pid"]])


def test_servers_serve_the_ranks_and_a_killed_server_stops_the_run(
    tmp_path, tiny_model_dir, ray_address
):
    args = base_args(CLUSTER_PROBE, tmp_path, ray_address)
    proc = launch(
        [
            *args,
            f"actor.path={tiny_model_dir}",
            "allocation_mode=local.d2p1t1+d2p1t1",
            "launcher.env_vars=[PROBE_HANG=1]",
        ],
        wait=False,
    )
    run_dir = str(tmp_path / "ray" / "t")
    ranks = wait_for_files(os.path.join(run_dir, "probe", "rank*.json"), 2, proc)
    for r in ranks:  # every rank reached both servers, whose addresses came from name_resolve
        assert len(r["tokens"]) == 2 and set(r["tokens"].values()) == {3}, r
    entries = sorted((tmp_path / "name_resolve" / "ray" / "t" / "servers").rglob("ENTRY"))
    assert [json.loads(e.read_text())["value"] for e in entries] == list(ranks[0]["tokens"])
    servers = [
        p
        for p in _processes_matching(re.escape(run_dir))
        if "arealite.server" in " ".join(p.cmdline())
    ]
    assert len(servers) == 2
    victim = servers[0]
    port = victim.cmdline()[victim.cmdline().index("--port") + 1]
    index = [a.split(":")[1] for a in ranks[0]["tokens"]].index(port)  # addresses in index order
    victim.kill()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, out[-3000:] + err[-3000:]
    assert f"inference server{index} exited with code -9 during training" in err
    assert_dead([r["pid"] for r in ranks])


def test_allocation_larger_than_the_ray_cluster_fails_before_starting(
    tmp_path, tiny_model_dir, ray_address
):
    args = base_args(RANK_PROBE, tmp_path, ray_address)
    gpus = ["cluster.n_gpus_per_node=2", "allocation_mode=d2p1t1"]
    p = launch([*args, f"model.path={tiny_model_dir}", *gpus])
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    assert "needs 2 GPU on the Ray cluster, which has 0" in p.stderr
    assert not (tmp_path / "ray" / "t" / "logs" / "rank0.log").exists()


def test_arith_grpo_two_steps(tmp_path, tiny_model_dir, ray_address):
    args = [
        *small_grpo_args("ray", tmp_path, tiny_model_dir),
        f"launcher.ray_address={ray_address}",
    ]
    p = launch(args, timeout=600)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    check_grpo_metrics(tmp_path / "ray" / "grpo" / "metrics.jsonl")


def test_server_that_cannot_start_is_named(tmp_path, tiny_model_dir, ray_address):
    args = base_args(CLUSTER_PROBE, tmp_path, ray_address)
    bad = ["allocation_mode=local.d1p1t1+d1p1t1", "server.extra_args=[--no-such-flag]"]
    p = launch([*args, f"actor.path={tiny_model_dir}", *bad])
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    assert "inference server0 at" in p.stderr and "exited" in p.stderr
    assert "--no-such-flag" in p.stderr  # the server's own error, from its log tail
    assert not (tmp_path / "ray" / "t" / "logs" / "rank0.log").exists()


def test_ctrl_c_stops_every_process(tmp_path, tiny_model_dir, ray_address):
    proc, ranks = start_two_hanging_ranks(tmp_path, tiny_model_dir, ray_address)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, out[-3000:] + err[-3000:]
    assert_dead([r["pid"] for r in ranks])
