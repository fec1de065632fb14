"""The `clevr_count_70k` task: vision counting (CLEVR-Count-70k) for RL and SFT; its reward is
`clevr_count_reward_fn` (the last bracketed number), held out: the source's own splits.

Source rows (HF `BUAADreamer/clevr_count_70k`, or a local copy) have `images` (list of images),
`problem` ("<image>How many items are there in the image?") and `answer` ("3"). A local copy may
be a `.jsonl` / `.parquet` file, a directory holding `{split}.jsonl` / `{split}.parquet` /
`data/{split}-*.parquet`, or a `save_to_disk` directory; an image may be a path (relative to the
file), a base64 string, a data URL, or HF's `{"bytes", "path"}` struct.

Rows are checked eagerly (cheap column scans, no image decoding) so a broken row fails at load,
naming its index and field; the per-row work (decode, resize, tokenize) runs lazily in a
`with_transform`, so 70k images are never re-encoded up front.

Offline: the `synthetic_counting` task (synthetic_counting.py) draws a directory this loader
reads, so the whole vision path runs without a hub.
"""

from __future__ import annotations

import glob
import os
import re
from typing import Any

from PIL import Image

from arealite.tasks.arith import ExactMatchReward
from arealite.utils.vision import decode_image

HF_DATASET_ID = "BUAADreamer/clevr_count_70k"
OPTIONS = ("source",)
IMAGE_TAG = "<image>"  # how source problems mark where an image goes
SYSTEM_PROMPT = (
    "Count the number of items in the image and give the final answer in [ ] format, "
    "with only the number inside the brackets, e.g. [3]."
)
QWEN_IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
REQUIRED_FIELDS = ("images", "problem", "answer")

_INT = re.compile(r"-?\d+")


class DatasetRowError(ValueError):
    """A source row is unusable; the message names the row index and the field."""


def format_answer(answer: str) -> str:
    """The completion format the system prompt asks for (and SFT teaches): "[3]"."""
    return f"[{answer}]"


# ----------------------------------------------------------------------------- loading


def load_clevr_count_70k(path: str, split: str = "train"):
    """Raw validated rows (columns `images`, `problem`, `answer`) of a hub id or a local copy."""
    ds = _load_raw(path, split)
    if "images" not in ds.column_names and "image" in ds.column_names:
        ds = ds.map(lambda r: {"images": [r["image"]]}, remove_columns=["image"])
    _validate(ds, source=f"{path} [{split}]")
    return ds


def _load_raw(path: str, split: str):
    import datasets

    if os.path.isfile(path):
        return _load_files([path])
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, "dataset_dict.json")):
            return datasets.load_from_disk(path)[split]
        if os.path.exists(os.path.join(path, "state.json")):
            return datasets.load_from_disk(path)
        for pattern in (f"{split}.jsonl", f"{split}.json", f"{split}.parquet", f"data/{split}-*"):
            files = sorted(glob.glob(os.path.join(path, pattern)))
            if files:
                return _load_files(files)
        raise FileNotFoundError(
            f"{path}: no '{split}' split found (looked for {split}.jsonl, {split}.json, "
            f"{split}.parquet, data/{split}-*, or a save_to_disk directory)"
        )
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        raise FileNotFoundError(
            f"{path}: not a local file or directory, and HF_HUB_OFFLINE=1 forbids the hub; "
            "write an offline copy with arealite.tasks.synthetic_counting"
            ".write_synthetic_counting_dataset(dir, n, seed)"
        )
    return datasets.load_dataset(path, split=split)


def _load_files(files: list[str]):
    """jsonl/json/parquet files -> Dataset, remembering the directory relative image paths use."""
    import datasets

    kind = "parquet" if files[0].endswith(".parquet") else "json"
    ds = datasets.load_dataset(kind, data_files=files, split="train")
    base = os.path.dirname(os.path.abspath(files[0]))
    return ds.add_column("_base_dir", [base] * len(ds))


