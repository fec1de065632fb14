"""DCP checkpoints of a sharded (FSDP2) model, the recovery format: each rank writes its own
shards, plus the optimizer and LR schedule when asked, and per-rank RNG states and the weight
version as JSON. Written to a sibling directory and swapped in, so a crash mid-save leaves the
previous checkpoint intact. HF checkpoints (export, weight sync) stay in fsdp_engine.py."""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch
from torch import nn

from arealite.checkpoint.safe_state import read_json, safe_dcp_reader, write_json
from arealite.checkpoint.save_load import rng_state, set_rng_state, swap_in, tmp_sibling
from arealite.utils import distributed as du


def _dcp_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    state = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    return state


def save_dcp(
    path: str,
    model: nn.Module,
    version: int,
    optimizer: torch.optim.Optimizer | None = None,
    lr_scheduler: Any = None,
) -> None:
    """Save into `path` (a collective); without optimizer / lr_scheduler, the model only."""
    import torch.distributed.checkpoint as dcp

    staged = tmp_sibling(path, "dcp-tmp")
    if du.is_main():
        shutil.rmtree(staged, ignore_errors=True)
    du.barrier()
    dcp.save(_dcp_state(model, optimizer), checkpoint_id=staged)
    extra = {"rng": rng_state(), "version": version}
    if lr_scheduler is not None:
        extra["lr_scheduler"] = lr_scheduler.state_dict()
    error = None
    try:  # JSON, not a pickle: loading a checkpoint must never run code
        write_json(os.path.join(staged, f"extra_state_rank{du.rank()}.json"), extra)
    except (OSError, TypeError) as e:
        error = e
    du.raise_if_any_rank_failed(error)
    if du.is_main():
        swap_in(staged, path)
    du.barrier()


def load_dcp(
    path: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    lr_scheduler: Any = None,
) -> int:
    """Load `path` into the model (and the optimizer / lr_scheduler unless None), restore this
    rank's RNG states, and return the saved weight version."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    if not os.path.isdir(path):
        raise FileNotFoundError(f"no DCP checkpoint at {path}")
    state = _dcp_state(model, optimizer)
    dcp.load(state, storage_reader=safe_dcp_reader(path))
    set_model_state_dict(model, state["model"])
    if "optim" in state:
        set_optimizer_state_dict(model, optimizer, state["optim"])
    extra_path = os.path.join(path, f"extra_state_rank{du.rank()}.json")
    if not os.path.exists(extra_path):  # resumed with more ranks than saved
        extra_path = os.path.join(path, "extra_state_rank0.json")
    extra = read_json(extra_path)
    set_rng_state(extra["rng"])
    if lr_scheduler is not None and "lr_scheduler" in extra:
        lr_scheduler.load_state_dict(extra["lr_scheduler"])
    return extra["version"]
