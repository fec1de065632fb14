"""Config loading: YAML + dotted overrides, with errors that name the key."""

import pytest

from arealite.api.cli_args import (
    ConfigError,
    GRPOConfig,
    SFTConfig,
    load_expr_config,
    to_yaml,
)
from arealite.api.io_struct import AllocationMode, FinetuneSpec, GenerationHyperparameters


@pytest.fixture
def grpo_yaml(tmp_path):
    p = tmp_path / "grpo.yaml"
    p.write_text(
        "experiment_name: e\ntrial_name: t\nactor:\n  path: /some/model\ngconfig:\n  n_samples: 4\n"
    )
    return str(p)


def test_yaml_and_overrides(grpo_yaml):
    cfg = load_expr_config(
        ["--config", grpo_yaml, "actor.optimizer.lr=3e-4", "rollout.max_head_offpolicyness=4"],
        GRPOConfig,
    )
    assert isinstance(cfg, GRPOConfig)
    assert cfg.actor.optimizer.lr == 3e-4
    assert cfg.rollout.max_head_offpolicyness == 4
    assert cfg.actor.group_size == 4
    assert cfg.server.model_path == "/some/model"  # defaults to actor.path
    assert cfg.run_dir.endswith("e/t")
    assert "lr: 0.0003" in to_yaml(cfg)


def test_unknown_key_suggests_real_field(grpo_yaml):
    with pytest.raises(ConfigError) as e:
        load_expr_config(["--config", grpo_yaml, "actor.lrr=1"], GRPOConfig)
    assert "actor.lrr" in str(e.value) and "actor.optimizer.lr" in str(e.value)


