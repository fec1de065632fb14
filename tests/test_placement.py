"""GPU placement (launcher/placement.py): servers and trainer ranks on disjoint GPUs, from one
counter, within an existing CUDA_VISIBLE_DEVICES; the launcher refuses too few GPUs before
starting anything. The device count is faked (no GPU here); the rule is what is tested."""

import json
import os
import stat
import subprocess
import sys

import pytest
from _launch import grpo_config

from arealite.api.cli_args import ConfigError, GRPOConfig
from arealite.launcher.environment import trainer_env
from arealite.launcher.placement import (
    GpuPlan,
    check_resources,
    plan_cluster,
    plan_gpus,
    plan_local,
    visible_devices,
)
from arealite.launcher.preflight import check_weight_update
from arealite.launcher.servers import plan_servers


def config(tmp_path, allocation: str, gpus_per_node: int) -> GRPOConfig:
    return grpo_config(
        tmp_path, f"allocation_mode={allocation}", f"cluster.n_gpus_per_node={gpus_per_node}"
    )


def all_devices(plan) -> list[str]:
    return [d for s in plan.servers for d in s] + list(plan.trainer)


def test_eight_gpus_four_servers_four_ranks(tmp_path):
    plan = plan_local(config(tmp_path, "sglang.d4p1t1+d4p1t1", 8), 8, None)
    assert plan.servers == (("0",), ("1",), ("2",), ("3",))
    assert plan.trainer == ("4", "5", "6", "7")  # ranks 0-3 on GPUs 4-7, none next to a server


def test_colocated_generation_gives_every_gpu_to_the_trainer(tmp_path):
    """colocated+d2: no server, so the plan is the trainer's alone; no weight push to pick."""
    cfg = config(tmp_path, "colocated+d2p1t1", 2)
    plan = plan_local(cfg, 2, None)
    assert plan.servers == () and plan.trainer == ("0", "1")
    check_resources(cfg)
    cfg.weight_update = "distributed"
    with pytest.raises(ConfigError, match="colocated generation has none"):
        check_weight_update(cfg)


def test_tensor_parallel_servers_take_whole_groups(tmp_path):
    plan = plan_local(config(tmp_path, "sglang.d2p1t2+d4p1t1", 8), 8, None)
    assert plan.servers == (("0", "1"), ("2", "3"))
    assert plan.trainer == ("4", "5", "6", "7")
    assert len(set(all_devices(plan))) == 8


def test_an_existing_cuda_visible_devices_is_respected(tmp_path):
    plan = plan_local(config(tmp_path, "sglang.d1p1t1+d2p1t1", 3), 8, "5,2,7")
    assert plan.servers == (("5",),) and plan.trainer == ("2", "7")
    uuids = "GPU-aaaa,GPU-bbbb"
    assert visible_devices(8, uuids) == ["GPU-aaaa", "GPU-bbbb"]
    assert visible_devices(8, "") == [] and visible_devices(8, "0,-1,3") == ["0"]


def test_only_the_configured_gpus_per_node_are_used(tmp_path):
    plan = plan_local(config(tmp_path, "sglang.d1p1t1+d1p1t1", 2), 8, None)
    assert all_devices(plan) == ["0", "1"]


def test_cpu_runs_have_no_plan(tmp_path):
    assert plan_local(config(tmp_path, "local.d2p1t1+d2p1t1", 0), 8, None) is None
    env = trainer_env(config(tmp_path, "local.d1p1t1+d1p1t1", 0), [])
    assert "CUDA_VISIBLE_DEVICES" not in env


@pytest.mark.parametrize(
    "alloc,gpus,visible,needle",
    [
        ("sglang.d4p1t1+d4p1t1", 8, "0,1,2,3", "CUDA_VISIBLE_DEVICES='0,1,2,3' shows 4 GPU(s)"),
        ("sglang.d4p1t1+d4p1t1", 4, None, "need 8 distinct GPUs, but 4 are available"),
        ("sglang.d1p1t1+d2p1t1", 2, None, "need 3 distinct GPUs"),
    ],
)
def test_too_few_gpus_are_refused_naming_the_shortfall(tmp_path, alloc, gpus, visible, needle):
    with pytest.raises(ConfigError) as e:
        plan_local(config(tmp_path, alloc, gpus), 8, visible)
    assert needle in str(e.value)


def test_servers_and_trainer_get_their_devices_and_sglangs_nccl_settings(tmp_path):
    cfg = config(tmp_path, "sglang.d2p1t2+d4p1t1", 8)
    plan = plan_local(cfg, 8, None)
    envs = [plan.server_env(i) for i in range(2)]
    specs = plan_servers(cfg.allocation, cfg.server, [1, 2], [], envs)
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == ["0,1", "2,3"]
    env = trainer_env(cfg, ["h:1", "h:2"], plan)
    assert env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    assert env["NCCL_CUMEM_ENABLE"] == "0" and env["NCCL_NVLS_ENABLE"] == "0"
    cfg.launcher.env_vars = ["NCCL_CUMEM_ENABLE=1"]  # the user's explicit choice wins
    assert trainer_env(cfg, [], plan)["NCCL_CUMEM_ENABLE"] == "1"


def test_the_counter_never_hands_a_device_out_twice():
    for n_servers in range(4):
        for tp in (1, 2, 4):
            for ranks in range(1, 5):
                need = n_servers * tp + ranks
                plan = plan_gpus(n_servers, tp, ranks, [str(i) for i in range(need)])
                devices = all_devices(plan)
                assert len(devices) == len(set(devices)) == need