def _validate(ds, source: str) -> None:
    """Fail on the first row with a missing or unusable field, naming index and field."""
    import pyarrow as pa
    import pyarrow.compute as pc

    for field in REQUIRED_FIELDS:
        if field not in ds.column_names:
            raise DatasetRowError(
                f"{source}: row 0: missing field '{field}' (columns: {ds.column_names})"
            )
    # Arrow columns, not rows: no image is decoded.
    table = ds.select_columns(list(REQUIRED_FIELDS)).with_format("arrow")[:]
    images = table.column("images")
    if not (pa.types.is_list(images.type) or pa.types.is_large_list(images.type)):
        raise DatasetRowError(
            f"{source}: row 0: field 'images' must be a list of images, got {images.type}"
        )
    n_images = pc.fill_null(pc.list_value_length(images), 0).to_pylist()
    problems = table.column("problem").to_pylist()
    answers = table.column("answer").to_pylist()
    for i, (k, problem, answer) in enumerate(zip(n_images, problems, answers)):
        if k == 0:
            raise DatasetRowError(f"{source}: row {i}: missing field 'images' (no image)")
        if not isinstance(problem, str) or not problem.strip():
            raise DatasetRowError(f"{source}: row {i}: missing field 'problem'")
        tags = problem.count(IMAGE_TAG)
        if tags not in (0, k):
            raise DatasetRowError(
                f"{source}: row {i}: field 'problem' has {tags} {IMAGE_TAG} tags for {k} images"
            )
        if answer is None or not _INT.search(str(answer)):
            raise DatasetRowError(
                f"{source}: row {i}: field 'answer' must hold an integer count, got {answer!r}"
            )


# ----------------------------------------------------------------------------- images