def test_unknown_key_in_yaml_names_file(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("experiment_name: e\ntrial_name: t\nactor:\n  path: m\n  eps_clp: 0.1\n")
    with pytest.raises(ConfigError, match=r"actor\.eps_clp.*bad\.yaml.*actor\.eps_clip"):
        load_expr_config(["--config", str(p)], GRPOConfig)


def test_wrong_type_names_key_value_and_type(grpo_yaml):
    with pytest.raises(ConfigError) as e:
        load_expr_config(["--config", grpo_yaml, "actor.optimizer.lr=fast"], GRPOConfig)
    msg = str(e.value)
    assert "actor.optimizer.lr" in msg and "fast" in msg and "float" in msg


def test_missing_file_names_path():
    with pytest.raises(ConfigError, match="/no/such/file.yaml"):
        load_expr_config(["--config", "/no/such/file.yaml"], GRPOConfig)


def test_missing_required_key():
    with pytest.raises(ConfigError, match="experiment_name"):
        load_expr_config(["actor.path=m"], GRPOConfig)


@pytest.mark.parametrize(
    "override,needle",
    [
        ("allocation_mode=d2p1t1", "needs inference servers"),
        ("allocation_mode=tpu.d1+d1", "unknown generation backend 'tpu'"),
        ("actor.kl_ctl=0.1", "ref.path"),
        ("actor.c_clip=0.5", "c_clip"),
        ("actor.optimizer.lr_scheduler_type=exp", "lr_scheduler_type"),
        ("evaluator.n_samples=4", "evaluator.n_samples=4 with temperature 0"),
        ("evaluator.temperature=-1", "evaluator.temperature must be >= 0"),
        ("evaluator.n_samples=0", "evaluator.n_samples must be >= 1"),
    ],
)
def test_impossible_combinations(grpo_yaml, override, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.").replace("(", r"\(")):
        load_expr_config(["--config", grpo_yaml, override], GRPOConfig)


def test_a_skip_probability_of_one_is_refused(grpo_yaml):
    """Probability 1 would skip a solved prompt forever, even once the policy fails it again."""
    args = ["rollout.dynamic_sampling=true", "rollout.dynamic_sampling_skip_max_prob=1"]
    with pytest.raises(ConfigError, match=r"dynamic_sampling_skip_max_prob must be in \[0, 1\)"):
        load_expr_config(["--config", grpo_yaml, *args], GRPOConfig)


def test_derived_keys_follow_the_users_key(grpo_yaml):
    """One key per fact: the group size is gconfig.n_samples, the prompts per step
    train_dataset.batch_size; the written config leaves the derived keys out, so it loads."""
    cfg = load_expr_config(
        ["--config", grpo_yaml, "train_dataset.batch_size=6", "gconfig.n_samples=3"]
        + ["gconfig.temperature=0.7"],
        GRPOConfig,
    )
    assert cfg.rollout.consumer_batch_size == 6 and cfg.actor.group_size == 3
    assert cfg.actor.temperature == 0.7  # the trainer's log-probs at the sampler's temperature
    written = to_yaml(cfg)
    assert "consumer_batch_size" not in written and "group_size" not in written
    assert "n_samples: 3" in written


@pytest.mark.parametrize(
    "key,instead",
    [
        ("actor.group_size=4", "gconfig.n_samples"),
        ("ref.group_size=4", "gconfig.n_samples"),
        ("actor.temperature=0.7", "gconfig.temperature"),
        ("rollout.consumer_batch_size=8", "train_dataset.batch_size"),
        ("async_training=false", "rollout.max_head_offpolicyness"),
        ("rollout.reward_fail_fast_calls=64", "rollout.reward_fail_fast_steps"),
        ("actor.dynamic_sampling=true", "rollout.dynamic_sampling"),
        ("actor.dynamic_sampling_max_oversample=2", "rollout.dynamic_sampling_max_oversample"),
        ("actor.dynamic_sampling_skip_max_prob=0.5", "rollout.dynamic_sampling_skip_max_prob"),
    ],
)
def test_removed_keys_name_the_key_to_set(grpo_yaml, tmp_path, key, instead):
    name = key.split("=")[0]
    with pytest.raises(ConfigError) as e:  # command line
        load_expr_config(["--config", grpo_yaml, key], GRPOConfig)
    assert repr(name) in str(e.value) and f"set {instead}" in str(e.value)
    *parents, leaf = name.split(".")
    nested = "".join(f"{'  ' * i}{p}:\n" for i, p in enumerate(parents))
    p = tmp_path / "old.yaml"
    p.write_text(
        "experiment_name: e\ntrial_name: t\n" + nested + f"{'  ' * len(parents)}{leaf}: 4\n"
    )
    with pytest.raises(ConfigError, match=rf"{name}.*old\.yaml.*set {instead}"):  # YAML
        load_expr_config(["--config", str(p)], GRPOConfig)


def test_derived_keys_are_not_in_help():
    from arealite.api.config_loader import config_help

    text = config_help(GRPOConfig)
    assert "actor.group_size" not in text and "rollout.consumer_batch_size" not in text
    assert "async_training" not in text and "gconfig.n_samples" in text


def test_presets_apply_under_explicit_values(grpo_yaml):
    cfg = load_expr_config(["--config", grpo_yaml, "actor.preset=dapo"], GRPOConfig)
    assert cfg.actor.eps_clip_higher == 0.28 and cfg.rollout.dynamic_sampling
    assert cfg.actor.dynamic_sampling  # the actor's loss mask follows the rollout key
    cfg = load_expr_config(
        ["--config", grpo_yaml, "actor.preset=dapo", "actor.eps_clip_higher=0.3"], GRPOConfig
    )
    assert cfg.actor.eps_clip_higher == 0.3
    with pytest.raises(ConfigError, match="preset"):
        load_expr_config(["--config", grpo_yaml, "actor.preset=nope"], GRPOConfig)


def test_optional_subconfig_created_by_override(grpo_yaml):
    cfg = load_expr_config(
        ["--config", grpo_yaml, "ref.path=/ref", "actor.kl_ctl=0.01"], GRPOConfig
    )
    assert cfg.ref.path == "/ref" and cfg.ref.optimizer is not None


def test_sft_requires_train_only_allocation(tmp_path):
    with pytest.raises(ConfigError, match="train-only"):
        load_expr_config(
            ["experiment_name=e", "trial_name=t", "model.path=m", "allocation_mode=local.d1+d1"],
            SFTConfig,
        )
    with pytest.raises(ConfigError, match=r"evaluator.temperature=1.0.*SFT evaluates its loss"):
        load_expr_config(
            ["experiment_name=e", "trial_name=t", "model.path=m", "evaluator.temperature=1.0"],
            SFTConfig,
        )


def test_allocation_mode_parsing():
    a = AllocationMode.from_str("sglang.d2p1t1+d2p1t1")
    assert (a.gen_backend, a.gen_n_servers, a.train_world_size) == ("sglang", 2, 2)
    a = AllocationMode.from_str("vllm.d1p1t2+d4")
    assert (a.gen_n_servers, a.gen_world_size, a.train_world_size) == (1, 2, 4)
    a = AllocationMode.from_str("d2p1t1")
    assert a.train_only and a.train_world_size == 2 and a.gen_n_servers == 0
    assert AllocationMode.from_str("local.d1p1t1+d2p1t1").gen_backend == "local"
    a = AllocationMode.from_str("sglang.d1+d2t2")  # tensor-parallel trainer: 4 ranks
    assert (a.train.tensor_parallel_size, a.train_world_size) == (2, 4)
    a = AllocationMode.from_str("colocated+d2p1t1")  # the trainer ranks generate: no server
    assert a.colocated and not a.train_only and (a.gen_n_servers, a.train_world_size) == (0, 2)
    for bad, needle in [
        ("sglang.d2x1+d1", "'d2x1'"),
        ("sglang+d1", "must name a backend"),
        ("mpi.d1+d1", "'mpi'"),
        ("sglang.d1+d1p2", "no pipeline parallelism"),
        ("", "Bad parallel strategy"),
        ("local.d1", "needs a trainer part"),
        ("colocated.d1+d1", "'colocated+d1'"),
        ("colocated+d1t2", "must be t1"),
    ]:
        with pytest.raises(ValueError, match=needle.replace("+", r"\+").replace(".", r"\.")):
            AllocationMode.from_str(bad)


def test_io_struct_validation():
    g = GenerationHyperparameters(n_samples=4, temperature=0.7)
    assert g.new(n_samples=1).n_samples == 1 and g.n_samples == 4
    assert GenerationHyperparameters(greedy=True).to_sampling_params()["top_k"] == 1
    with pytest.raises(ValueError, match="max_new_tokens"):
        GenerationHyperparameters(max_new_tokens=-1)
    spec = FinetuneSpec(total_train_epochs=3, dataset_size=100, train_batch_size=8)
    assert spec.steps_per_epoch == 12 and spec.total_train_steps == 36


@pytest.mark.parametrize(
    "override,allowed",
    [
        ("cluster.name_resolve.type=etcd", "['nfs', 'ray']"),
        ("recover.mode=always", "['disabled', 'auto', 'resume']"),
        ("actor.kl_estimator=k4", "['k1', 'k2', 'k3']"),
        ("actor.optimizer.lr_scheduler_type=exp", "['constant', 'linear', 'cosine']"),
        ("actor.fsdp.param_dtype=fp8", "['auto', 'float32', 'bfloat16', 'float16']"),
        ("ref.dtype=int8", "['float32', 'bfloat16', 'float16']"),
        ("train_dataset.too_long=truncate", "['drop', 'fail']"),
        ("actor.preset=nope", "['grpo', 'dr_grpo', 'dapo', 'rloo', 'reinforce_pp', 'gspo', 'ppo']"),
    ],
)
def test_choices_name_the_full_key_and_the_allowed_values(grpo_yaml, override, allowed):
    """Choices are Literal types: the loader refuses a value outside them before anything
    starts, naming the full dotted key, the value and every allowed value."""
    key, value = override.split("=")
    with pytest.raises(ConfigError) as e:
        load_expr_config(["--config", grpo_yaml, override], GRPOConfig)
    assert str(e.value) == f"{key}={value!r} is not allowed; choose one of {allowed}"


def test_choices_are_checked_for_configs_built_in_python():
    from arealite.api.cli_args import RecoverConfig, StatsLoggerConfig, TrainEngineConfig

    with pytest.raises(ConfigError, match=r"RecoverConfig\.mode='always' is not allowed"):
        RecoverConfig(mode="always")
    with pytest.raises(ConfigError, match=r"choose one of \['disabled', 'cloud', 'local'\]"):
        StatsLoggerConfig(swanlab_mode="online")
    with pytest.raises(ConfigError, match=r"TrainEngineConfig\.attn_impl='flash'"):
        TrainEngineConfig(attn_impl="flash")
    assert TrainEngineConfig(dtype="bfloat16").dtype == "bfloat16"  # plain strings, not enums


@pytest.mark.parametrize(
    "key",
    [
        "train_dataset.num_workers",
        "train_dataset.type",
        "actor.backend",
        "actor.optimizer.type",
        "cluster.name_resolve.etcd_address",
    ],
)
def test_keys_that_did_nothing_are_gone(grpo_yaml, key):
    with pytest.raises(ConfigError, match=f"Unknown config key {key!r}"):
        load_expr_config(["--config", grpo_yaml, f"{key}=1"], GRPOConfig)


def test_every_preset_name_has_values():
    from typing import get_args

    from arealite.api.presets import ACTOR_PRESETS, PresetName

    assert list(ACTOR_PRESETS) == list(get_args(PresetName))


def test_help_lists_every_key_with_type_default_and_help(capsys):
    from arealite.api.config_loader import _valid_keys, config_help

    text = config_help(GRPOConfig)
    for key in _valid_keys(GRPOConfig):
        assert f"  {key}:" in text or f"[{key}]" in text, key
    assert "  actor.optimizer.lr: float = 1e-05\n      Peak learning rate." in text
    assert "actor.kl_estimator: one of [k1, k2, k3] = 'k1'" in text  # Literal: the choices
    assert "  experiment_name: str = (required)" in text
    assert "[ref] (optional: null unless set)" in text
    with pytest.raises(SystemExit) as e:  # what the entry points do with --help SECTION
        load_expr_config(["--help", "actor"], GRPOConfig)
    assert e.value.code == 0
    section = capsys.readouterr().out
    assert section.startswith("[actor]") and "actor.eps_clip: float = 0.2" in section
    assert "rollout." not in section and "train_dataset." not in section
    with pytest.raises(ConfigError, match=r"--help actr: no such section.*actor"):
        config_help(GRPOConfig, "actr")


def test_launcher_help_shows_one_section():
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sft = ["examples/sft.py", "--config", "examples/configs/arith_sft.yaml"]  # picks SFTConfig
    cmd = [sys.executable, "-m", "arealite.launcher.local", *sft, "--help", "model"]
    p = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "model.optimizer.lr_scheduler_type: one of" in p.stdout, p.stderr


def _entry_config(name: str):
    """The config class of the entry point a shipped YAML is for (sft.py, rm.py, grpo.py)."""
    from arealite.api.rm_config import RMConfig

    if "_rm" in name and "grpo" not in name:
        return RMConfig
    return SFTConfig if "_sft" in name else GRPOConfig


def test_every_shipped_yaml_loads_under_its_entry_point():
    """A typo'd key or a wrong choice in examples/configs/*.yaml fails here, not in a user's run."""
    import glob
    import os

    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
    paths = sorted(glob.glob(os.path.join(root, "configs", "*.yaml")))
    assert len(paths) >= 14
    for path in paths:
        cfg = load_expr_config(["--config", path], _entry_config(os.path.basename(path)))
        assert cfg.experiment_name, path