def test_shared_gpus_put_server_and_trainer_on_the_same_devices(tmp_path):
    """cluster.share_gpus: a one-GPU machine runs the embedded server and the trainer on GPU 0;
    without it the same run is refused; with it weights go as tensor handles (or disk): NCCL
    updates and Ray/Slurm are refused."""
    cfg = config(tmp_path, "local.d1p1t1+d1p1t1", 1)
    with pytest.raises(ConfigError, match="share_gpus=true"):
        plan_local(cfg, 1, None)
    cfg.cluster.share_gpus = True
    plan = plan_local(cfg, 1, None)
    assert plan.servers == (("0",),) and plan.trainer == ("0",)
    check_resources(cfg)
    two = config(tmp_path, "sglang.d1p1t2+d2p1t1", 2)
    two.cluster.share_gpus = True
    assert plan_local(two, 2, None) == GpuPlan(servers=(("0", "1"),), trainer=("0", "1"))
    cfg.weight_update = "distributed"
    with pytest.raises(ConfigError, match="needs weight_update=tensor"):
        check_resources(cfg)
    cfg.weight_update = "tensor"  # CUDA IPC handles on the shared GPU
    check_resources(cfg)
    check_weight_update(cfg)
    cfg.cluster.share_gpus = False
    with pytest.raises(ConfigError, match="tensor .*needs cluster.share_gpus=true"):
        check_weight_update(cfg)
    cfg.cluster.share_gpus = True
    vllm = config(tmp_path, "vllm.d1p1t1+d1p1t1", 1)
    vllm.weight_update = "tensor"
    with pytest.raises(ConfigError, match="weight_update=tensor needs SGLang"):
        check_weight_update(vllm)
    with pytest.raises(ConfigError, match="local launcher only"):
        plan_cluster(cfg)


def fake_nvidia_smi(tmp_path, n: int) -> dict[str, str]:
    """An environment whose nvidia-smi lists `n` GPUs (and no CUDA_VISIBLE_DEVICES)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    lines = "".join(f"echo 'GPU {i}: Fake (UUID: GPU-{i})'\n" for i in range(n))
    smi.write_text("#!/bin/sh\n" + lines)
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def launch(tmp_path, model: str, overrides: list[str], env: dict[str, str]):
    script = os.path.join(os.path.dirname(__file__), "scripts", "env_probe.py")
    args = [
        script,
        "experiment_name=p",
        "trial_name=t",
        f"cluster.fileroot={tmp_path}",
        f"actor.path={model}",
        "train_dataset.path=arith",
        *overrides,
    ]
    return subprocess.run(
        [sys.executable, "-m", "arealite.launcher.local", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_the_launcher_refuses_more_gpus_than_the_node_shows(tmp_path, tiny_model_dir):
    env = fake_nvidia_smi(tmp_path, 2)
    p = launch(
        tmp_path,
        tiny_model_dir,
        ["allocation_mode=sglang.d2p1t1+d2p1t1", "cluster.n_gpus_per_node=4"],
        env,
    )
    assert p.returncode == 2, p.stdout + p.stderr
    assert "cluster.n_gpus_per_node=4 but this node shows 2 GPU(s)" in p.stderr
    assert not (tmp_path / "p" / "t" / "logs").exists()  # nothing started


@pytest.mark.integration
def test_the_launcher_prints_the_plan_and_pins_each_side(tmp_path, tiny_model_dir):
    """Two fake GPUs: the embedded server gets GPU 0, the trainer's torchrun GPU 1 (torch
    here sees no CUDA, so both still compute on the CPU) and SGLang's NCCL settings."""
    env = fake_nvidia_smi(tmp_path, 2)
    p = launch(
        tmp_path,
        tiny_model_dir,
        [
            "allocation_mode=local.d1p1t1+d1p1t1",
            "cluster.n_gpus_per_node=2",
            "server.dtype=float32",
        ],
        env,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "server0: GPU 0" in p.stderr and "trainer rank 0: GPU 1" in p.stderr
    got = json.loads((tmp_path / "p" / "t" / "env0.json").read_text())
    assert got["CUDA_VISIBLE_DEVICES"] == "1" and got["NCCL_CUMEM_ENABLE"] == "0"


def test_two_ranks_on_one_gpu_are_refused(monkeypatch):
    """A rank's device is the LOCAL_RANK-th visible GPU, never shared (faked: 1 GPU, 2 ranks)."""
    import torch

    from arealite.utils import distributed as du

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(RuntimeError, match="2 trainer rank.*only 1 visible GPU.*its own GPU"):
        du.current_device()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert du.current_device() == torch.device("cuda", 0)


def test_a_tensor_parallel_trainer_keeps_each_tensor_group_on_one_node(tmp_path):
    """allocation_mode ...d2t2: 4 trainer ranks in 2 tensor groups of consecutive ranks (the
    engine's mesh has tp inner), printed as such; a node size that would split a group across
    nodes is refused naming the keys."""
    cfg = config(tmp_path, "sglang.d1p1t2+d2t2", 6)
    assert cfg.actor.tensor_parallel_size == 2
    plan = plan_local(cfg, 6, None)
    assert plan.servers == (("0", "1"),) and plan.trainer == ("2", "3", "4", "5")
    assert "trainer rank 3: GPU 5 (tensor group 1, tp 1)" in plan.describe()
    with pytest.raises(ConfigError, match=r"t4 must sit on one node.*n_gpus_per_node=6"):
        config(tmp_path, "sglang.d1+d2t4", 6)
