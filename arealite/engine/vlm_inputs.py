"""Packed forward of a vision-language model (Qwen2-VL family) in the trainer.

A packed micro-batch holds several sequences in one row. For a VLM each sequence needs its own
M-RoPE positions (`get_rope_index` over its image-pad runs), and the row's images are the
sequences' images concatenated in order (the order their pads appear in the row). The model
takes `position_ids` [4, 1, T]: row 0 the plain per-sequence arange (what attention uses to
find sequence boundaries, e.g. flash-attention's packing detection), rows 1-3 the M-RoPE
positions; `use_cache=False` always (a cache disables packed-sequence masking).
Attention: sdpa_varlen / sdpa / eager get the text engine's kwargs (varlen boundaries or the
block mask) unchanged; flash_attention_2 finds boundaries from row 0 instead, because the
varlen kwargs would also reach the vision tower, which passes its own.

FSDP: every rank must run the same FSDP units in the same order, so a micro-batch without
images (a text-only or a rank's dummy micro-batch) runs a 1-token dummy image as an extra
packed segment, whose outputs enter the logits times zero (the vision tower then also takes
part in backward on every rank).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from arealite.utils.vision import MM_KEY, concat_mm_inputs, rope_index

VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def vlm_attn_implementation(attn_impl: str) -> str | dict[str, str]:
    """The vision tower attends within each image, non-causally, from its own cu_seqlens; the
    causal per-sequence kernel sdpa_varlen is for the text model only (vision gets sdpa)."""
    if attn_impl == "sdpa_varlen":
        return {"text_config": attn_impl, "vision_config": "sdpa", "": attn_impl}
    return attn_impl


def _dummy_image(model: torch.nn.Module, device: torch.device) -> dict[str, torch.Tensor]:
    """The smallest image: one merged token (grid 1 x merge x merge patches), all zeros."""
    vc = model.config.vision_config
    merge = int(vc.spatial_merge_size)
    dim = int(vc.in_channels) * int(vc.temporal_patch_size) * int(vc.patch_size) ** 2
    return {
        "pixel_values": torch.zeros(merge * merge, dim, device=device),
        "image_grid_thw": torch.tensor([[1, merge, merge]], device=device),
    }


def _with_dummy_segment(mb: dict[str, Any], image_token_id: int) -> dict[str, Any]:
    """mb plus one packed segment holding a single image-pad token."""
    ids = mb["input_ids"]
    cu = mb["cu_seqlens"]
    out = dict(mb)
    out["input_ids"] = torch.cat([ids, ids.new_full((1,), image_token_id)])
    out["position_ids"] = torch.cat([mb["position_ids"], mb["position_ids"].new_zeros(1)])
    out["cu_seqlens"] = torch.cat([cu, cu[-1:] + 1])
    out["max_seqlen"] = max(int(mb["max_seqlen"]), 1)
    return out


def _mrope_positions(model, ids: torch.Tensor, cu: torch.Tensor, items: list) -> torch.Tensor:
    """[3, T]: each segment's own M-RoPE positions, concatenated."""
    bounds = cu.tolist()
    parts = []
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        thw = items[i]["image_grid_thw"] if i < len(items) and items[i] else None
        pos, _ = rope_index(model, ids[start:end], None if thw is None else thw.to(ids.device))
        parts.append(pos)
    return torch.cat(parts, dim=1)


def vlm_forward_mb(
    model: torch.nn.Module,
    mb: dict[str, Any],
    text_inputs: Callable[[dict[str, Any]], dict[str, Any]],
    attn_impl: str,
) -> torch.Tensor:
    """Logits [T, V] of one packed VLM micro-batch; `text_inputs(mb)` gives the text path's
    kwargs (input_ids, position_ids, varlen kwargs or block mask) for the same row."""
    T = int(mb["input_ids"].shape[0])
    items = list(mb.get(MM_KEY) or [])
    mm = concat_mm_inputs(items)
    dummy = mm is None
    if dummy:
        mm = _dummy_image(model, mb["input_ids"].device)
        mb = _with_dummy_segment(mb, model.config.image_token_id)
        items = items + [None] * (len(mb["cu_seqlens"]) - 2 - len(items)) + [mm]
    kw = text_inputs(mb)
    ids, cu = mb["input_ids"], mb["cu_seqlens"]
    mrope = _mrope_positions(model, ids, cu, items)
    kw["position_ids"] = torch.cat([mb["position_ids"][None], mrope])[:, None]  # [4, 1, T]
    if attn_impl == "flash_attention_2":
        for k in VARLEN_KEYS:
            kw.pop(k, None)
    kw["pixel_values"] = mm["pixel_values"].to(ids.device)
    kw["image_grid_thw"] = mm["image_grid_thw"].to(ids.device)
    kw["use_cache"] = False
    logits = model(**kw).logits[0]
    if dummy:  # keep the vision tower in the graph at zero weight
        return logits[:T] + 0.0 * logits[T:].sum()
    return logits


def validate_vlm_batch(config: Any, data: Any) -> None:
    """Every row's image-pad count matches its images (ValueError naming the row): a mismatch
    would otherwise fail inside one rank's forward, with the other ranks left waiting."""
    from arealite.utils.data import non_tensor_list

    n = data.batch_size[0]
    items = non_tensor_list(data, MM_KEY) if MM_KEY in data.keys() else [None] * n
    merge = int(config.vision_config.spatial_merge_size)
    real = data["attention_mask"].bool()
    pads = ((data["input_ids"] == config.image_token_id) & real).sum(1).tolist()
    for i, (item, n_pads) in enumerate(zip(items, pads)):
        thw = torch.zeros(0, 3) if not item else torch.as_tensor(item["image_grid_thw"])
        patches = int(thw.prod(-1).sum())
        if item and int(item["pixel_values"].shape[0]) != patches:
            raise ValueError(
                f"row {i}: {MM_KEY} has {int(item['pixel_values'].shape[0])} pixel_values rows "
                f"but image_grid_thw {thw.tolist()} has {patches} patches"
            )
        if n_pads != patches // merge**2:
            raise ValueError(
                f"row {i}: {n_pads} <|image_pad|> tokens in input_ids, but its images "
                f"(image_grid_thw {thw.tolist()}) need {patches // merge**2}"
            )
