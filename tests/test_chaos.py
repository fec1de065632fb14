"""Chaos: `kill -9` one process of a run (launcher, torchrun agent - asked for with
`launcher.single_rank_agent`, since a lone rank runs without one -, trainer worker or inference
server) at a random moment, rerun the same command where needed, and the run ends as if nothing
had happened: no process of the killed run is left behind, every step is logged exactly once,
every data item is trained on exactly once, and (synchronous RL) the final weights equal those
of an uninterrupted run.

Real processes throughout: the local launcher, torchrun, the embedded server, the tiny offline
model warm-started by a short SFT (so that GRPO has a learning signal), the arith entry point.
`CHAOS_TRIALS=N` runs N trials (default 4: each process type once; more add random ones);
`CHAOS_SEED` picks the moments.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time

import psutil
import pytest
import torch
from _launch import launcher_command, read_metrics
from safetensors.torch import load_file

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KINDS = ("launcher", "agent", "worker", "server")
N_TRIALS = int(os.environ.get("CHAOS_TRIALS", "4"))
SEED = int(os.environ.get("CHAOS_SEED", "16"))
STEPS, SFT_STEPS = 4, 16
ORPHAN_DEADLINE_S = 10.0


def trial_plan() -> list[tuple[str, float]]:
    """(process kind, seconds after step 1 is logged) per trial: every kind first."""
    rng = random.Random(SEED)
    kinds = [KINDS[i] if i < len(KINDS) else rng.choice(KINDS) for i in range(N_TRIALS)]
    return [(k, round(rng.uniform(0.0, 2.0), 2)) for k in kinds]


# ----------------------------------------------------------------------------- the runs


def launcher_cmd(fileroot, trial: str, script: str, overrides: list[str]) -> list[str]:
    """`script` is sft.py or grpo.py, run on the arithmetic YAML of the same kind."""
    name = "arith_" + script.removesuffix(".py")
    return launcher_command(
        script,
        f"{name}.yaml",
        "experiment_name=chaos",
        f"trial_name={trial}",
        f"cluster.fileroot={fileroot}",
        "train_dataset.options.n_operands=2",
        "valid_dataset=null",
        *overrides,
    )


def grpo_cmd(fileroot, trial: str, model: str) -> list[str]:
    """Synchronous GRPO (eta = 0, seeded sampling): a rerun regenerates the same tokens."""
    return launcher_cmd(
        fileroot,
        trial,
        "grpo.py",
        [
            f"actor.path={model}",
            f"total_train_steps={STEPS}",
            "train_dataset.options.size=256",
            "train_dataset.batch_size=4",
            "gconfig.n_samples=4",
            "rollout.max_concurrent_rollouts=8",
            "gconfig.seed=7",
            "server.dtype=float32",
            "actor.fsdp.param_dtype=float32",
            "recover.mode=auto",
            "recover.freq_steps=1",
            "recover.retries=2",
            "rollout.max_head_offpolicyness=0",
            "actor.recompute_logprob=true",
            "actor.use_decoupled_loss=false",
            "rollout.setup_timeout=120",
            "rollout.dynamic_sampling=false",  # every item trained exactly once (none dropped)
        ],
    )


def run_to_end(cmd, log_path, timeout: float = 300) -> None:
    with open(log_path, "ab") as log:
        p = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
    assert p.returncode == 0, open(log_path, errors="replace").read()[-6000:]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model_dir) -> tuple[str, str]:
    """(warm-started model, run dir of an uninterrupted GRPO run)."""
    root = tmp_path_factory.mktemp("chaos")
    sft = launcher_cmd(
        root,
        "sft",
        "sft.py",
        [
            f"model.path={tiny_model_dir}",
            f"total_train_steps={SFT_STEPS}",
            "train_dataset.options.size=1024",
            "train_dataset.batch_size=32",
        ],
    )
    run_to_end(sft, root / "sft.log")
    model = str(root / "chaos" / "sft" / "checkpoints" / "final" / f"epoch0globalstep{SFT_STEPS}")
    run_to_end(grpo_cmd(root, "ref", model), root / "ref.log")
    ref_dir = str(root / "chaos" / "ref")
    assert any(abs(r["loss"]) > 1e-4 for r in read_metrics(ref_dir, after_kill=True)), (
        "no learning signal"
    )
    return model, ref_dir


# ----------------------------------------------------------------------------- processes


def run_processes(launcher_pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(launcher_pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def pick_victim(kind: str, launcher_pid: int) -> psutil.Process:
    if kind == "launcher":
        return psutil.Process(launcher_pid)
    for p in run_processes(launcher_pid)[1:]:
        try:
            cmd = p.cmdline()
        except psutil.NoSuchProcess:
            continue
        is_agent = "torch.distributed.run" in cmd
        if kind == "agent" and is_agent:
            return p
        if kind == "server" and "arealite.server" in cmd:
            return p
        if kind == "worker" and not is_agent and any(a.endswith("/grpo.py") for a in cmd):
            return p
    raise AssertionError(f"no {kind} process under launcher {launcher_pid}")


def left_alive(procs: list[psutil.Process], deadline_s: float) -> list[str]:
    """Processes of `procs` still running after `deadline_s` (zombies count as gone)."""
    deadline = time.monotonic() + deadline_s
    while True:
        alive = []
        for p in procs:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(f"{p.pid} {' '.join(p.cmdline())[:160]}")
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


# ----------------------------------------------------------------------------- results


def wait_for_step(proc: subprocess.Popen, run_dir, k: int, log_path, timeout=240) -> None:
    deadline = time.monotonic() + timeout
    while len(read_metrics(run_dir, after_kill=True)) < k:
        assert proc.poll() is None, open(log_path, errors="replace").read()[-4000:]
        assert time.monotonic() < deadline, f"step {k} not reached in {timeout}s"
        time.sleep(0.05)


def trained_items(run_dir) -> dict[int, list[str]]:
    """step -> query ids; a step redone after a resume counts once (the last time)."""
    out = {}
    for line in open(os.path.join(run_dir, "rollouts", "trained_rank0.jsonl")):
        rec = json.loads(line)
        out[rec["step"]] = rec["query_ids"]
    return out


def final_weights(run_dir) -> dict[str, torch.Tensor]:
    path = os.path.join(run_dir, "checkpoints", "final", f"epoch0globalstep{STEPS}")
    return load_file(os.path.join(path, "model.safetensors"))


def assert_like_uninterrupted(run_dir: str, ref_dir: str) -> None:
    steps = sorted(r["step"] for r in read_metrics(run_dir, after_kill=True))
    assert steps == list(range(STEPS)), f"steps logged: {steps} (each exactly once)"
    items, ref_items = trained_items(run_dir), trained_items(ref_dir)
    flat = [q for s in sorted(items) for q in items[s]]
    assert len(flat) == len(set(flat)), "an item was trained twice"
    assert set(flat) == {q for s in ref_items.values() for q in s}, "an item is missing"
    assert items == ref_items
    got, want = final_weights(run_dir), final_weights(ref_dir)
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-6, rtol=0, msg=k)


# ----------------------------------------------------------------------------- the trials


@pytest.mark.parametrize("trial", range(N_TRIALS))
def test_kill_9_anywhere_then_rerun_ends_like_an_uninterrupted_run(trial, reference, tmp_path):
    kind, delay = trial_plan()[trial]
    model, ref_dir = reference
    name = f"trial{trial}_{kind}"
    run_dir, log = str(tmp_path / "chaos" / name), tmp_path / f"{name}.log"
    cmd = grpo_cmd(tmp_path, name, model)
    if kind == "agent":  # a lone rank runs without torchrun's agent unless asked for one
        cmd.append("launcher.single_rank_agent=true")
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    before: list[psutil.Process] = []
    try:
        wait_for_step(proc, run_dir, 1, log)
        time.sleep(delay)
        assert proc.poll() is None, f"the run ended before the kill ({kind}, +{delay}s)"
        victim, before = pick_victim(kind, proc.pid), run_processes(proc.pid)
        children = [p for p in before if p.ppid() == victim.pid]
        victim.send_signal(signal.SIGKILL)
        if kind == "launcher":
            proc.wait()
            orphans = left_alive(before, ORPHAN_DEADLINE_S)
            assert not orphans, f"{ORPHAN_DEADLINE_S}s after kill -9 of the launcher: {orphans}"
            run_to_end(cmd, log)  # the same command again
        else:
            if kind == "agent":  # its workers must not outlive it (nor train beside the retry)
                orphans = left_alive(children, ORPHAN_DEADLINE_S)
                assert not orphans, f"{ORPHAN_DEADLINE_S}s after kill -9 of torchrun: {orphans}"
            assert proc.wait(timeout=300) == 0, open(log, errors="replace").read()[-6000:]
    finally:
        for p in run_processes(proc.pid) + before:  # whatever a failed trial left
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
    text = open(log, errors="replace").read()
    if kind == "server":
        assert "resumed from" not in text, "a server death must not end the trainer"
    else:
        assert "resumed from" in text
    assert_like_uninterrupted(run_dir, ref_dir)


# ----------------------------------------------------------------------------- every server down


def test_with_every_server_dead_the_client_waits_and_the_restarted_one_gets_the_weights(
    tiny_model_dir, tiny_model_dir_v2, tmp_path
):
    """The only server dies mid-generation and stays down through a weight update: the update
    does not fail the trainer, the cut-off generation waits and is resubmitted once the server is
    back, and the restarted server loads the current weights before it serves."""
    import asyncio
    import shutil
    import threading
    import urllib.request

    from arealite.api.cli_args import RolloutConfig
    from arealite.api.io_struct import GenerationHyperparameters, ModelRequest, WeightUpdateMeta
    from arealite.inference.sglang_remote import RemoteSGLangEngine
    from arealite.server.process import launch_server

    weights = str(tmp_path / "weight_sync")
    shutil.copytree(tiny_model_dir_v2, weights)
    roots = ["--allowed-weight-roots", str(tmp_path), "--allowed-weight-roots", tiny_model_dir]
    server = launch_server(tiny_model_dir, dtype="float32", extra_args=roots)
    engine = RemoteSGLangEngine(RolloutConfig(setup_timeout=120, request_retries=1))
    engine.initialize([server.address])
    g = GenerationHyperparameters(max_new_tokens=1000, greedy=True, ignore_eos=True)
    out: list = []
    gen = threading.Thread(
        target=lambda: out.append(
            asyncio.run(engine.agenerate(ModelRequest(rid="long", input_ids=[5, 6, 7], gconfig=g)))
        )
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        gen.start()
        deadline = time.monotonic() + 60
        while (
            "arealite_running_requests 1"
            not in opener.open(f"{server.url}/metrics").read().decode()
        ):
            assert time.monotonic() < deadline, "the request never ran"
            time.sleep(0.01)
        server.proc.kill()  # mid-generation
        server.proc.wait()
        engine.update_weights(WeightUpdateMeta.from_disk(weights, version=3)).result(timeout=120)
        assert engine.weight_version == 3 and server.address in engine.pool.failed
        time.sleep(1.0)
        assert gen.is_alive(), "the cut-off generation must wait for a server, not fail"
        server = launch_server(tiny_model_dir, port=server.port, dtype="float32", extra_args=roots)
        gen.join(timeout=180)
        assert out, "the generation did not finish"
        resp = out[0]
        assert resp.output_len == 1000  # resubmitted as prompt + tokens so far: nothing lost
        # The dead server's partial answer never arrived: every token comes from the restarted
        # server, with the current weights.
        assert set(resp.output_versions) == {3}
        with opener.open(f"{server.url}/get_weight_version") as r:
            assert json.loads(r.read())["weight_version"] == 3
    finally:
        engine.destroy()
        server.stop()
