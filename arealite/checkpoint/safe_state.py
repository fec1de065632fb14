"""Checkpoint state that is safe to load: tagged JSON for small state, pickle-free DCP metadata.

Recover checkpoints and the trainer's DCP checkpoints must never run code when read back: our own
state (dataloader positions, timers, RNG states) is JSON whose tensors, arrays and tuples are tagged
so they come back as the same types, and DCP's `.metadata` pickle is read by an unpickler that
admits only DCP's own metadata classes (`safe_dcp_reader`).
"""

from __future__ import annotations

import io
import json
import os
import pickle
from typing import Any

import numpy as np
import torch

# ----------------------------------------------------------------------------- JSON state


def to_json(obj: Any) -> Any:
    """JSON form of a state dict that `from_json` turns back into the same types: tensors,
    numpy arrays and tuples are tagged (RNG states are tuples of arrays)."""
    if isinstance(obj, torch.Tensor):
        return {"__tensor__": obj.tolist(), "dtype": str(obj.dtype).removeprefix("torch.")}
    if isinstance(obj, np.ndarray):
        return {"__ndarray__": obj.tolist(), "dtype": str(obj.dtype)}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        return {str(k): to_json(v) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return {"__tuple__": [to_json(v) for v in obj]}
    if isinstance(obj, list):
        return [to_json(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot store a {type(obj).__name__} in a JSON recover state: {obj!r:.80}")


def from_json(obj: Any) -> Any:
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return torch.tensor(obj["__tensor__"], dtype=getattr(torch, obj["dtype"]))
        if "__ndarray__" in obj:
            return np.array(obj["__ndarray__"], dtype=np.dtype(obj["dtype"]))
        if "__tuple__" in obj:
            return tuple(from_json(v) for v in obj["__tuple__"])
        return {k: from_json(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [from_json(v) for v in obj]
    return obj


def write_json(path: str, state: Any) -> None:
    """Write, flush and fsync: the file is complete on disk before it can be swapped in."""
    with open(path, "w") as f:
        json.dump(to_json(state), f)
        f.flush()
        os.fsync(f.fileno())


def read_json(path: str) -> Any:
    with open(path) as f:
        return from_json(json.load(f))


# ----------------------------------------------------------------------------- pickle-free DCP

_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_DCP_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "Path"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
}


class _DCPMetadataUnpickler(pickle.Unpickler):
    """Admits DCP's metadata dataclasses, torch dtypes / sizes / layouts and paths: a tampered
    `.metadata` can build those, never call anything else."""

    def find_class(self, module: str, name: str) -> Any:
        if module in _DCP_MODULES and not name.startswith("__"):
            obj = super().find_class(module, name)
            if isinstance(obj, type):
                return obj
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        elif (module, name) in _DCP_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"DCP metadata may not reference {module}.{name}")


def _safe_reader_cls():
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeDCPReader(FileSystemReader):
        """FileSystemReader whose `.metadata` is read without arbitrary unpickling (tensor
        payloads and non-tensor values already load through torch's weights-only loader)."""

        def read_metadata(self, *args: Any, **kwargs: Any):
            path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(path, "rb") as f:
                metadata = _DCPMetadataUnpickler(io.BytesIO(f.read())).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeDCPReader


def safe_dcp_reader(path: str):
    """A DCP storage reader for `dcp.load(state, storage_reader=safe_dcp_reader(path))`."""
    return _safe_reader_cls()(path)
