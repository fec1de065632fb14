"""Early batch validation: a malformed batch must fail naming the field before it reaches
FSDP collectives, where it would hang the other ranks or train on garbage."""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict

from arealite.engine.vlm_inputs import validate_vlm_batch
from arealite.utils.vision import is_vlm_config

# Per-token entries produced by the rollout / algorithm side; each must be [B, L].
TOKEN_KEYS = (
    "loss_mask",
    "logprobs",
    "versions",
    "prox_logp",
    "ref_logp",
    "advantages",
    "returns",
    "values",
    "kl_rewards",
)


def validate_batch(data: Any, required: tuple[str, ...] = ()) -> None:
    """Reject malformed batches early, naming the field (a bad batch must not reach FSDP
    collectives, where it would hang the other ranks or train on garbage)."""
    if not isinstance(data, TensorDict):
        raise TypeError(f"a batch must be a TensorDict with batch size [B], got {type(data)}")
    for key in ("input_ids", "attention_mask", *required):
        if key not in data.keys():
            raise KeyError(f"batch has no {key!r} entry (keys: {sorted(data.keys())})")
    ids, mask = data["input_ids"], data["attention_mask"]
    if ids.ndim != 2:
        raise ValueError(f"input_ids must be [B, L], got shape {tuple(ids.shape)}")
    for key in ("attention_mask", *TOKEN_KEYS):
        if key in data.keys() and tuple(data[key].shape[:2]) != tuple(ids.shape):
            raise ValueError(
                f"{key} has shape {tuple(data[key].shape)}, expected [B, L] = {tuple(ids.shape)} "
                "like input_ids"
            )
    if ids.shape[0] == 0:
        return
    m = mask.long()
    if bool(((m != 0) & (m != 1)).any()) or bool((m.diff(dim=1) > 0).any()):
        raise ValueError("attention_mask must be 0/1 and right-padded (ones, then zeros)")
    empty = (m.sum(1) == 0).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"rows {empty[:8]} have no tokens (attention_mask all zero)")
    for key in TOKEN_KEYS:
        if key in data.keys() and data[key].is_floating_point():
            bad = ~torch.isfinite(data[key]) & mask.bool().view(
                *mask.shape, *[1] * (data[key].ndim - 2)
            )
            if bool(bad.any()):
                raise ValueError(f"{key} has non-finite values at {bad.nonzero()[:4].tolist()}")


def validate_model_batch(model_config: Any, data: Any, required: tuple[str, ...] = ()) -> None:
    """`validate_batch`, then the checks that need the model: VLM inputs, and token ids inside
    the vocabulary (an id past it fails on GPU as an opaque device-side assert)."""
    validate_batch(data, required)
    if is_vlm_config(model_config):
        validate_vlm_batch(model_config, data)
    vocab = getattr(model_config, "vocab_size", None)
    ids = data["input_ids"][data["attention_mask"].bool()]
    if vocab and ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(
            f"input_ids has token ids in [{int(ids.min())}, {int(ids.max())}], outside the "
            f"model's vocabulary [0, {vocab})"
        )
