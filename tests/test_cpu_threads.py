"""How the local launcher hands out CPU threads on a CPU-only node (`launcher.cpu_threads`)."""

import os

import pytest
from _launch import grpo_config

from arealite.api.cli_args import GRPOConfig
from arealite.launcher.environment import cpu_thread_env, trainer_env


def config(tmp_path, allocation: str, policy: str | None = None) -> GRPOConfig:
    threads = [f"launcher.cpu_threads={policy}"] if policy else []
    return grpo_config(tmp_path, f"allocation_mode={allocation}", *threads)


@pytest.fixture
def eight_cores(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 8)


def test_shared_gives_each_side_every_core_and_sleeping_idle_pools(tmp_path, eight_cores):
    cfg = config(tmp_path, "local.d2p1t1+d2p1t1")
    assert cfg.launcher.cpu_threads == "shared"  # the default
    server = cpu_thread_env(cfg, cfg.allocation.gen_n_servers)
    assert server == {"OMP_NUM_THREADS": "4", "OMP_WAIT_POLICY": "PASSIVE"}
    env = trainer_env(cfg, [])
    assert (env["OMP_NUM_THREADS"], env["OMP_WAIT_POLICY"]) == ("4", "PASSIVE")


def test_split_divides_the_cores_among_all_processes(tmp_path, eight_cores):
    cfg = config(tmp_path, "local.d2p1t1+d2p1t1", "split")
    assert cpu_thread_env(cfg, cfg.allocation.gen_n_servers) == {"OMP_NUM_THREADS": "2"}
    assert trainer_env(cfg, [])["OMP_NUM_THREADS"] == "2"


def test_colocated_generation_shares_a_ranks_cores_only_when_it_overlaps(tmp_path, eight_cores):
    """eta >= 1: generation (a thread of the rank) runs beside training, each gets half the
    rank's cores; eta 0: they alternate, so each gets all of them."""
    cfg = config(tmp_path, "colocated+d2p1t1")
    cfg.rollout.max_head_offpolicyness = 1
    assert trainer_env(cfg, [])["OMP_NUM_THREADS"] == "2"
    cfg.rollout.max_head_offpolicyness = 0
    assert trainer_env(cfg, [])["OMP_NUM_THREADS"] == "4"


def test_the_users_env_vars_win(tmp_path, eight_cores):
    cfg = config(tmp_path, "local.d1p1t1+d1p1t1")
    cfg.launcher.env_vars = ["OMP_NUM_THREADS=3"]
    assert trainer_env(cfg, [])["OMP_NUM_THREADS"] == "3"


def test_an_unknown_policy_is_refused_naming_the_key(tmp_path):
    with pytest.raises(Exception, match="launcher.cpu_threads"):
        config(tmp_path, "local.d1p1t1+d1p1t1", "greedy")
