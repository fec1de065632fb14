"""Recovery: kill a run at any moment (SIGKILL), rerun the same command, and it ends exactly
where an uninterrupted run ends: same final weights, same metrics for every step.

The runs go through the real local launcher (torchrun ranks, embedded inference servers) on the
tiny model; the kill lands wherever the run happens to be once step k is logged (mid-step,
mid-checkpoint or between steps), so the tests cover whatever moment that is.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
import urllib.request

import psutil
import pytest
import torch
from _launch import launcher_command, read_metrics
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Prefixes of keys that legitimately differ between runs: timings, and the servers' batching
# (rows per batched step, busy share, requests aborted), which follows when requests arrive.
TIMING_KEYS = ("wall_time", "time", "rollout/server_", "rollout/interrupted_requests")


# ----------------------------------------------------------------------------- helpers


def launcher_cmd(script: str, config: str, fileroot, trial: str, overrides: list[str]):
    run = ["experiment_name=recover", f"trial_name={trial}", f"cluster.fileroot={fileroot}"]
    return launcher_command(script, config, *run, *overrides)


def start(cmd, log_path, env=None) -> subprocess.Popen:
    log = open(log_path, "ab")  # noqa: SIM115 - the child owns it; closed with the test
    env = {**os.environ, **(env or {})}
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)


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


def wait_for_step(proc, run_dir, k: int, log_path, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while len(read_metrics(run_dir, after_kill=True)) < k:
        if proc.poll() is not None:
            raise AssertionError(
                f"run ended (rc {proc.returncode}) before step {k}:\n"
                + open(log_path, errors="replace").read()[-4000:]
            )
        if time.monotonic() > deadline:
            kill_tree(proc.pid)
            raise AssertionError(f"step {k} not reached in {timeout}s")
        time.sleep(0.05)


def kill_at_step_and_rerun(cmd, run_dir, step: int, log) -> None:
    """The machine dies once `step` steps are logged; the same command then resumes the run
    and finishes it."""
    proc = start(cmd, log)
    wait_for_step(proc, run_dir, step, log)
    kill_tree(proc.pid)
    proc.wait()
    finish(start(cmd, log), log)
    assert "resumed from" in open(log).read()


def comparable(records: list[dict]) -> list[dict]:
    """Per-step values that must not depend on the kill (timings and wall time do)."""
    return [
        {k: v for k, v in r.items() if not k.startswith(TIMING_KEYS)}
        for r in sorted(records, key=lambda r: r["step"])
    ]


def assert_same_metrics(a: list[dict], b: list[dict]) -> None:
    """Equal up to float noise: a server's logprobs vary by ~1e-7 with batch composition."""
    assert len(a) == len(b)
    for ra, rb in zip(a, b):
        assert ra.keys() == rb.keys(), (ra["step"], ra.keys() ^ rb.keys())
        for k in ra:
            x, y = ra[k], rb[k]
            # behave_*: trainer vs server logprob gaps, themselves batch-composition noise
            # (seen: 4.8e-7 vs 1.7e-6 for the same step), so compared at the noise's scale
            abs_tol = 1e-5 if k.startswith("behave_") else 1e-6
            same = x == y or (
                isinstance(x, float)
                and isinstance(y, float)
                and math.isclose(x, y, rel_tol=1e-5, abs_tol=abs_tol)
            )
            assert same, f"step {ra['step']} {k}: {x} != {y}"


def final_weights(run_dir, steps: int) -> dict[str, torch.Tensor]:
    path = os.path.join(run_dir, "checkpoints", "final", f"epoch0globalstep{steps}")
    return load_file(os.path.join(path, "model.safetensors"))


def assert_same_run(ref_dir, run_dir, steps: int, atol: float = 1e-6) -> None:
    a, b = (
        comparable(read_metrics(ref_dir, after_kill=True)),
        comparable(read_metrics(run_dir, after_kill=True)),
    )
    assert [r["step"] for r in b] == list(range(steps)), "each step logged exactly once"
    assert_same_metrics(a, b)
    wa, wb = final_weights(ref_dir, steps), final_weights(run_dir, steps)
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], atol=atol, rtol=0, msg=k)