def fit_image(image: Image.Image, max_size: int = 336, factor: int = 1) -> Image.Image:
    """RGB image with both sides <= max_size (never upscaled), snapped down to multiples of `factor`.

    With factor = patch_size * merge_size (28 for Qwen2-VL) the processor's own smart_resize is a
    no-op for such images, so client, trainer and server (SGLang resizes on its own) all see the
    same pixels whatever resize backend each uses.
    """
    image = image.convert("RGB")
    w, h = image.size
    scale = min(1.0, max_size / max(w, h))
    nw, nh = max(1, round(w * scale)), max(1, round(h * scale))
    if factor > 1:
        nw, nh = max(factor, nw // factor * factor), max(factor, nh // factor * factor)
    if (nw, nh) != (w, h):
        image = image.resize((nw, nh), Image.Resampling.BICUBIC)
    return image


def _image_factor(processor) -> int:
    ip = getattr(processor, "image_processor", None)
    patch, merge = getattr(ip, "patch_size", None), getattr(ip, "merge_size", None)
    return int(patch * merge) if patch and merge else 1


def image_placeholder(processor) -> str:
    """What one image becomes in a prompt before the processor expands it (model family specific)."""
    if processor is None:
        return QWEN_IMAGE_PLACEHOLDER
    tok = processor.tokenizer
    if tok.convert_tokens_to_ids("<|vision_start|>") not in (None, tok.unk_token_id):
        return QWEN_IMAGE_PLACEHOLDER
    return getattr(processor, "image_token", IMAGE_TAG)


# ----------------------------------------------------------------------------- rows


def _messages(problem: str, n_images: int, placeholder: str) -> list[dict]:
    if IMAGE_TAG not in problem:
        problem = IMAGE_TAG * n_images + problem
    content = problem.replace(IMAGE_TAG, placeholder)
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": content}]


def _row_images(batch: dict, i: int, max_image_size: int, factor: int) -> list[Image.Image]:
    base = batch["_base_dir"][i] if "_base_dir" in batch else None
    return [fit_image(decode_image(x, base), max_image_size, factor) for x in batch["images"][i]]


def _answer(value: Any) -> str:
    return _INT.findall(str(value))[-1]


def _shard(ds, rank: int, world_size: int):
    from datasets.distributed import split_dataset_by_node

    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
    return split_dataset_by_node(ds, rank=rank, world_size=world_size) if world_size > 1 else ds


def get_clevr_count_70k_rl_dataset(
    path: str, split: str, processor, rank: int = 0, world_size: int = 1, max_image_size: int = 336
):
    """Rows {"messages", "images": [PIL.Image], "answer": "3"} for a vision RLVR workflow.

    The user message holds one unexpanded placeholder per image; the workflow turns a row into
    model inputs with `processor(text=apply_chat_template(messages), images=images)`.
    """
    ds = _shard(load_clevr_count_70k(path, split), rank, world_size)
    placeholder, factor = image_placeholder(processor), _image_factor(processor)

    def transform(batch: dict) -> dict:
        out = {"messages": [], "images": [], "answer": []}
        for i, problem in enumerate(batch["problem"]):
            images = _row_images(batch, i, max_image_size, factor)
            out["messages"].append(_messages(problem, len(images), placeholder))
            out["images"].append(images)
            out["answer"].append(_answer(batch["answer"][i]))
        return out

    return ds.with_transform(transform)


def get_clevr_count_70k_sft_dataset(
    path: str, split: str, processor, rank: int = 0, world_size: int = 1, max_image_size: int = 336
):
    """Rows {"input_ids", "loss_mask", "pixel_values", "image_grid_thw"} (torch tensors).

    The prompt goes through the processor (which expands each image placeholder to one token per
    merged patch); the completion "[n]<eos>" is tokenized separately and appended, so the loss
    mask boundary is exact.
    """
    import torch

    ds = _shard(load_clevr_count_70k(path, split), rank, world_size)
    placeholder, factor = image_placeholder(processor), _image_factor(processor)
    tok = processor.tokenizer

    def transform(batch: dict) -> dict:
        out = {k: [] for k in ("input_ids", "loss_mask", "pixel_values", "image_grid_thw")}
        for i, problem in enumerate(batch["problem"]):
            images = _row_images(batch, i, max_image_size, factor)
            messages = _messages(problem, len(images), placeholder)
            prompt = processor.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
            enc = processor(text=[prompt], images=images, return_tensors="pt")
            answer = format_answer(_answer(batch["answer"][i])) + tok.eos_token
            completion = tok(answer, add_special_tokens=False, return_tensors="pt")["input_ids"]
            prompt_ids = enc["input_ids"][0]
            out["input_ids"].append(torch.cat([prompt_ids, completion[0]]))
            out["loss_mask"].append(
                torch.cat([torch.zeros_like(prompt_ids), torch.ones_like(completion[0])])
            )
            out["pixel_values"].append(enc["pixel_values"])
            out["image_grid_thw"].append(enc["image_grid_thw"])
        return out

    return ds.with_transform(transform)


def load(split, type, tokenizer, processor, rank=0, world_size=1, source: str | None = None):
    """The task's rows (the registry's loader signature): the hub set, or a local copy."""
    return load_counting(source or HF_DATASET_ID, split, type, processor, rank, world_size)


def load_counting(source: str, split: str, type: str, processor, rank: int, world_size: int):
    """RL or SFT rows of a counting set in this format (`source`: a hub id or local copy)."""
    need_processor(processor)
    if type == "rl":
        return get_clevr_count_70k_rl_dataset(source, split, processor, rank, world_size)
    return get_clevr_count_70k_sft_dataset(source, split, processor, rank, world_size)


def need_processor(processor) -> None:
    if processor is None:
        raise ValueError("vision dataset needs a processor (load_vlm_processor(path))")


# ----------------------------------------------------------------------------- reward

_BRACKETED = re.compile(r"\[\s*(\d+)\s*\]")
_NUMBER = re.compile(r"\d+")


def extract_count(text: str) -> int | None:
    """The last bracketed number `[n]` if any, else the last number, else None."""
    found = _BRACKETED.findall(text) or _NUMBER.findall(text)
    return int(found[-1]) if found else None


# 1.0 if the extracted count equals row["answer"], else 0.0 (the model writes "... so [4]").
clevr_count_reward_fn = ExactMatchReward(
    "clevr_count_reward_fn", extract_count, False, "has no number"
)
