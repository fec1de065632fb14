"""Checks a launcher runs before starting anything, so a bad config fails in seconds."""

from __future__ import annotations

import importlib
import os
import re

from omegaconf import OmegaConf

from arealite.api.cli_args import ConfigError, GRPOConfig, SFTConfig, load_expr_config

# "org/name" (a hub id) rather than a filesystem path.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# Dataset names the dataset layer generates or knows without a path.
BUILTIN_DATASETS = ("arith", "synthetic_counting")


def split_launcher_args(argv: list[str]) -> tuple[str, list[str], str | None]:
    """`SCRIPT [--config-cls mod:Cls] --config YAML k=v ...` -> (script, script_args, cls)."""
    if not argv or argv[0].startswith("-"):
        raise ConfigError(
            "usage: python -m arealite.launcher.<local|ray|slurm> SCRIPT --config YAML [key=value ...]"
        )
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
    mode = None
    for a in script_args:
        if a.startswith("allocation_mode="):
            mode = a.split("=", 1)[1]
    if mode is None and "--config" in script_args:
        path = script_args[script_args.index("--config") + 1]
        if os.path.isfile(path):
            mode = OmegaConf.select(OmegaConf.load(path), "allocation_mode", default=None)
    if mode is not None and "+" not in str(mode):
        return SFTConfig
    return GRPOConfig


def _check_model_path(key: str, path: str) -> None:
    if not path or os.path.isdir(path) or _HUB_ID.match(path):
        return
    raise ConfigError(f"{key}={path!r}: no such model directory (and not a hub id like org/name)")


def _check_dataset_path(key: str, path: str) -> None:
    if path in BUILTIN_DATASETS or os.path.exists(path) or _HUB_ID.match(path):
        return
    raise ConfigError(
        f"{key}={path!r}: dataset path does not exist (and is not a hub id or one of {list(BUILTIN_DATASETS)})"
    )


def check_paths(config) -> None:
    """Model and dataset paths that must exist locally do."""
    for key in ("actor", "ref", "critic", "model"):
        sub = getattr(config, key, None)
        if sub is not None and getattr(sub, "path", ""):
            _check_model_path(f"{key}.path", sub.path)
    if getattr(config, "tokenizer_path", ""):
        _check_model_path("tokenizer_path", config.tokenizer_path)
    _check_dataset_path("train_dataset.path", config.train_dataset.path)
    if config.valid_dataset is not None and config.valid_dataset.path:
        _check_dataset_path("valid_dataset.path", config.valid_dataset.path)


def check_resources(config, n_gpus_available: int | None = None) -> None:
    """The allocation fits the cluster described in `cluster.*`."""
    alloc = config.allocation
    n_gpus = config.cluster.n_gpus_per_node * config.cluster.n_nodes
    if n_gpus:
        need = alloc.gen_world_size + alloc.train_world_size
        if need > n_gpus:
            raise ConfigError(
                f"allocation_mode={config.allocation_mode!r} needs {need} GPUs "
                f"({alloc.gen_world_size} for inference + {alloc.train_world_size} for training) "
                f"but cluster has {config.cluster.n_nodes} x {config.cluster.n_gpus_per_node} = {n_gpus}"
            )
        if n_gpus_available is not None and config.cluster.n_gpus_per_node > n_gpus_available:
            raise ConfigError(
                f"cluster.n_gpus_per_node={config.cluster.n_gpus_per_node} but this node has "
                f"{n_gpus_available} GPU(s)"
            )


def load_and_check(argv: list[str]):
    """Parse launcher argv and validate everything that can be validated without starting."""
    script, script_args, cls_path = split_launcher_args(argv)
    config_cls = resolve_config_cls(script_args, cls_path)
    config = load_expr_config(script_args, config_cls)
    check_paths(config)
    return script, script_args, config