def trained_items(run_dir, rank: int = 0) -> dict[int, list[str]]:
    """step -> query ids it trained on; a step rerun after a resume counts once (the last)."""
    path = os.path.join(run_dir, "rollouts", f"trained_rank{rank}.jsonl")
    out = {}
    for line in open(path):
        rec = json.loads(line)
        out[rec["step"]] = rec["query_ids"]
    return out


# ----------------------------------------------------------------------------- SFT

SFT_STEPS = 24
ARITH = ["train_dataset.options.n_operands=2"]  # 1-digit sums: a few SFT steps give GRPO a signal


def sft_cmd(fileroot, model_dir, trial):
    return launcher_cmd(
        "sft.py",
        "arith_sft.yaml",
        fileroot,
        trial,
        [
            f"model.path={model_dir}",
            f"total_train_steps={SFT_STEPS}",
            "train_dataset.options.size=1024",
            "train_dataset.batch_size=32",
            *ARITH,
            "recover.mode=auto",
            "recover.freq_steps=1",
            "recover.retries=2",
            "stats_logger.print_every=1",
        ],
    )


@pytest.fixture(scope="module")
def sft_reference(tmp_path_factory, tiny_model_dir):
    """An uninterrupted SFT run (the reference, and the warm start of the GRPO runs)."""
    root = tmp_path_factory.mktemp("recover")
    log = root / "sft_ref.log"
    finish(start(sft_cmd(root, tiny_model_dir, "sft_ref"), log), log)
    return root / "recover" / "sft_ref"


@pytest.mark.integration
def test_sft_killed_twice_resumes_to_the_same_weights_and_metrics(
    tmp_path, tiny_model_dir, sft_reference
):
    """A trainer rank SIGKILLed after step 4 is restarted by the launcher (same process
    tree); then the whole run is SIGKILLed after step 12 and the same command is rerun."""
    run_dir, log = tmp_path / "recover" / "killed", tmp_path / "killed.log"
    cmd = sft_cmd(tmp_path, tiny_model_dir, "killed")
    proc = start(cmd, log)
    wait_for_step(proc, run_dir, 4, log)
    for w in trainer_workers(proc.pid, "/sft.py"):
        w.send_signal(signal.SIGKILL)
    wait_for_step(proc, run_dir, 12, log)  # the launcher's retry resumed and went on
    kill_tree(proc.pid)
    assert proc.wait() == -signal.SIGKILL
    finish(start(cmd, log), log)

    text = open(log).read()
    assert "trainer exited with code" in text and "attempt 1/3" in text
    assert text.count("resumed from") == 2
    assert_same_run(sft_reference, run_dir, SFT_STEPS)
    ckpt = run_dir / "recover" / "checkpoint"
    assert json.loads((ckpt / "rank0.json").read_text())["next_step"] == SFT_STEPS
    files = [f for _, _, fs in os.walk(ckpt) for f in fs]
    assert not [f for f in files if f.endswith((".pt", ".pkl", ".bin"))], files


# ----------------------------------------------------------------------------- GRPO

GRPO_STEPS = 10


def grpo_cmd(fileroot, model_dir, trial, extra=()):
    return launcher_cmd(
        "grpo.py",
        "arith_grpo.yaml",
        fileroot,
        trial,
        [
            f"actor.path={model_dir}",
            f"total_train_steps={GRPO_STEPS}",
            *ARITH,
            "train_dataset.options.size=256",
            "train_dataset.batch_size=4",
            "rollout.max_concurrent_rollouts=8",
            "gconfig.n_samples=4",
            "gconfig.seed=7",
            "server.dtype=float32",
            "actor.fsdp.param_dtype=float32",
            "valid_dataset.options.size=8",
            "valid_dataset.batch_size=8",
            "recover.mode=auto",
            "recover.freq_steps=1",
            "recover.retries=2",
            # every item trained exactly once: the demo's dynamic sampling drops some by design
            "rollout.dynamic_sampling=false",
            *extra,
        ],
    )


def sft_model(sft_reference) -> str:
    return str(sft_reference / "checkpoints" / "final" / f"epoch0globalstep{SFT_STEPS}")


