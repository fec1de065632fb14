"""Writing checkpoints so readers never see half a checkpoint.

HF checkpoints are written shard by shard (one safetensors file per gathered bucket, plus the
`model.safetensors.index.json` HF uses for sharded weights) into a temporary sibling directory
that replaces the target only when complete: an inference server reloading from the path sees
the old weights or the new ones, never a mixture.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
from collections.abc import Iterable, Iterator

import numpy as np
import torch
from safetensors.torch import save_file

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")
INDEX_NAME = "model.safetensors.index.json"


def tmp_sibling(path: str, tag: str = "tmp") -> str:
    """A hidden sibling of `path` for staging (deterministic, so every rank agrees on it)."""
    parent, name = os.path.split(os.path.abspath(path))
    return os.path.join(parent, f".{name}.{tag}")


def swap_in(staged: str, path: str) -> None:
    """Make the complete directory `staged` become `path`; an existing `path` is moved aside
    first and then deleted (directories cannot be replaced by a single rename)."""
    path = os.path.abspath(path)
    old = tmp_sibling(path, f"old-{os.getpid()}")
    if os.path.exists(path):
        os.replace(path, old)
    os.replace(staged, path)
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def atomic_dir(path: str) -> Iterator[str]:
    """Yield a fresh staging directory that becomes `path` on success (removed on error)."""
    tmp = tmp_sibling(path, f"tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)  # creates the parent too
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    swap_in(tmp, path)


def shard_name(i: int, n: int) -> str:
    return "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def write_safetensors_shards(
    shards: Iterable[dict[str, torch.Tensor]], n_shards: int, out_dir: str
) -> dict[str, str]:
    """Write each dict of full tensors as one safetensors file (HF shard naming) as it arrives,
    then the index when there is more than one; returns the weight map."""
    weight_map: dict[str, str] = {}
    total = 0
    for i, tensors in enumerate(shards):
        fname = shard_name(i, n_shards)
        tensors = {k: v.contiguous() for k, v in tensors.items()}
        save_file(tensors, os.path.join(out_dir, fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, fname))
        total += sum(v.numel() * v.element_size() for v in tensors.values())
        del tensors  # free this bucket before the next one is gathered
    if n_shards > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        with open(os.path.join(out_dir, INDEX_NAME), "w") as f:
            json.dump(index, f, indent=2)
    return weight_map


def copy_non_weight_files(src_dir: str, out_dir: str) -> None:
    """Copy tokenizer / processor / chat-template files of a model directory (not weights,
    which are written fresh), so the saved directory loads on its own."""
    if not src_dir or not os.path.isdir(src_dir):
        return
    for fname in os.listdir(src_dir):
        src = os.path.join(src_dir, fname)
        if os.path.isfile(src) and not fname.endswith(WEIGHT_SUFFIXES):
            shutil.copy2(src, os.path.join(out_dir, fname))


def load_safetensors_dir(path: str) -> dict[str, torch.Tensor]:
    """All tensors of an HF safetensors checkpoint directory (sharded or not), on CPU."""
    from safetensors.torch import load_file

    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(os.path.join(path, f)))
    return out


def rng_state() -> dict:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
