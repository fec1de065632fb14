"""Tensors handed between processes of one machine by handle, not by value.

A trainer and an inference server that share a GPU (`cluster.share_gpus`) need not copy the
weights through disk or NCCL (which refuses two members of a group on one device): the trainer
pickles each tensor as a CUDA IPC handle (torch.multiprocessing's reductions, as SGLang's
/update_weights_from_tensor expects them), the server opens the handle and copies the tensor
into its model on the GPU. On a CPU the same handles name shared-memory files.

The server unpickles what arrives over HTTP, so it accepts only the globals such a payload
holds (torch's rebuild functions, tensor and storage classes, dtypes): anything else is refused
before it runs.
"""

from __future__ import annotations

import base64
import io
import pickle
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing as torch_mp


class RefusedPayload(ValueError):
    """A payload that is not a list of (name, tensor handle) pairs."""


def serialize_named_tensors(named: list[tuple[str, torch.Tensor]]) -> str:
    """base64 of the pickled (name, handle) list. The tensors must stay alive (and unchanged)
    until the receiver has copied them: the handles point at their memory."""
    previous = torch_mp.get_sharing_strategy()
    # CPU tensors: by shared-memory file name, which an unrelated process can open (the
    # default passes file descriptors, which only a child of this process can receive).
    torch_mp.set_sharing_strategy("file_system")
    try:
        buf = io.BytesIO()
        ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump([(n, t.detach()) for n, t in named])
    finally:
        torch_mp.set_sharing_strategy(previous)
    return base64.b64encode(buf.getvalue()).decode("ascii")


_CLASSES = {
    ("torch", "Tensor"),
    ("torch", "Size"),
    ("torch", "device"),
    ("torch", "UntypedStorage"),
    ("torch", "TypedStorage"),
    ("torch.storage", "UntypedStorage"),
    ("torch.storage", "TypedStorage"),
}


class _HandleUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == "torch.multiprocessing.reductions" and name.startswith("rebuild_"):
            return super().find_class(module, name)
        raise RefusedPayload(
            f"refused global {module}.{name}: only torch tensor handles are accepted"
        )


def deserialize_named_tensors(payload: str) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) list of `serialize_named_tensors`, the tensors viewing the sender's
    memory; RefusedPayload naming what is wrong with anything else."""
    try:
        raw = base64.b64decode(payload, validate=True)
    except (ValueError, TypeError) as e:
        raise RefusedPayload(f"not base64: {e}") from None
    try:
        named = _HandleUnpickler(io.BytesIO(raw)).load()
    except RefusedPayload:
        raise
    except Exception as e:  # a truncated pickle, a handle that no longer exists, ...
        raise RefusedPayload(f"cannot open the tensor handles: {type(e).__name__}: {e}") from None
    ok = isinstance(named, list) and all(
        isinstance(p, tuple)
        and len(p) == 2
        and isinstance(p[0], str)
        and isinstance(p[1], torch.Tensor)
        for p in named
    )
    if not ok:
        raise RefusedPayload("expected a list of (name, tensor) pairs")
    return named
