"""Checks a launcher runs before starting anything, so a bad config fails in seconds."""

from __future__ import annotations

import importlib
import os
import re

from omegaconf import OmegaConf

from arealite.api.cli_args import ConfigError, GRPOConfig, SFTConfig, load_expr_config
from arealite.api.lora_config import check_lora_models
from arealite.api.reward_api import RewardSpecError, reward_specs
from arealite.api.rm_config import (
    BUILTIN_PREFERENCES,
    PreferenceFormatError,
    RMConfig,
    is_preference_data,
    read_preference_rows,
)
from arealite.api.weight_update import AUTO, resolve_weight_update
from arealite.launcher.memory_plan import check_memory
from arealite.launcher.reward_probe import probe_rewards
from arealite.reward.resolve import is_library_reward, resolve_reward
from arealite.tasks import check_dataset_config, default_reward, first_reward_row

# "org/name" (a hub id) rather than a filesystem path.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


USAGE = "usage: python -m arealite.launcher.<local|ray|slurm> SCRIPT --config YAML [key=value ...]"


def split_launcher_args(argv: list[str]) -> tuple[str, list[str], str | None]:
    """`SCRIPT [--config-cls mod:Cls] --config YAML k=v ...` -> (script, script_args, cls)."""
    if argv and argv[0] in ("-h", "--help"):
        print(f"{USAGE}\n\n`SCRIPT --help [SECTION]` lists the config keys (type, default, help).")
        raise SystemExit(0)
    if not argv or argv[0].startswith("-"):
        raise ConfigError(USAGE)
    script, rest = argv[0], list(argv[1:])
    if not os.path.isfile(script):
        raise ConfigError(f"Training script not found: {script}")
    cls_path = None
    if "--config-cls" in rest:
        i = rest.index("--config-cls")
        cls_path = rest[i + 1] if i + 1 < len(rest) else None
        del rest[i : i + 2]
        if not cls_path:
            raise ConfigError("--config-cls needs a value like arealite.api.cli_args:GRPOConfig")
    return script, rest, cls_path


def resolve_config_cls(script_args: list[str], cls_path: str | None) -> type:
    """GRPOConfig when the allocation mode has inference servers, else SFTConfig (or explicit)."""
    if cls_path:
        mod, _, name = cls_path.partition(":")
        try:
            return getattr(importlib.import_module(mod), name)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"--config-cls {cls_path!r}: {e}") from None
    mode = _config_value(script_args, "allocation_mode")
    if mode is not None and "+" not in str(mode):
        # Train-only: a reward model when the training data are preference pairs, else SFT.
        if is_preference_data(str(_config_value(script_args, "train_dataset.path") or "")):
            return RMConfig
        return SFTConfig
    return GRPOConfig


def _config_value(script_args: list[str], key: str):
    """`key` from a `key=value` override, else from the --config YAML (None when unset)."""
    for a in reversed(script_args):
        if a.startswith(f"{key}="):
            return a.split("=", 1)[1]
    if "--config" in script_args:
        path = script_args[script_args.index("--config") + 1]
        if os.path.isfile(path):
            return OmegaConf.select(OmegaConf.load(path), key, default=None)
    return None


# Config keys naming a model; tokenizer_path may be a tokenizer-only folder (no config.json).
MODEL_KEYS = ("actor.path", "ref.path", "critic.path", "model.path", "server.model_path")
TOKENIZER_KEY = "tokenizer_path"


def _get(config, key: str):
    for part in key.split("."):
        config = getattr(config, part, None)
    return config


def _set(config, key: str, value: str) -> None:
    *parents, leaf = key.split(".")
    for part in parents:
        config = getattr(config, part)
    setattr(config, leaf, value)


def local_model_dir(key: str, path: str, need_config: bool = True) -> str:
    """The local directory of `key`'s model: `path` itself (checked for config.json), or the
    snapshot a hub id resolves to, downloaded once (or found in the cache offline)."""
    if os.path.isdir(path):
        if need_config and not os.path.isfile(os.path.join(path, "config.json")):
            raise ConfigError(
                f"{key}={path!r}: the folder has no config.json, so it is not a Hugging Face "
                "model directory; point it at the folder holding config.json and the weights "
                "(e.g. the output of save_pretrained)"
            )
        return path
    if not _HUB_ID.match(path):
        raise ConfigError(
            f"{key}={path!r}: no such model directory (and not a hub id like org/name)"
        )
    return _snapshot(key, path)


