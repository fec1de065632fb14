"""`weight_update: auto` (arealite/api/weight_update.py): tensor handles where the servers share
the trainer's GPU, the NCCL broadcast where they are on other GPUs of the node, disk everywhere
else; the launcher resolves it once and hands the trainer the choice as an override."""

import logging

import pytest
from _launch import example_argv, grpo_config

from arealite.api.weight_update import choose_weight_update, resolve_weight_update
from arealite.launcher.placement import check_resources
from arealite.launcher.preflight import check_weight_update, load_and_check

CASES = [  # (overrides, expected mode, a word of the reason)
    (
        [
            "allocation_mode=sglang.d1p1t1+d1p1t1",
            "cluster.n_gpus_per_node=1",
            "cluster.share_gpus=true",
        ],
        "tensor",
        "share the trainer's GPU",
    ),
    (
        ["allocation_mode=local.d1p1t1+d1p1t1", "cluster.n_gpus_per_node=2"],
        "distributed",
        "other GPUs",
    ),
    (["allocation_mode=sglang.d2p1t1+d2p1t1", "cluster.n_gpus_per_node=4"], "distributed", "NCCL"),
    (["allocation_mode=local.d1p1t1+d1p1t1"], "disk", "CPU run"),
    (
        [
            "allocation_mode=sglang.d1p1t2+d2p1t1",
            "cluster.n_gpus_per_node=2",
            "cluster.share_gpus=true",
        ],
        "disk",
        "TP 2",
    ),
    (
        ["allocation_mode=sglang.d8p1t1+d8p1t1", "cluster.n_gpus_per_node=8", "cluster.n_nodes=2"],
        "disk",
        "other nodes",
    ),
    (["allocation_mode=vllm.d1p1t1+d1p1t1", "cluster.n_gpus_per_node=2"], "disk", "vLLM"),
    (
        ["allocation_mode=sglang.d1p1t1+d1p1t1", "cluster.n_gpus_per_node=2", "actor.lora.rank=8"],
        "disk",
        "LoRA",
    ),
    (["allocation_mode=colocated+d1p1t1", "cluster.n_gpus_per_node=1"], "disk", "colocated"),
]


@pytest.mark.parametrize("overrides,mode,why", CASES)
def test_auto_picks_the_fastest_transport_the_layout_allows(tmp_path, overrides, mode, why):
    cfg = grpo_config(tmp_path, *overrides)
    assert cfg.weight_update == "auto"  # the default
    chosen, reason = choose_weight_update(cfg)
    assert (chosen, why in reason) == (mode, True), reason
    assert resolve_weight_update(cfg) == mode and cfg.weight_update == mode
    check_weight_update(cfg)  # every choice passes the checks an explicit mode must pass
    check_resources(cfg)


def test_an_explicit_mode_is_kept_and_resolution_is_logged_once(tmp_path, caplog):
    cfg = grpo_config(tmp_path, "weight_update=disk", "cluster.n_gpus_per_node=2")
    assert resolve_weight_update(cfg) == "disk"
    with caplog.at_level(logging.INFO, logger="arealite.weight_update"):
        for _ in range(2):
            resolve_weight_update(grpo_config(tmp_path, "cluster.n_gpus_per_node=3"))
    lines = [r.getMessage() for r in caplog.records if "weight_update auto" in r.getMessage()]
    assert len(lines) <= 1  # once per process (an earlier test may have logged it already)


def test_the_launcher_resolves_once_and_passes_the_choice_to_the_trainer(tmp_path, tiny_model_dir):
    argv = example_argv(
        "grpo.py", "arith_grpo.yaml", f"cluster.fileroot={tmp_path}", f"actor.path={tiny_model_dir}"
    )
    _, script_args, config = load_and_check(argv)
    assert config.weight_update == "disk"  # a CPU run
    assert script_args[-1] == "weight_update=disk"
    _, script_args, _ = load_and_check([*argv, "weight_update=distributed"])
    assert "weight_update=disk" not in script_args  # an explicit mode travels as given
