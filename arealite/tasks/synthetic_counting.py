"""The `synthetic_counting` task: an offline stand-in for clevr_count_70k. Coloured circles and
squares drawn with Pillow, written once per (size, seed, split) to a directory the CLEVR loader
reads, scored by the same reward (clevr_count_reward_fn). Held out: any split but `train` is
drawn from another seed, so it never repeats a training image.
"""

from __future__ import annotations

import json
import os
import random

from PIL import Image, ImageDraw

from arealite.tasks.clevr_count import IMAGE_TAG, load_counting, need_processor
from arealite.utils.vision import image_to_base64

OPTIONS = ("size", "seed")
SYNTHETIC_PROBLEM = IMAGE_TAG + "How many objects are there in the image?"


def load(split, type, tokenizer, processor, rank=0, world_size=1, size: int = 256, seed: int = 0):
    """The task's rows (the registry's loader signature)."""
    need_processor(processor)
    source = synthetic_counting_dir(size, seed, split)
    return load_counting(source, split, type, processor, rank, world_size)


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