def _snapshot(key: str, repo_id: str) -> str:
    from huggingface_hub import constants, snapshot_download

    try:
        return snapshot_download(repo_id)
    except Exception as e:  # network, auth, missing repo, offline cache miss: all say the same
        where = (
            f"HF_HUB_OFFLINE=1: not in the hub cache {constants.HF_HUB_CACHE}"
            if (constants.HF_HUB_OFFLINE)
            else "download failed"
        )
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ConfigError(
            f"{key}={repo_id!r}: hub model {repo_id!r} could not be resolved ({where}; "
            f"{type(e).__name__}: {first}); download it once (`hf download {repo_id}`) or "
            "point the key at a local model directory"
        ) from None


def resolve_models(config, script_args: list[str]) -> list[str]:
    """Check every model path and resolve hub ids once, here: `config` is updated in place
    (the launcher starts the servers from it) and the returned script args carry the local
    directories as overrides, so trainer ranks never resolve (or download) again."""
    resolved: dict[str, str] = {}
    overrides = []
    for key in (*MODEL_KEYS, TOKENIZER_KEY):
        value = _get(config, key)
        if not value:
            continue
        if value not in resolved:
            resolved[value] = local_model_dir(key, value, need_config=key != TOKENIZER_KEY)
        if resolved[value] != value:
            _set(config, key, resolved[value])
            overrides.append(f"{key}={resolved[value]}")
    return [*script_args, *overrides]


def check_task(config) -> None:
    """The datasets open with the columns the run needs (arealite/tasks/load.py), and every
    reward imports with the contract's signature (arealite/api/reward_api.py), before any
    server starts."""
    if isinstance(config, RMConfig):
        return check_preferences(config)
    kind = "sft" if isinstance(config, SFTConfig) else "rl"
    for key in ("train_dataset", "valid_dataset"):
        cfg = getattr(config, key, None)
        if cfg is None or not cfg.path:
            continue
        try:
            check_dataset_config(cfg, kind)
        except (ValueError, TypeError, OSError) as e:
            raise ConfigError(f"{key}.path={cfg.path!r}: {e}") from None
    if kind != "rl" or not hasattr(config, "reward"):
        return
    reward = config.reward or default_reward(config.train_dataset.path)
    if reward is None and getattr(getattr(config, "agent", None), "command", None):
        return  # agent.command: the agent answers its own rewards
    if reward is None:
        raise ConfigError(
            f"reward is not set and train_dataset.path={config.train_dataset.path!r} is not a "
            "built-in task: set reward: my_rewards.py:score (see arealite/api/reward_api.py)"
        )
    checks = [("reward", reward, config.reward_weights)]
    if getattr(config, "eval_reward", None):
        checks.append(("eval_reward", config.eval_reward, None))
    for key, value, weights in checks:
        try:
            for spec, _ in reward_specs(value, weights):
                resolve_reward(spec)
        except RewardSpecError as e:
            raise ConfigError(f"{key}: {e}") from None


def check_rewards_call(config) -> None:
    """Each user reward is called once on row 0 of its data (reward_probe.py): one that imports
    and has the contract's signature can still raise, or return None, on every sample. The
    library's own (built-in names, reward-model folders) are tested with the library."""
    if not isinstance(config, GRPOConfig):
        return
    checks = []  # a built-in task's own reward (`reward:` unset) is the library's
    if config.reward:
        checks.append(("reward", config.reward, config.reward_weights, "train_dataset"))
    if config.eval_reward:
        data_key = "valid_dataset" if config.valid_dataset is not None else "train_dataset"
        checks.append(("eval_reward", config.eval_reward, None, data_key))
    for key, value, weights, data_key in checks:
        cfg = getattr(config, data_key)
        specs = [s for s, _ in reward_specs(value, weights) if not is_library_reward(s)]
        if not specs:
            continue
        try:
            row = first_reward_row(cfg)
        except Exception as e:  # a built-in task that cannot load here: the run will say why
            print(f"preflight: {key} not called ({data_key} row 0 did not load: {e})")
            continue
        if row is not None:
            where = f"row 0 of {data_key}.path={cfg.path!r}"
            probe_rewards(key, specs, row, where, config.rollout.reward_timeout)


