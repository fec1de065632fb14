"""Offline vision building blocks: tiny Qwen2-VL, M-RoPE packing, CLEVR-count loader, synthetic data."""

from __future__ import annotations

import json
import os
import random
from collections import deque

import numpy as np
import pytest
import torch
from PIL import Image

from arealite.tasks.clevr_count import (
    DatasetRowError,
    fit_image,
    get_clevr_count_70k_rl_dataset,
    get_clevr_count_70k_sft_dataset,
)
from arealite.tasks.synthetic_counting import (
    BACKGROUND,
    draw_counting_image,
    generate_synthetic_counting,
    write_synthetic_counting_dataset,
)
from arealite.testing.tiny_vlm import IMAGE_PLACEHOLDER, build_tiny_vlm
from arealite.utils.vision import load_vlm_processor


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory) -> str:
    return build_tiny_vlm(str(tmp_path_factory.mktemp("tiny_vlm")))


@pytest.fixture(scope="module")
def processor(vlm_dir):
    return load_vlm_processor(vlm_dir)


@pytest.fixture(scope="module")
def model(vlm_dir):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(vlm_dir, attn_implementation="sdpa").eval()


def _random_image(seed: int, h: int, w: int) -> Image.Image:
    rs = np.random.RandomState(seed)
    return Image.fromarray(rs.randint(0, 255, (h, w, 3), dtype=np.uint8))


def _token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """logprob of ids[t+1] under logits[t], for one unbatched sequence."""
    return torch.log_softmax(logits.float(), -1)[:-1].gather(-1, ids[1:, None]).squeeze(-1)


# ----------------------------------------------------------------------------- tiny VLM


def test_tiny_vlm_loads_offline_through_auto_classes(vlm_dir, processor, model):
    from tokenizers import Tokenizer
    from transformers import AutoConfig, AutoTokenizer, Qwen2VLProcessor

    config = AutoConfig.from_pretrained(vlm_dir)
    assert config.model_type == "qwen2_vl"
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration"
    n_params = sum(p.numel() for p in model.parameters())
    assert 3e5 < n_params < 5e6, n_params

    tok = AutoTokenizer.from_pretrained(vlm_dir)
    for name in ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"):
        assert len(tok(name, add_special_tokens=False)["input_ids"]) == 1, name
    assert tok.convert_tokens_to_ids("<|image_pad|>") == config.image_token_id
    assert tok.convert_tokens_to_ids("<|video_pad|>") == config.video_token_id
    assert tok.convert_tokens_to_ids("<|vision_start|>") == config.vision_start_token_id
    # The tokenizer pitfall: the class transformers picks must keep our trained pipeline.
    raw = Tokenizer.from_file(os.path.join(vlm_dir, "tokenizer.json"))
    text = "How many objects? 12 red circles and 3 squares.\nThe answer is [15]."
    assert tok(text, add_special_tokens=False)["input_ids"] == raw.encode(text).ids

    assert isinstance(processor, Qwen2VLProcessor)
    assert processor.tokenizer.convert_tokens_to_ids("<|image_pad|>") == config.image_token_id
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Count."}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert IMAGE_PLACEHOLDER in text and text.endswith("<|im_start|>assistant\n")


def test_auto_processor_where_torchvision_is_installed(vlm_dir):
    from transformers import AutoProcessor
    from transformers.utils import is_torchvision_available

    if not is_torchvision_available():
        pytest.skip("transformers needs torchvision to build any Qwen2-VL AutoProcessor")
    auto = AutoProcessor.from_pretrained(vlm_dir)
    ours = load_vlm_processor(vlm_dir)
    image = _random_image(0, 112, 112)
    a = auto(text=["x " + IMAGE_PLACEHOLDER], images=[image], return_tensors="pt")
    b = ours(text=["x " + IMAGE_PLACEHOLDER], images=[image], return_tensors="pt")
    assert torch.equal(a["input_ids"], b["input_ids"])
    assert torch.equal(a["image_grid_thw"], b["image_grid_thw"])


