"""Vision-language plumbing shared by the server, the workflow and the trainer.

Images cross the wire as base64 PNG (SGLang's `image_data`); Qwen2-VL-style models need
M-RoPE position ids computed per sequence from the expanded `<|image_pad|>` runs; and VLM
checkpoints name their weights differently on disk than in memory (transformers 5 renames
`model.layers.*` to `model.language_model.layers.*`), so weight files must be mapped back.
Everything here is model-family agnostic where the HF API allows (`get_rope_index`,
`revert_weight_conversion`).
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch loads in the functions that use it: the launcher imports this
    import torch

# The per-sequence carrier key in a trajectory TensorDict: one dict per sequence holding
# `pixel_values` [n_patches, C*T*P*P] and `image_grid_thw` [n_images, 3] (empty for text-only).
MM_KEY = "multi_modal_input"


# ----------------------------------------------------------------------------- images


def decode_image(item: Any, base_dir: str | None = None):
    """PIL image from a PIL image, bytes, HF {"bytes","path"} struct, path, data URL or base64."""
    from PIL import Image

    if isinstance(item, Image.Image):
        return item
    if isinstance(item, dict):
        if item.get("bytes"):
            return Image.open(io.BytesIO(item["bytes"]))
        return decode_image(item.get("path"), base_dir)
    if isinstance(item, bytes):
        return Image.open(io.BytesIO(item))
    if not isinstance(item, str) or not item:
        raise ValueError(f"expected an image, path or base64 string, got {type(item).__name__}")
    if item.startswith("data:"):
        item = item.split(",", 1)[-1]
    else:
        path = item if os.path.isabs(item) or base_dir is None else os.path.join(base_dir, item)
        if os.path.exists(path):
            return Image.open(path)
    try:
        return Image.open(io.BytesIO(base64.b64decode(item, validate=True)))
    except (binascii.Error, ValueError, OSError):
        raise ValueError(f"not an existing file nor base64 image data: {item[:60]!r}") from None


def decode_base64_image(item: str):
    """RGB PIL image from raw base64 or a data URL only (a server must not open local paths)."""
    from PIL import Image

    if not isinstance(item, str) or not item:
        raise ValueError(f"expected a base64 string or data URL, got {type(item).__name__}")
    data = item.split(",", 1)[-1] if item.startswith("data:") else item
    try:
        image = Image.open(io.BytesIO(base64.b64decode(data, validate=True)))
        return image.convert("RGB")
    except (binascii.Error, ValueError, OSError):
        raise ValueError(f"not base64 image data: {item[:40]!r}...") from None


def image_to_base64(image, fmt: str = "PNG") -> str:
    """Lossless (PNG) base64 of a PIL image: what the server decodes equals what we trained on."""
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return base64.b64encode(buf.getvalue()).decode("ascii")


# ----------------------------------------------------------------------------- model facts


def is_vlm_config(config: Any) -> bool:
    """A vision-language model config (Qwen2-VL, Qwen2.5-VL, ...) has a vision sub-config."""
    return getattr(config, "vision_config", None) is not None


def checkpoint_to_module_names(model: torch.nn.Module) -> dict[str, str]:
    """{name in a saved HF checkpoint: name in model.state_dict()}; identity for models whose
    checkpoint names are their module names."""
    own = model.state_dict()
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # older transformers: no renaming
        return {k: k for k in own}
    by_id = {id(v): k for k, v in own.items()}
    reverted = revert_weight_conversion(model, dict(own))
    # A name that is already a module name maps to itself (tied weights share one tensor id).
    mapping = {
        disk: disk if disk in own else by_id[id(v)]
        for disk, v in reverted.items()
        if id(v) in by_id
    }
    if len(mapping) != len(reverted):  # a conversion that builds new tensors: cannot map by id
        raise ValueError(f"{type(model).__name__}: checkpoint names are not a plain renaming")
    return mapping


def image_token_ids(config: Any) -> tuple[int | None, int | None]:
    return getattr(config, "image_token_id", None), getattr(config, "video_token_id", None)


def mm_token_type_ids(input_ids: torch.Tensor, config: Any) -> torch.Tensor:
    """0 text / 1 image / 2 video per token (what the processor returns; rebuilt from ids)."""
    import torch

    image_id, video_id = image_token_ids(config)
    out = torch.zeros_like(input_ids)
    if image_id is not None:
        out = out + (input_ids == image_id).long()
    if video_id is not None:
        out = out + 2 * (input_ids == video_id).long()
    return out


def rope_index(
    model: torch.nn.Module, input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None
) -> tuple[torch.Tensor, int]:
    """M-RoPE positions [3, L] of ONE unpadded sequence `input_ids` [L], and its rope delta
    (next position = L + delta). Text-only sequences get arange(L) on all rows, delta 0."""
    inner = model.model if hasattr(model.model, "get_rope_index") else model
    ids = input_ids[None]
    mm = mm_token_type_ids(ids, model.config)
    if image_grid_thw is not None and image_grid_thw.numel() == 0:
        image_grid_thw = None
    pos, delta = inner.get_rope_index(ids, mm, image_grid_thw=image_grid_thw)
    return pos[:, 0], int(delta.flatten()[0])


def image_pad_runs(input_ids: list[int], pad_id: int) -> list[tuple[int, int]]:
    """(start, length) of each maximal run of `pad_id` in `input_ids`."""
    runs: list[tuple[int, int]] = []
    start = None
    for i, t in enumerate(input_ids):
        if t == pad_id and start is None:
            start = i
        elif t != pad_id and start is not None:
            runs.append((start, i - start))
            start = None
    if start is not None:
        runs.append((start, len(input_ids) - start))
    return runs


def empty_mm_input(patch_dim: int = 0) -> dict[str, torch.Tensor]:
    """The carrier value of a text-only sequence."""
    import torch

    return {
        "pixel_values": torch.zeros(0, patch_dim),
        "image_grid_thw": torch.zeros(0, 3, dtype=torch.long),
    }


def concat_mm_inputs(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor] | None:
    """Concatenate per-sequence image inputs in sequence order (the order their pads appear in
    a packed row); None when no sequence has an image."""
    import torch

    pv = [m["pixel_values"] for m in items if m and m["image_grid_thw"].numel()]
    thw = [m["image_grid_thw"] for m in items if m and m["image_grid_thw"].numel()]
    if not thw:
        return None
    return {"pixel_values": torch.cat(pv), "image_grid_thw": torch.cat(thw).long()}


def sft_row_inputs(row: dict[str, Any]) -> dict[str, Any]:
    """The trainer's fields of an SFT row: input_ids and loss_mask, plus the row's images under
    MM_KEY when it has any (rows of a vision SFT set hold pixel_values / image_grid_thw)."""
    import torch

    out = {"input_ids": row["input_ids"], "loss_mask": row["loss_mask"]}
    if row.get("pixel_values") is not None:
        out[MM_KEY] = {
            "pixel_values": row["pixel_values"],
            "image_grid_thw": torch.as_tensor(row["image_grid_thw"]).long(),
        }
    return out


# ----------------------------------------------------------------------------- processors


def load_vlm_processor(path: str):
    """`AutoProcessor.from_pretrained(path)`, with an image-only fallback where torchvision is missing.

    transformers 5 cannot build any Qwen2-VL / Qwen2.5-VL processor without torchvision (the video
    processor is mandatory and torchvision-only), and PyPI's Linux torchvision wheels are CUDA builds
    that do not import beside a `+cpu` torch. Images only need the PIL image processor, so without
    torchvision we build the same processor class with `video_processor=None`: identical
    input_ids / pixel_values / image_grid_thw for images; videos are unsupported there.
    """

    from transformers import AutoProcessor
    from transformers.utils import is_torchvision_available

    if is_torchvision_available():
        return AutoProcessor.from_pretrained(path)
    return _load_image_only_processor(path)


def _load_image_only_processor(path: str):
    import transformers
    from transformers import AutoImageProcessor, AutoTokenizer

    with open(os.path.join(path, "preprocessor_config.json")) as f:
        name = json.load(f).get("processor_class", "Qwen2VLProcessor")
    base = getattr(transformers, name, None)
    if base is None or "video_processor" not in base.get_attributes():
        # Processors without a video processor do not need torchvision: the auto class works.
        return transformers.AutoProcessor.from_pretrained(path)

    class ImageOnlyProcessor(base):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    ImageOnlyProcessor.__name__ = ImageOnlyProcessor.__qualname__ = f"{name}ImageOnly"
    tokenizer = AutoTokenizer.from_pretrained(path)
    template_path = os.path.join(path, "chat_template.jinja")
    chat_template = tokenizer.chat_template
    if os.path.exists(template_path):
        with open(template_path) as f:
            chat_template = f.read()
    return ImageOnlyProcessor(
        image_processor=AutoImageProcessor.from_pretrained(path),
        tokenizer=tokenizer,
        video_processor=None,
        chat_template=chat_template,
    )