# eta = 0 is on-policy: PPO's old logprobs are the trainer's own (recomputed), so the server's
# logprobs, which vary by ~1e-7 with the server's batch composition, never reach a gradient.
# (With the decoupled loss they do, and any two runs, interrupted or not, agree to ~1e-5.)
SYNC = [
    "rollout.max_head_offpolicyness=0",
    "actor.recompute_logprob=true",
    "actor.use_decoupled_loss=false",
]


@pytest.fixture(scope="module")
def sync_reference(tmp_path_factory, sft_reference):
    """An uninterrupted synchronous GRPO run: what a killed trainer's or server's run must end
    as (shared by both tests: one reference run fewer)."""
    root = tmp_path_factory.mktemp("recover_sync")
    ref_dir, ref_log = root / "recover" / "ref", root / "ref.log"
    finish(start(grpo_cmd(root, sft_model(sft_reference), "ref", SYNC), ref_log), ref_log)
    assert any(abs(r["loss"]) > 1e-4 for r in read_metrics(ref_dir, after_kill=True)), (
        "no learning signal"
    )
    return ref_dir


@pytest.mark.integration
def test_sync_grpo_killed_and_rerun_matches_the_uninterrupted_run(
    tmp_path, sft_reference, sync_reference
):
    """Seeded sampling (per item, sample and version) makes the rollouts of a rerun step the
    same tokens, so a killed-and-rerun synchronous GRPO run ends with the same weights and the
    same per-step metrics (server logprobs up to batch-composition float noise)."""
    model = sft_model(sft_reference)
    ref_dir = sync_reference

    run_dir, log = tmp_path / "recover" / "killed", tmp_path / "killed.log"
    cmd = grpo_cmd(tmp_path, model, "killed", SYNC)
    kill_at_step_and_rerun(cmd, run_dir, 2, log)
    assert_same_run(ref_dir, run_dir, GRPO_STEPS)
    assert trained_items(run_dir) == trained_items(ref_dir)


def pulled_and_pending(run_dir, per_pull: int) -> tuple[list[str], set[str]]:
    """From the final recover state: every item the executor pulled (dataloader order) and the
    ones pulled but not trained on yet (they would be replayed by another resume)."""
    from arealite.tasks import get_custom_dataset
    from arealite.trainer.recover import ResumableSampler

    ds = get_custom_dataset("arith", type="rl", split="train", size=256, max_digits=1, n_operands=2)
    order = [ds[i]["query_id"] for i in ResumableSampler(len(ds), True, seed=1)]
    state = json.loads((run_dir / "recover" / "checkpoint" / "rank0.json").read_text())
    end = state["states"]["dataloader"]["_sampler_iter_state"]["sampler_state"]
    assert end["epoch"] == 0, "the test stays within one epoch"
    rollout = state["states"]["rollout"]
    if rollout["position"] is None:
        return order[: end["offset"]], set()
    first = rollout["position"]["_sampler_iter_state"]["sampler_state"]["offset"]
    pending = {
        order[first + j * per_pull + i]
        for j, done in enumerate(rollout["done"])
        for i in range(per_pull)
        if i not in done
    }
    return order[: end["offset"]], pending


ASYNC_STEPS, ETA = 10, 1


@pytest.mark.integration
def test_async_grpo_resume_trains_every_item_once_within_the_staleness_bound(
    tmp_path, sft_reference
):
    """Asynchronous rollouts run ahead of the trainer; the run is SIGKILLed with episodes
    queued, running and finished-but-unconsumed, then rerun. Every pulled item is trained on
    exactly once or still pending, none is skipped, and staleness stays <= eta after resume."""
    run_dir, log = tmp_path / "recover" / "async", tmp_path / "async.log"
    extra = [
        f"rollout.max_head_offpolicyness={ETA}",
        f"total_train_steps={ASYNC_STEPS}",
        "actor.use_decoupled_loss=true",
    ]
    cmd = grpo_cmd(tmp_path, sft_model(sft_reference), "async", extra)
    kill_at_step_and_rerun(cmd, run_dir, 3, log)
    records = comparable(read_metrics(run_dir, after_kill=True))
    assert [r["step"] for r in records] == list(range(ASYNC_STEPS))
    assert max(r["staleness_max"] for r in records) <= ETA
    assert all(r["n_seqs"] == 4 * 4 for r in records)  # 4 prompts x 4 samples every step
    trained = trained_items(run_dir)
    assert sorted(trained) == list(range(ASYNC_STEPS))
    flat = [q for step in sorted(trained) for q in trained[step]]
    assert len(flat) == len(set(flat)) == ASYNC_STEPS * 4, "an item was trained twice"
    pulled, pending = pulled_and_pending(run_dir, per_pull=4)
    assert not pending & set(flat)
    assert set(flat) | pending == set(pulled), "an item was skipped"