def test_forward_with_image_uses_the_image(processor, model):
    text = "Look: " + IMAGE_PLACEHOLDER + " How many?"
    enc = processor(text=[text], images=[_random_image(0, 336, 336)], return_tensors="pt")
    # 336x336 is capped at 112x112 -> 8x8 patches -> 16 merged image tokens.
    assert enc["image_grid_thw"].tolist() == [[1, 8, 8]]
    assert enc["pixel_values"].shape == (64, 3 * 2 * 14 * 14)
    image_pos = (enc["input_ids"][0] == model.config.image_token_id).nonzero().flatten()
    assert len(image_pos) == 16

    other = processor(text=[text], images=[_random_image(1, 336, 336)], return_tensors="pt")
    with torch.no_grad():
        a = model(**enc, use_cache=False).logits[0]
        b = model(**other, use_cache=False).logits[0]
    first = int(image_pos[0])
    assert a.shape == (enc["input_ids"].shape[1], len(processor.tokenizer))
    torch.testing.assert_close(a[:first], b[:first])  # causal: text before the image
    assert (a[first:] - b[first:]).abs().max() > 1e-4  # the image reaches later tokens


def _packed_inputs(processor, model):
    """Three sequences (one image / no image / two images of other sizes) packed into one row."""
    samples = [
        ("Count: " + IMAGE_PLACEHOLDER + " how many? [3]", [_random_image(0, 112, 112)]),
        ("plain text only: 12+5=17", []),
        (
            IMAGE_PLACEHOLDER + " and " + IMAGE_PLACEHOLDER + " [4]",
            [_random_image(1, 56, 84), _random_image(2, 300, 200)],
        ),
    ]
    seqs = [processor(text=[t], images=ims or None, return_tensors="pt") for t, ims in samples]
    ids, text_pos, mrope_pos = [], [], []
    for enc in seqs:
        mm = (enc["input_ids"] == model.config.image_token_id).long()
        pos, _ = model.model.get_rope_index(
            enc["input_ids"], mm, image_grid_thw=enc.get("image_grid_thw")
        )
        ids.append(enc["input_ids"][0])
        text_pos.append(torch.arange(enc["input_ids"].shape[1]))
        mrope_pos.append(pos[:, 0])
    with_images = [s for s in seqs if "pixel_values" in s]
    packed = {
        "input_ids": torch.cat(ids)[None],
        "pixel_values": torch.cat([s["pixel_values"] for s in with_images]),
        "image_grid_thw": torch.cat([s["image_grid_thw"] for s in with_images]),
    }
    return seqs, packed, torch.cat(text_pos)[None], torch.cat(mrope_pos, 1)[:, None]


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_packed_row_logprobs_equal_each_sequence_forward(vlm_dir, processor, attn):
    from transformers import AutoModelForImageTextToText

    m = AutoModelForImageTextToText.from_pretrained(vlm_dir, attn_implementation=attn).eval()
    seqs, packed, text_pos, mrope_pos = _packed_inputs(processor, m)
    lens = [s["input_ids"].shape[1] for s in seqs]
    seg = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    n = int(sum(lens))
    allowed = (seg[:, None] == seg[None, :]) & torch.ones(n, n, dtype=torch.bool).tril()
    float_mask = torch.zeros(n, n).masked_fill(~allowed, torch.finfo(torch.float32).min)
    with torch.no_grad():
        ref = [_token_logprobs(m(**s, use_cache=False).logits[0], s["input_ids"][0]) for s in seqs]
        # Recipe 1: 4-row position ids (plain per-sequence positions first), no mask, no cache.
        by_positions = m(
            **packed, position_ids=torch.cat([text_pos[None], mrope_pos]), use_cache=False
        ).logits[0]
        # Recipe 2: 3-row M-RoPE positions plus an additive 4-D block-diagonal mask.
        by_mask = m(
            **packed, position_ids=mrope_pos, attention_mask=float_mask[None, None], use_cache=False
        ).logits[0]
        # Without either the sequences cross-attend: proves the check can fail.
        crossing = m(**packed, position_ids=mrope_pos, use_cache=False).logits[0]
    ids = packed["input_ids"][0]
    for logits, ok in ((by_positions, True), (by_mask, True), (crossing, False)):
        off, worst = 0, 0.0
        for length, r in zip(lens, ref):
            lp = _token_logprobs(logits[off : off + length], ids[off : off + length])
            worst = max(worst, (lp - r).abs().max().item())
            off += length
        assert (worst < 1e-5) == ok, worst


