"""Offline tiny vision-language model: a random Qwen2-VL of about 0.7M parameters plus its processor.

Vision RL/SFT must be testable without a hub, through the same `AutoProcessor` /
`AutoModelForImageTextToText.from_pretrained(path)` calls users make with Qwen2-VL. We write a real
HF directory: tokenizer (the tiny Qwen-pipeline BPE from `tiny_model`, plus Qwen2-VL's vision special
tokens), a PIL-backend image processor capped at 112x112 pixels (so any image becomes at most
4x4 = 16 merged image tokens), a Qwen2-VL chat template, and the random model.

Qwen2-VL (not 2.5-VL) because its vision tower is the simplest (no window attention, no fullatt
block list) and SGLang/vLLM serve it with the same processor contract.

Usage: ``python -m arealite.testing.tiny_vlm OUT_DIR``
"""

from __future__ import annotations

import argparse
import json
import os

from arealite.testing.tiny_model import (
    TextModelSpec,
    build_tiny_tokenizer,
    save_random_model,
)
from arealite.utils.vision import load_vlm_processor

# Qwen2-VL's extra special tokens, in its own order; the processor needs <|image_pad|> and
# <|video_pad|>, the chat template <|vision_start|> / <|vision_end|>.
VISION_SPECIAL_TOKENS = [
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
IMAGE_TOKEN = "<|image_pad|>"
VIDEO_TOKEN = "<|video_pad|>"
# What a prompt holds per image before the processor expands <|image_pad|> to one pad per merged patch.
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"

# Qwen2-VL's template without the default system prompt: string content is copied verbatim (so a
# string may already hold IMAGE_PLACEHOLDER); list content turns {"type": "image"} items into
# IMAGE_PLACEHOLDER and {"type": "text"} items into their text.
VLM_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' or 'image' in item or 'image_url' in item %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif item['type'] == 'video' or 'video' in item %}"
    "{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{% elif 'text' in item %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

PATCH_SIZE = 14
MERGE_SIZE = 2
MIN_PIXELS = 28 * 28
MAX_PIXELS = 112 * 112
# The patch geometry the image processor and the vision tower must agree on.
PATCH_GEOMETRY = dict(patch_size=PATCH_SIZE, temporal_patch_size=2)


def build_tiny_vlm_processor(out_dir: str, vocab_size: int = 1024, max_pixels: int = MAX_PIXELS):
    """Save tokenizer, image processor and chat template in the layout of a Qwen2-VL hub checkpoint.

    Files are written one by one (not `processor.save_pretrained`) because building a
    Qwen2VLProcessor needs torchvision (see `load_vlm_processor`); the result loads with
    `AutoProcessor.from_pretrained` wherever torchvision is installed, and with
    `load_vlm_processor` everywhere.
    """
    from transformers import Qwen2VLImageProcessorPil

    tok = build_tiny_tokenizer(out_dir, vocab_size=vocab_size)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", *VISION_SPECIAL_TOKENS]})
    tok.chat_template = VLM_CHAT_TEMPLATE
    tok.save_pretrained(out_dir)
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=MIN_PIXELS,
        max_pixels=max_pixels,
        merge_size=MERGE_SIZE,
        **PATCH_GEOMETRY,
    )
    image_processor.save_pretrained(out_dir)
    _patch_json(
        out_dir,
        "preprocessor_config.json",
        image_processor_type="Qwen2VLImageProcessor",
        processor_class="Qwen2VLProcessor",
    )
    # Keep our trained pipeline: `qwen2_vl` would otherwise map to Qwen2Tokenizer (docs/design.md pitfall).
    _patch_json(
        out_dir,
        "tokenizer_config.json",
        tokenizer_class="PreTrainedTokenizerFast",
        processor_class="Qwen2VLProcessor",
        chat_template=VLM_CHAT_TEMPLATE,
    )
    with open(os.path.join(out_dir, "chat_template.jinja"), "w") as f:
        f.write(VLM_CHAT_TEMPLATE)
    return load_vlm_processor(out_dir)


def _patch_json(out_dir: str, name: str, **updates) -> None:
    path = os.path.join(out_dir, name)
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(updates)
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)


# The VLM's language model is smaller than the text demo's: vision tests run many forwards.
VLM_TEXT_SIZES = dict(hidden_size=128, num_layers=2, intermediate_size=256)


def _qwen2_vl_config(
    tok, text: TextModelSpec, vision_depth: int, vision_embed_dim: int, vision_heads: int
):
    """A Qwen2VLConfig for tokenizer `tok` (the special token ids come from it)."""
    from transformers import Qwen2VLConfig

    head_dim = text.hidden_size // text.num_heads
    # M-RoPE splits head_dim/2 rotary frequencies over (temporal, height, width); Qwen2-VL uses 1:1.5:1.5.
    t_sec = head_dim // 8
    h_sec = (head_dim // 2 - t_sec) // 2
    mrope_section = [t_sec, h_sec, head_dim // 2 - t_sec - h_sec]
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope_section}
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|video_pad|>")}
    return Qwen2VLConfig(
        text_config=dict(
            **text.qwen2_fields(tok), max_position_embeddings=4096, rope_parameters=rope
        ),
        vision_config=dict(
            depth=vision_depth,
            embed_dim=vision_embed_dim,
            hidden_size=text.hidden_size,
            num_heads=vision_heads,
            mlp_ratio=2,
            spatial_merge_size=MERGE_SIZE,
            **PATCH_GEOMETRY,
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=tok.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tok.convert_tokens_to_ids("<|vision_end|>"),
        tie_word_embeddings=False,
    )


def build_tiny_vlm(
    out_dir: str,
    seed: int = 1,
    vision_depth: int = 2,
    vision_embed_dim: int = 64,
    vision_heads: int = 4,
    **sizes: int,
) -> str:
    """Write processor + random Qwen2-VL (about 0.7M parameters by default) into `out_dir`.

    `sizes` are `TextModelSpec` fields of the language model (defaults: `VLM_TEXT_SIZES`).
    """
    from transformers import AutoModelForImageTextToText

    text = TextModelSpec(**{**VLM_TEXT_SIZES, **sizes})
    processor = build_tiny_vlm_processor(out_dir, vocab_size=text.vocab_size)
    config = _qwen2_vl_config(
        processor.tokenizer, text, vision_depth, vision_embed_dim, vision_heads
    )
    return save_random_model(AutoModelForImageTextToText, config, config.text_config, seed, out_dir)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args(argv)
    build_tiny_vlm(a.out_dir, seed=a.seed)
    print(f"tiny VLM written to {a.out_dir}")


if __name__ == "__main__":
    main()
