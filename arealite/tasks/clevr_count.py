"""CLEVR-Count-70k (vision counting) for RL and SFT, plus an offline synthetic stand-in.

Source rows (HF `BUAADreamer/clevr_count_70k`, or a local copy) have `images` (list of images),
`problem` ("<image>How many items are there in the image?") and `answer` ("3"). A local copy may
be a `.jsonl` / `.parquet` file, a directory holding `{split}.jsonl` / `{split}.parquet` /
`data/{split}-*.parquet`, or a `save_to_disk` directory; an image may be a path (relative to the
file), a base64 string, a data URL, or HF's `{"bytes", "path"}` struct.

Rows are checked eagerly (cheap column scans, no image decoding) so a broken row fails at load,
naming its index and field; the per-row work (decode, resize, tokenize) runs lazily in a
`with_transform`, so 70k images are never re-encoded up front.

Offline: `write_synthetic_counting_dataset(dir, n, seed)` draws coloured circles and squares with
Pillow and writes a directory this loader reads, so the whole vision path runs without a hub.
"""

from __future__ import annotations

import glob
import json
import os
import random
import re
from typing import Any

from PIL import Image, ImageDraw

from arealite.utils.vision import decode_image, image_to_base64

HF_DATASET_ID = "BUAADreamer/clevr_count_70k"
IMAGE_TAG = "<image>"  # how source problems mark where an image goes
SYSTEM_PROMPT = (
    "Count the number of items in the image and give the final answer in [ ] format, "
    "with only the number inside the brackets, e.g. [3]."
)
SYNTHETIC_PROBLEM = IMAGE_TAG + "How many objects are there in the image?"
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
            "write an offline copy with write_synthetic_counting_dataset(dir, n, seed)"
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


# ----------------------------------------------------------------------------- synthetic data

_COLOURS = [
    (220, 40, 40),
    (40, 160, 60),
    (40, 80, 220),
    (230, 180, 20),
    (160, 50, 200),
    (20, 180, 190),
]
BACKGROUND = (235, 235, 235)


def _place_boxes(rng: random.Random, k: int, image_size: int) -> list[tuple[int, int, int, int]]:
    """k axis-aligned boxes at least 4 px apart, by rejection sampling (restarts if crowded)."""
    lo, hi = max(6, image_size // 10), max(8, image_size // 5)
    while True:
        boxes: list[tuple[int, int, int, int]] = []
        for _ in range(200 * k):
            if len(boxes) == k:
                return boxes
            s = rng.randint(lo, hi)
            x, y = rng.randint(2, image_size - s - 2), rng.randint(2, image_size - s - 2)
            box = (x, y, x + s, y + s)
            if all(_apart(box, b, gap=4) for b in boxes):
                boxes.append(box)
        if len(boxes) == k:
            return boxes


def _apart(a, b, gap: int) -> bool:
    return a[2] + gap <= b[0] or b[2] + gap <= a[0] or a[3] + gap <= b[1] or b[3] + gap <= a[1]


def draw_counting_image(
    rng: random.Random, count: int, image_size: int = 112
) -> tuple[Image.Image, list[dict]]:
    """`count` separated circles/squares on a plain canvas; also returns what was drawn."""
    image = Image.new("RGB", (image_size, image_size), BACKGROUND)
    draw = ImageDraw.Draw(image)
    objects = []
    for box in _place_boxes(rng, count, image_size):
        shape, colour = rng.choice(("circle", "square")), rng.choice(_COLOURS)
        (draw.ellipse if shape == "circle" else draw.rectangle)(box, fill=colour)
        objects.append({"shape": shape, "colour": colour, "box": box})
    return image, objects


def generate_synthetic_counting(
    n: int, seed: int, image_size: int = 112, max_objects: int = 6
) -> list[dict]:
    """n rows {"images": [PIL], "problem", "answer": str(count)} with 1..max_objects objects each."""
    if max_objects < 1 or max_objects > (image_size // 20) ** 2:
        raise ValueError(f"max_objects={max_objects} does not fit a {image_size}px canvas")
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        count = rng.randint(1, max_objects)
        image, _ = draw_counting_image(rng, count, image_size)
        rows.append({"images": [image], "problem": SYNTHETIC_PROBLEM, "answer": str(count)})
    return rows


def write_synthetic_counting_dataset(
    out_dir: str,
    n: int,
    seed: int,
    split: str = "train",
    image_size: int = 112,
    max_objects: int = 6,
    embed_images: bool = False,
) -> str:
    """Write `{out_dir}/{split}.jsonl` (+ PNGs under images/, or base64 inline) for the loader."""
    os.makedirs(out_dir, exist_ok=True)
    rows = generate_synthetic_counting(n, seed, image_size=image_size, max_objects=max_objects)
    with open(os.path.join(out_dir, f"{split}.jsonl"), "w") as f:
        for i, row in enumerate(rows):
            refs = []
            for j, image in enumerate(row["images"]):
                if embed_images:
                    refs.append(image_to_base64(image))
                    continue
                rel = os.path.join("images", f"{split}_{i}_{j}.png")
                os.makedirs(os.path.join(out_dir, "images"), exist_ok=True)
                image.save(os.path.join(out_dir, rel))
                refs.append(rel)
            f.write(json.dumps({**row, "images": refs}) + "\n")
    return out_dir


def synthetic_counting_dir(
    size: int, seed: int, split: str = "train", root: str | None = None
) -> str:
    """A directory holding the synthetic counting set (images inline as base64), written once
    per (size, seed, split) under `root` (default: the system temp dir) and reused; every rank
    and run derives the same rows, so concurrent writers race harmlessly (atomic rename).
    Held-out splits use another seed, so they never repeat training rows."""
    import shutil
    import tempfile

    split_seed = seed if split == "train" else seed + 1_000_003
    root = root or os.path.join(tempfile.gettempdir(), "arealite_datasets")
    path = os.path.join(root, f"clevr_count_70k_synth_n{size}_s{split_seed}_{split}")
    if os.path.exists(os.path.join(path, f"{split}.jsonl")):
        return path
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=root)
    write_synthetic_counting_dataset(tmp, size, split_seed, split=split, embed_images=True)
    try:
        os.rename(tmp, path)
    except OSError:  # another process finished first: its copy is identical
        shutil.rmtree(tmp, ignore_errors=True)
    return path