def test_generate_with_images_matches_trainer_recompute(processor, model):
    texts = [
        processor.apply_chat_template(
            [{"role": "user", "content": IMAGE_PLACEHOLDER + "How many?"}],
            tokenize=False,
            add_generation_prompt=True,
        ),
        processor.apply_chat_template(
            [{"role": "user", "content": "Count " + IMAGE_PLACEHOLDER + " items, please."}],
            tokenize=False,
            add_generation_prompt=True,
        ),
    ]
    images = [_random_image(3, 112, 112), _random_image(4, 60, 100)]
    processor.tokenizer.padding_side = "left"
    batch = processor(text=texts, images=images, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(
            **batch,
            max_new_tokens=6,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    prompt_len = batch["input_ids"].shape[1]
    gen = out.sequences[:, prompt_len:]
    gen_lp = torch.stack([torch.log_softmax(x.float(), -1) for x in out.logits], 1)
    gen_lp = gen_lp.gather(-1, gen[..., None]).squeeze(-1)
    for b in range(2):
        single = processor(text=[texts[b]], images=[images[b]], return_tensors="pt")
        ids = torch.cat([single["input_ids"][0], gen[b]])[None]
        with torch.no_grad():
            logits = model(
                input_ids=ids,
                mm_token_type_ids=(ids == model.config.image_token_id).long(),
                pixel_values=single["pixel_values"],
                image_grid_thw=single["image_grid_thw"],
                use_cache=False,
            ).logits[0]
        recomputed = _token_logprobs(logits, ids[0])[-gen.shape[1] :]
        torch.testing.assert_close(recomputed, gen_lp[b], atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------- synthetic data


def _count_components(image: Image.Image) -> int:
    """4-connected components of non-background pixels."""
    fg = (np.asarray(image) != np.array(BACKGROUND)).any(-1)
    seen = np.zeros_like(fg)
    count = 0
    for y0, x0 in zip(*np.nonzero(fg)):
        if seen[y0, x0]:
            continue
        count += 1
        seen[y0, x0] = True
        queue = deque([(y0, x0)])
        while queue:
            y, x = queue.popleft()
            for ny, nx in ((y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)):
                if (
                    0 <= ny < fg.shape[0]
                    and 0 <= nx < fg.shape[1]
                    and fg[ny, nx]
                    and not seen[ny, nx]
                ):
                    seen[ny, nx] = True
                    queue.append((ny, nx))
    return count


def test_synthetic_counting_is_deterministic_and_answers_match_drawings():
    a = generate_synthetic_counting(12, seed=7, max_objects=6)
    b = generate_synthetic_counting(12, seed=7, max_objects=6)
    c = generate_synthetic_counting(12, seed=8, max_objects=6)
    assert [r["answer"] for r in a] == [r["answer"] for r in b]
    assert all(x["images"][0].tobytes() == y["images"][0].tobytes() for x, y in zip(a, b))
    assert any(x["images"][0].tobytes() != y["images"][0].tobytes() for x, y in zip(a, c))
    assert len({r["answer"] for r in a}) > 1
    for row in a:
        assert _count_components(row["images"][0]) == int(row["answer"])


def test_drawn_objects_are_separated():
    image, objects = draw_counting_image(random.Random(0), 9, image_size=112)
    assert len(objects) == 9 and _count_components(image) == 9


def test_fit_image_caps_size_and_snaps_to_patch_grid():
    big = fit_image(_random_image(0, 500, 1000), max_size=336, factor=28)
    assert big.size == (336, 168)
    odd = fit_image(_random_image(0, 301, 250), max_size=336, factor=28)
    assert all(s <= 336 and s % 28 == 0 for s in odd.size)
    small = fit_image(_random_image(0, 50, 60).convert("L"), max_size=336)
    assert small.size == (60, 50) and small.mode == "RGB"


# ----------------------------------------------------------------------------- loaders


@pytest.fixture(scope="module")
def synth_dir(tmp_path_factory) -> str:
    d = str(tmp_path_factory.mktemp("clevr_count_70k_synth"))
    write_synthetic_counting_dataset(d, 10, seed=0)
    write_synthetic_counting_dataset(d, 4, seed=1, split="test", embed_images=True)
    return d


def test_rl_rows(synth_dir, processor):
    ds = get_clevr_count_70k_rl_dataset(synth_dir, "train", processor, rank=0, world_size=1)
    expected = [json.loads(line)["answer"] for line in open(os.path.join(synth_dir, "train.jsonl"))]
    assert len(ds) == 10
    for i, row in enumerate(ds):
        assert set(row) == {"messages", "images", "answer"}
        assert row["answer"] == expected[i]
        assert [m["role"] for m in row["messages"]] == ["system", "user"]
        assert row["messages"][1]["content"].count(IMAGE_PLACEHOLDER) == len(row["images"]) == 1
        assert isinstance(row["images"][0], Image.Image) and max(row["images"][0].size) <= 336
        assert _count_components(row["images"][0]) == int(row["answer"])
    # The row feeds the processor directly.
    text = processor.apply_chat_template(
        ds[0]["messages"], tokenize=False, add_generation_prompt=True
    )
    enc = processor(text=[text], images=ds[0]["images"], return_tensors="pt")
    assert (enc["input_ids"] == processor.image_token_id).sum() == 16


def test_rl_rows_are_sharded_by_rank(synth_dir, processor):
    shards = [get_clevr_count_70k_rl_dataset(synth_dir, "train", processor, r, 3) for r in range(3)]
    assert sum(len(s) for s in shards) == 10
    whole = get_clevr_count_70k_rl_dataset(synth_dir, "train", processor, 0, 1)
    assert [r["answer"] for s in shards for r in s] == [r["answer"] for r in whole]


def test_sft_rows(synth_dir, processor, model):
    ds = get_clevr_count_70k_sft_dataset(synth_dir, "test", processor, rank=0, world_size=1)
    assert len(ds) == 4  # base64-embedded images
    row = ds[0]
    assert set(row) == {"input_ids", "loss_mask", "pixel_values", "image_grid_thw"}
    ids, mask = row["input_ids"], row["loss_mask"]
    assert ids.shape == mask.shape and ids.dtype == torch.long
    tok = processor.tokenizer
    answer = json.loads(open(os.path.join(synth_dir, "test.jsonl")).readline())["answer"]
    assert tok.decode(ids[mask.bool()]) == f"[{answer}]{tok.eos_token}"
    assert not mask[: int((ids == processor.image_token_id).nonzero().max()) + 1].any()
    assert row["image_grid_thw"].tolist() == [[1, 8, 8]]
    with torch.no_grad():
        out = model(
            input_ids=ids[None],
            mm_token_type_ids=(ids[None] == model.config.image_token_id).long(),
            pixel_values=row["pixel_values"],
            image_grid_thw=row["image_grid_thw"],
            use_cache=False,
        )
    assert torch.isfinite(out.logits).all()


def test_parquet_with_hf_image_structs(tmp_path, processor):
    import datasets

    rows = generate_synthetic_counting(3, seed=5)
    ds = datasets.Dataset.from_list(
        rows,
        features=datasets.Features(
            {
                "images": datasets.List(datasets.Image()),
                "problem": datasets.Value("string"),
                "answer": datasets.Value("string"),
            }
        ),
    )
    os.makedirs(tmp_path / "data")
    ds.to_parquet(str(tmp_path / "data" / "train-00000-of-00001.parquet"))
    rl = get_clevr_count_70k_rl_dataset(str(tmp_path), "train", processor)
    assert [r["answer"] for r in rl] == [r["answer"] for r in rows]
    assert rl[0]["images"][0].tobytes() == rows[0]["images"][0].tobytes()


def _write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


@pytest.mark.parametrize(
    "broken, field",
    [
        ({"answer": None}, "answer"),
        ({"answer": "many"}, "answer"),
        ({"images": []}, "images"),
        ({"problem": ""}, "problem"),
        ({"problem": "<image><image>How many?"}, "problem"),
    ],
)
def test_bad_row_names_index_and_field(tmp_path, processor, broken, field):
    write_synthetic_counting_dataset(str(tmp_path), 4, seed=0)
    rows = [json.loads(line) for line in open(tmp_path / "train.jsonl")]
    rows[2].update(broken)
    if broken.get("answer", "") is None:
        del rows[2]["answer"]
    _write_jsonl(tmp_path / "train.jsonl", rows)
    with pytest.raises(DatasetRowError, match=rf"row 2: .*'{field}'"):
        get_clevr_count_70k_rl_dataset(str(tmp_path), "train", processor)


def test_missing_column_and_missing_source_are_clear(tmp_path, processor):
    _write_jsonl(tmp_path / "train.jsonl", [{"images": ["x.png"], "problem": "How many?"}])
    with pytest.raises(DatasetRowError, match=r"row 0: missing field 'answer'"):
        get_clevr_count_70k_sft_dataset(str(tmp_path), "train", processor)
    with pytest.raises(FileNotFoundError, match="no 'test' split"):
        get_clevr_count_70k_rl_dataset(str(tmp_path), "test", processor)
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        with pytest.raises(FileNotFoundError, match="HF_HUB_OFFLINE"):
            get_clevr_count_70k_rl_dataset("BUAADreamer/clevr_count_70k", "train", processor)