# ----------------------------------------------------------------------------- server faults


def wait_running_requests(url: str, key: str, timeout: float = 60) -> None:
    req = urllib.request.Request(f"{url}/metrics", headers={"Authorization": f"Bearer {key}"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via a proxy
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with opener.open(req, timeout=5) as r:
            text = r.read().decode()
        running = [ln for ln in text.splitlines() if ln.startswith("arealite_running_requests")]
        if running and float(running[0].split()[-1]) > 0:
            return
        time.sleep(0.01)
    raise AssertionError(f"no request running on {url} within {timeout}s")


@pytest.mark.integration
def test_a_server_killed_mid_run_is_restarted_and_nothing_is_lost(
    tmp_path, sft_reference, sync_reference
):
    """2 servers; one is SIGKILLed mid-run. Its requests fail over to the other (resubmitted
    as prompt + tokens so far), the launcher restarts it, training finishes, and with seeded
    sampling the result equals a run without the fault: no sample was lost or duplicated."""
    model = sft_model(sft_reference)
    ref_dir = sync_reference

    run_dir, log = tmp_path / "recover" / "faulty", tmp_path / "faulty.log"
    two = ["allocation_mode=local.d2p1t1+d1p1t1"]
    cmd = grpo_cmd(tmp_path, model, "faulty", [*SYNC, *two])
    key = "recover-test-key"  # the launcher uses it for its servers: we may query them
    proc = start(cmd, log, env={"AREAL_SERVER_API_KEY": key})
    wait_for_step(proc, run_dir, 2, log)
    servers = [
        p
        for p in psutil.Process(proc.pid).children(recursive=True)
        if "arealite.server" in p.cmdline()
    ]
    assert len(servers) == 2
    victim = servers[0]
    port = victim.cmdline()[victim.cmdline().index("--port") + 1]
    wait_running_requests(f"http://127.0.0.1:{port}", key)  # kill it mid-generation
    victim.send_signal(signal.SIGKILL)
    finish(proc, log)

    text = open(log).read()
    assert "server0 died" in text and "restarting it" in text
    assert "taking inference server" in text  # the client noticed and failed over
    assert "resumed from" not in text  # the trainer never died
    assert_same_run(ref_dir, run_dir, GRPO_STEPS)
    assert trained_items(run_dir) == trained_items(ref_dir)


@pytest.mark.integration
def test_a_restarted_server_is_readmitted_with_the_current_weights(
    tiny_model_dir, tiny_model_dir_v2, tmp_path
):
    """The client probes failed servers; one that is healthy again loads the last pushed
    weights (tagged with their version) before it gets requests again."""
    import asyncio
    import shutil

    from arealite.api.cli_args import RolloutConfig
    from arealite.api.io_struct import GenerationHyperparameters, ModelRequest, WeightUpdateMeta
    from arealite.inference.sglang_remote import RemoteSGLangEngine
    from arealite.server.process import launch_server

    weights = str(tmp_path / "weights")
    shutil.copytree(tiny_model_dir_v2, weights)
    roots = ["--allowed-weight-roots", str(tmp_path)]
    a = launch_server(tiny_model_dir, dtype="float32", extra_args=roots)
    b = launch_server(tiny_model_dir, dtype="float32", extra_args=roots)
    engine = RemoteSGLangEngine(RolloutConfig(setup_timeout=120, request_retries=1))
    try:
        engine.initialize([a.address, b.address])
        engine.update_weights(WeightUpdateMeta.from_disk(weights, version=3)).result(timeout=60)
        b.proc.kill()
        b.proc.wait()
        g = GenerationHyperparameters(max_new_tokens=4, greedy=True)

        async def generate(n):
            reqs = [ModelRequest(rid=f"r{i}", input_ids=[5, 6, 7, i], gconfig=g) for i in range(n)]
            return await asyncio.gather(*(engine.agenerate(r) for r in reqs))

        assert all(r.output_versions == [3] * 4 for r in asyncio.run(generate(4)))
        assert list(engine.failed) == [b.address]
        b = launch_server(tiny_model_dir, port=b.port, dtype="float32", extra_args=roots)
        deadline = time.monotonic() + 60
        while engine.failed and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not engine.failed and engine.stats()["servers_readmitted"] == 1
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(f"{b.url}/get_weight_version", timeout=5) as r:
            assert json.loads(r.read())["weight_version"] == 3
        # The same prompt under new request ids, round-robin over a and b: greedy answers
        # agree only if b really serves the pushed weights (it started with other ones).
        reqs = [ModelRequest(rid=f"s{i}", input_ids=[5, 6, 7], gconfig=g) for i in range(6)]

        async def same_prompt():
            return await asyncio.gather(*(engine.agenerate(r) for r in reqs))

        resps = asyncio.run(same_prompt())
        assert {engine.pool._sticky[r.rid] for r in reqs} == {a.address, b.address}
        assert all(r.output_versions == [3] * 4 for r in resps)
        assert len({tuple(r.output_tokens) for r in resps}) == 1
    finally:
        engine.destroy()
        a.stop()
        b.stop()


# ----------------------------------------------------------------------------- reward faults


def test_reward_nan_raise_and_garbage_score_zero_and_are_counted():
    """A reward that is NaN / inf / not a number, or raises, scores 0 with a counted warning
    (a NaN would poison the advantages of its whole group)."""
    import asyncio

    import workflow_rewards as rewards

    from arealite.reward.pool import RewardPool

    pool = RewardPool(rewards.echo_row, max_workers=1, timeout=30)
    targets = [float("nan"), float("inf"), "abc", None, 0.5]

    async def score():
        return await asyncio.gather(
            *(
                pool(prompt="", completions="", prompt_ids=[], completion_ids=[], target=t)
                for t in targets
            )
        )

    try:
        assert asyncio.run(score()) == [0.0, 0.0, 0.0, 0.0, 0.5]
    finally:
        pool.close()
    assert pool.stats == {"calls": 5, "ok": 1, "timeouts": 0, "errors": 4}


# ----------------------------------------------------------------------------- checkpoint files


CHECKPOINT_SCRIPT = r"""
import json, os, resource, signal, sys
from arealite.api.cli_args import OptimizerConfig, TrainEngineConfig
from arealite.api.io_struct import FinetuneSpec
from arealite.engine.fsdp_engine import FSDPEngine
from arealite.trainer.recover import RecoverError, RecoverHandler
from arealite.api.cli_args import RecoverConfig
from torchdata.stateful_dataloader import StatefulDataLoader

model, run_dir = sys.argv[1], sys.argv[2]
spec = FinetuneSpec(1, 64, 8)
cfg = TrainEngineConfig(path=model, dtype="float32", optimizer=OptimizerConfig(lr=1e-3))
engine = FSDPEngine(cfg)
engine.initialize(None, spec)
loader = StatefulDataLoader(list(range(64)), batch_size=8)
it = iter(loader); next(it)
states = {"model": engine, "dataloader": loader}
recover = RecoverHandler(RecoverConfig(mode="auto", freq_steps=1), spec, run_dir, states)
recover.dump(1)
# A full disk from here on: files may not grow beyond 64 KiB (writes fail with EFBIG).
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
_, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))
next(it)
try:
    recover.dump(2)
    error = None
except RecoverError as e:
    error = str(e)
resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
fresh = FSDPEngine(cfg)
fresh.initialize(None, spec)
loader2 = StatefulDataLoader(list(range(64)), batch_size=8)
states2 = {"model": fresh, "dataloader": loader2}
start = RecoverHandler(RecoverConfig(mode="auto"), spec, run_dir, states2).load()
print(json.dumps({"error": error, "start": start, "next": next(iter(loader2)).tolist()}))
"""


@pytest.mark.integration
def test_a_full_disk_while_checkpointing_keeps_the_previous_checkpoint(tmp_path, tiny_model_dir):
    proc = subprocess.run(
        [sys.executable, "-c", CHECKPOINT_SCRIPT, tiny_model_dir, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "WORLD_SIZE": "1", "RANK": "0", "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "recover checkpoint for step 2 failed" in out["error"]
    assert "previous checkpoint" in out["error"] and "is intact" in out["error"]
    assert out["start"] == 1 and out["next"] == list(range(8, 16))  # step 1's state, intact
    leftovers = [p for p in os.listdir(tmp_path / "recover") if p != "checkpoint"]
    assert not leftovers, leftovers


def test_dcp_metadata_is_loaded_without_arbitrary_unpickling(tmp_path):
    """A tampered `.metadata` that would run code on pickle.load is refused."""
    import pickle

    from arealite.checkpoint.safe_state import safe_dcp_reader

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Exploit()))
    with pytest.raises(pickle.UnpicklingError, match="may not reference"):
        safe_dcp_reader(str(tmp_path)).read_metadata()
    assert not (tmp_path / "pwned").exists()


def test_recover_state_round_trips_rng_and_tensors_through_json():
    import random

    import numpy as np

    from arealite.checkpoint.safe_state import from_json, to_json
    from arealite.checkpoint.save_load import rng_state

    state = {"rng": rng_state(), "t": torch.arange(3, dtype=torch.bfloat16), "x": (1, [2.5])}
    back = from_json(json.loads(json.dumps(to_json(state))))
    assert back["rng"]["python"] == random.getstate()
    np_state = np.random.get_state()
    assert back["rng"]["numpy"][0] == np_state[0]
    assert np.array_equal(back["rng"]["numpy"][1], np_state[1])
    assert torch.equal(back["rng"]["torch"], torch.get_rng_state())
    assert torch.equal(back["t"], state["t"]) and back["x"] == (1, [2.5])
    with pytest.raises(TypeError, match="cannot store a object"):
        to_json({"bad": object()})


# ----------------------------------------------------------------------------- seeded sampling


def test_seeded_draws_depend_only_on_seed_and_position():
    from arealite.server.protocol import SamplingParams
    from arealite.server.sampling import SamplingTensors, sample_next_tokens

    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    logits[2] = logits[0]
    params = [SamplingParams(seed=7), SamplingParams(), SamplingParams(seed=7)]
    st = SamplingTensors.build(params, 64, "cpu")
    tokens = []
    for pos in range(40):
        t, _ = sample_next_tokens(logits, st, torch.Generator().manual_seed(pos), None, [pos] * 3)
        alone, _ = sample_next_tokens(
            logits[:1], SamplingTensors.build(params[:1], 64, "cpu"), None, None, [pos]
        )
        assert t[0] == t[2] == alone[0]  # same seed and position: same draw, whatever the batch
        tokens.append(int(t[0]))
    assert len(set(tokens)) > 5  # positions draw independently


@pytest.mark.integration
def test_a_seeded_request_resumed_after_an_abort_continues_the_same_tokens(tiny_model_dir):
    """What makes reruns reproducible: a seeded generation is the same alone or amid other
    requests, and prompt + its first k tokens continues with exactly its remaining tokens."""
    import concurrent.futures

    import requests

    from arealite.server.process import launch_server

    server = launch_server(tiny_model_dir, dtype="float32")
    session = requests.Session()
    session.trust_env = False  # never through a proxy

    def generate(ids, n, seed=11):
        sp = {"max_new_tokens": n, "ignore_eos": True, "sampling_seed": seed, "temperature": 1.0}
        r = session.post(
            f"{server.url}/generate", json={"input_ids": ids, "sampling_params": sp}, timeout=60
        )
        assert r.status_code == 200, r.text
        return r.json()["output_ids"]

    try:
        prompt = [5, 6, 7, 8]
        full = generate(prompt, 12)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            crowd = [pool.submit(generate, [9, i, 3], 12, seed=i) for i in range(7)]
            amid = pool.submit(generate, prompt, 12)
            assert amid.result() == full
            assert len({tuple(f.result()) for f in crowd}) > 1
        for k in (1, 5, 11):
            assert generate(prompt + full[:k], 12 - k) == full[k:]
        assert generate(prompt, 12, seed=12) != full
    finally:
        server.stop()


def test_a_kill_between_the_swap_renames_loses_no_checkpoint(tmp_path):
    """swap_in moves the old checkpoint aside, then renames the staged one in: a kill between
    the two leaves no `checkpoint/`; the next start puts the newest complete one back."""
    from arealite.api.cli_args import RecoverConfig
    from arealite.trainer.recover import COMPLETE, RecoverHandler

    handler = RecoverHandler(RecoverConfig(mode="auto"), None, str(tmp_path), {})
    root = tmp_path / "recover"
    (root / ".checkpoint.old-123").mkdir(parents=True)
    (root / ".checkpoint.old-123" / "rank0.json").write_text("old")
    handler._repair()  # only the moved-aside one: it comes back
    assert (root / "checkpoint" / "rank0.json").read_text() == "old"

    os.replace(root / "checkpoint", root / ".checkpoint.old-456")
    staged = root / ".checkpoint.staging"
    staged.mkdir()
    (staged / "rank0.json").write_text("new")
    handler._repair()  # an incomplete staged one is not trusted
    assert (root / "checkpoint" / "rank0.json").read_text() == "old"

    os.replace(root / "checkpoint", root / ".checkpoint.old-789")
    (staged / COMPLETE).write_text("{}")
    handler._repair()  # a complete staged one is the newest
    assert (root / "checkpoint" / "rank0.json").read_text() == "new"


class _Counter:
    """A minimal Stateful: what a script's own objects (a workflow's counters) look like."""

    def __init__(self, n: int = 0):
        self.n = n

    def state_dict(self) -> dict:
        return {"n": self.n, "rng": torch.get_rng_state()}

    def load_state_dict(self, state: dict) -> None:
        self.n = state["n"]


def test_named_states_are_restored_and_a_missing_name_is_refused(tmp_path):
    """`states` is given once; dump/load take no objects. A resumed run that names a state the
    checkpoint lacks fails naming it (and what the checkpoint holds); objects without
    state_dict/load_state_dict are refused up front."""
    from arealite.api.cli_args import RecoverConfig
    from arealite.api.io_struct import FinetuneSpec
    from arealite.trainer.recover import COMPLETE, RecoverError, RecoverHandler

    spec, cfg = FinetuneSpec(1, 8, 2), RecoverConfig(mode="auto", freq_steps=1)
    a, b = _Counter(3), _Counter(7)
    handler = RecoverHandler(cfg, spec, str(tmp_path), {"a": a, "b": b})
    assert handler.load() == 0  # nothing yet: a fresh start
    assert handler.dump(2)
    assert (tmp_path / "recover" / "checkpoint" / COMPLETE).exists()

    a2, b2 = _Counter(), _Counter()
    assert RecoverHandler(cfg, spec, str(tmp_path), {"a": a2, "b": b2}).load() == 2
    assert (a2.n, b2.n) == (3, 7)

    with pytest.raises(RecoverError, match=r"no state for 'c' \(it holds \['a', 'b'\]\)"):
        RecoverHandler(cfg, spec, str(tmp_path), {"a": a2, "c": _Counter()}).load()
    with pytest.raises(TypeError, match="recover state 'x' is a list"):
        RecoverHandler(cfg, spec, str(tmp_path), {"x": []})
    with pytest.raises(ValueError, match="recover state name 'a/b'"):
        RecoverHandler(cfg, spec, str(tmp_path), {"a/b": a})
    resume = RecoverConfig(mode="resume")
    with pytest.raises(FileNotFoundError, match="recover.mode=resume but no recover checkpoint"):
        RecoverHandler(resume, spec, str(tmp_path / "other"), {"a": a}).load()