def check_preferences(config: RMConfig) -> None:
    """Reward-model data: every jsonl row has a prompt (or messages), chosen and rejected."""
    for key in ("train_dataset", "valid_dataset"):
        cfg = getattr(config, key, None)
        if cfg is None or not cfg.path or cfg.path == BUILTIN_PREFERENCES:
            continue
        if not os.path.isfile(cfg.path):
            raise ConfigError(f"{key}.path={cfg.path!r}: no such file")
        try:
            read_preference_rows(cfg.path)
        except PreferenceFormatError as e:  # the message names the file and row
            raise ConfigError(f"{key}: {e}") from None


# Typical |weight| of a trained LLM's linear layers; bf16 keeps 8 significant bits, so an
# update below half a unit in the last place (|w| * 2**-8) rounds back to the old weight.
TYPICAL_WEIGHT = 0.02
BF16_HALF_ULP = 2.0**-8


def check_master_weight_precision(config) -> None:
    """Refuse bf16 master weights with an lr they cannot represent: an AdamW step moves each
    weight by about lr, which rounds away below |w| * 2**-8, so the run would train nothing."""
    floor = TYPICAL_WEIGHT * BF16_HALF_ULP
    for key in ("actor", "critic", "model"):
        cfg = getattr(config, key, None)
        opt = getattr(cfg, "optimizer", None)
        if cfg is None or opt is None or str(getattr(cfg, "dtype", "")) != "bfloat16":
            continue
        if opt.lr < floor:
            raise ConfigError(
                f"{key}.dtype=bfloat16 with {key}.optimizer.lr={opt.lr:g}: bf16 master weights "
                f"cannot take a step below ~{floor:.1e} on typical weights (|w| ~ "
                f"{TYPICAL_WEIGHT}), so most updates round away and the model does not learn; "
                f"use {key}.dtype=float32 (fp32 master weights) with "
                f"{key}.fsdp.param_dtype=bfloat16 (bf16 compute)"
            )


def check_weight_update(config) -> None:
    """distributed / tensor speak SGLang's protocols (SGLang, embedded server), full weights
    only; tensor hands CUDA IPC handles to servers on the trainer's own GPU."""
    mode = getattr(config, "weight_update", "disk")
    if mode == "disk":
        return
    if config.allocation.colocated:
        raise ConfigError(
            f"weight_update={mode} pushes weights to inference servers; colocated generation "
            "has none (every rank copies its weights in memory): leave weight_update at disk"
        )
    if config.allocation.gen_backend == "vllm":
        raise ConfigError(
            f"weight_update={mode} needs SGLang's weight endpoints (sglang or the embedded "
            "'local' backend); with vllm use weight_update=disk"
        )
    lora = getattr(getattr(config, "actor", None), "lora", None)
    if lora is not None:
        raise ConfigError(
            f"weight_update={mode} sends full weights; a LoRA actor syncs merged weights "
            "through disk: use weight_update=disk"
        )
    gpus = config.cluster.n_gpus_per_node
    if mode == "tensor" and gpus and not config.cluster.share_gpus:
        raise ConfigError(
            "weight_update=tensor hands the servers handles of the trainer's GPU memory: it "
            "needs cluster.share_gpus=true (server and trainer on the same GPU)"
        )
    gen = config.allocation.gen
    if mode == "tensor" and gen is not None and gen.tensor_parallel_size > 1:
        raise ConfigError("weight_update=tensor: servers of tensor-parallel size 1 only")


def load_and_check(argv: list[str]):
    """Parse launcher argv and validate everything that can be validated without starting."""
    script, script_args, cls_path = split_launcher_args(argv)
    config_cls = resolve_config_cls(script_args, cls_path)
    config = load_expr_config(script_args, config_cls)
    script_args = resolve_models(config, script_args)
    check_task(config)
    check_rewards_call(config)  # each reward, once, on a real row (after the cheap checks)
    check_lora_models(config)  # target_modules against the model's modules (meta device)
    check_master_weight_precision(config)
    script_args = resolve_weight_update_arg(config, script_args)
    check_weight_update(config)
    check_memory(config)  # each GPU's expected peak, refused when it cannot fit (memory_plan.py)
    return script, script_args, config


def resolve_weight_update_arg(config, script_args: list[str]) -> list[str]:
    """Resolve `weight_update: auto` once, here (logged with the reason), and hand the trainer
    the chosen mode as an override, so it never chooses again (arealite/api/weight_update.py)."""
    if getattr(config, "weight_update", None) != AUTO:
        return script_args
    return [*script_args, f"weight_update={resolve_weight_update(config)}"]
