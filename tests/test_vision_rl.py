"""Vision RL/SFT pieces on the tiny Qwen2-VL: the embedded server's VLM runner, the image
carrier in batches, VisionRLVRWorkflow, and the FSDP engine's packed VLM forward."""

from __future__ import annotations

import pytest
import torch
from _launch import torchrun

from arealite.server.protocol import BadRequest, parse_generate_request
from arealite.tasks.clevr_count import SYSTEM_PROMPT, fit_image
from arealite.tasks.synthetic_counting import generate_synthetic_counting
from arealite.testing.tiny_vlm import IMAGE_PLACEHOLDER
from arealite.utils.vision import image_to_base64, load_vlm_processor, mm_token_type_ids


@pytest.fixture(scope="module")
def processor(tiny_vlm_dir):
    return load_vlm_processor(tiny_vlm_dir)


@pytest.fixture(scope="module")
def runner(tiny_vlm_dir):
    from arealite.server.vlm_runner import VLMRunner, create_runner

    r = create_runner(tiny_vlm_dir, dtype="float32", device="cpu")
    assert isinstance(r, VLMRunner)
    return r


@pytest.fixture(scope="module")
def image_sets():
    """One image, no image, two images of different sizes (different grids)."""
    imgs = [r["images"][0] for r in generate_synthetic_counting(3, seed=0)]
    return [
        [fit_image(imgs[0], 112, 28)],
        [],
        [fit_image(imgs[1], 56, 28), fit_image(imgs[2], 84, 28)],
    ]


def encode(processor, images, question="How many objects?"):
    content = IMAGE_PLACEHOLDER * len(images) + question
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": content},
    ]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if images:
        return processor(text=[text], images=images, return_tensors="pt")
    return processor.tokenizer([text], return_tensors="pt")


def make_request(runner, input_ids, images, max_new_tokens=6, **extra):
    body = {
        "input_ids": list(input_ids),
        "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True, **extra},
        "return_logprob": True,
        "image_data": [image_to_base64(i) for i in images],
    }
    return parse_generate_request(
        body, vocab_size=runner.vocab_size, max_positions=runner.max_positions, accepts_images=True
    )


def full_forward_logprobs(model, ids: list[int], enc, prompt_len: int) -> list[float]:
    """Reference: one forward of prompt + completion, processor images, no cache."""
    t = torch.tensor(ids)[None]
    kw = {}
    if "pixel_values" in enc:
        kw = dict(pixel_values=enc["pixel_values"], image_grid_thw=enc["image_grid_thw"])
    with torch.no_grad():
        logits = model(
            input_ids=t, mm_token_type_ids=mm_token_type_ids(t, model.config), use_cache=False, **kw
        ).logits[0]
    lp = torch.log_softmax(logits.float(), -1)
    return [lp[prompt_len - 1 + j, tok].item() for j, tok in enumerate(ids[prompt_len:])]


# ----------------------------------------------------------------------------- server runner


def test_vlm_runner_batches_mixed_requests_with_exact_logprobs(runner, processor, image_sets):
    """Rows with 1 / 0 / 2 images; the third joins a running batch mid-decode. Every sampled
    token's logprob equals a full forward's (M-RoPE delta carried through decoding)."""
    encs = [encode(processor, imgs) for imgs in image_sets]
    seqs = [
        runner.new_sequence(make_request(runner, e["input_ids"][0].tolist(), imgs))
        for e, imgs in zip(encs, image_sets)
    ]
    with torch.inference_mode():
        runner.step(seqs[:2])
        runner.step([seqs[2]])
        while runner.num_running:
            runner.step([])
    for s, e in zip(seqs, encs):
        assert len(s.output_ids) == 6
        ref = full_forward_logprobs(
            runner.model, s.req.input_ids + s.output_ids, e, len(s.req.input_ids)
        )
        assert max(abs(a - b) for a, b in zip(ref, s.output_logprobs)) < 1e-4


def test_vlm_runner_expands_a_single_pad_like_sglang(runner, processor, image_sets):
    enc = encode(processor, image_sets[0])
    ids = enc["input_ids"][0].tolist()
    pad = runner.image_token_id
    short = [t for i, t in enumerate(ids) if t != pad or ids[i - 1] != pad]  # one pad per run
    assert short.count(pad) == 1 and ids.count(pad) == 16
    seq = runner.new_sequence(make_request(runner, short, image_sets[0]))
    assert seq.req.input_ids == ids


@pytest.mark.parametrize(
    "case, needle",
    [
        ("no_images", "0 images for 1 <|image_pad|> runs"),
        ("wrong_image", "image_data[0]: its <|image_pad|> run in input_ids has 16 tokens"),
        ("not_base64", "image_data[0]: not base64 image data"),
        ("not_a_list", "image_data: expected a list"),
        ("not_a_string", "image_data[0]: expected a base64 string"),
    ],
)
def test_vlm_runner_rejects_bad_image_requests_naming_the_image(
    runner, processor, image_sets, case, needle
):
    ids = encode(processor, image_sets[0])["input_ids"][0].tolist()
    images = {
        "no_images": [],
        "wrong_image": [image_to_base64(image_sets[2][0])],
        "not_base64": ["not*base64"],
        "not_a_list": {"a": 1},
        "not_a_string": [3],
    }[case]
    body = {"input_ids": ids, "image_data": images}
    with pytest.raises(BadRequest, match=needle.replace("[", r"\[").replace("|", r"\|")):
        req = parse_generate_request(
            body, vocab_size=runner.vocab_size, max_positions=4096, accepts_images=True
        )
        runner.new_sequence(req)


def test_text_server_refuses_image_data():
    with pytest.raises(BadRequest, match="not a vision-language model"):
        parse_generate_request(
            {"input_ids": [1, 2], "image_data": ["aGk="]}, vocab_size=10, max_positions=100
        )
    req = parse_generate_request(
        {"input_ids": [1, 2], "image_data": []}, vocab_size=10, max_positions=100
    )
    assert req.image_data == []


def test_vlm_runner_loads_checkpoint_names_and_module_names(
    runner, tiny_vlm_dir, tiny_vlm_dir_v2, tmp_path
):
    """An HF checkpoint (disk names model.layers.*, visual.*) and a module-named one both load."""
    from safetensors.torch import save_file
    from transformers import AutoModelForImageTextToText

    other = AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir_v2)
    want = {k: v.clone() for k, v in other.state_dict().items()}
    try:
        runner.load_weights_from_disk(tiny_vlm_dir_v2)
        got = runner.model.state_dict()
        assert all(torch.equal(got[k], want[k]) for k in want)
        save_file(
            {
                k: v.contiguous()
                for k, v in AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir)
                .state_dict()
                .items()
            },
            str(tmp_path / "model.safetensors"),
        )
        runner.load_weights_from_disk(str(tmp_path))
        assert not torch.equal(runner.model.state_dict()["lm_head.weight"], want["lm_head.weight"])
    finally:
        runner.load_weights_from_disk(tiny_vlm_dir)


# ----------------------------------------------------------------------------- batches


def vlm_batch(processor, image_sets, answer="[3]"):
    """Padded batch of prompt + answer rows with the per-sequence image carrier."""
    from arealite.utils.data import pad_sequences_to_tensors
    from arealite.utils.vision import MM_KEY, empty_mm_input

    rows, encs = [], []
    for images in image_sets:
        enc = encode(processor, images)
        ans = processor.tokenizer(answer, add_special_tokens=False, return_tensors="pt")
        ids = torch.cat([enc["input_ids"][0], ans["input_ids"][0]])
        n = ans["input_ids"].shape[1]
        mm = empty_mm_input()
        if images:
            mm = {"pixel_values": enc["pixel_values"], "image_grid_thw": enc["image_grid_thw"]}
        rows.append(
            {
                "input_ids": ids,
                "loss_mask": torch.tensor([0] * (len(ids) - n) + [1] * n),
                MM_KEY: mm,
            }
        )
        encs.append({**enc, "input_ids": ids[None]})
    return pad_sequences_to_tensors(rows), encs


def test_image_carrier_survives_split_concat_and_packing(processor, image_sets):
    from arealite.utils.data import (
        concat_padded_tensors,
        non_tensor_list,
        pack_tensor_dict,
        split_padded_tensor_dict,
        split_padded_tensor_dict_into_mb_list,
        unpack_tensor_dict,
    )
    from arealite.utils.vision import MM_KEY

    batch, _ = vlm_batch(processor, image_sets)
    n_images = lambda items: [int(m["image_grid_thw"].shape[0]) for m in items]  # noqa: E731
    assert n_images(non_tensor_list(batch, MM_KEY)) == [1, 0, 2]
    both = concat_padded_tensors([batch, batch[2:3]])
    assert n_images(non_tensor_list(both, MM_KEY)) == [1, 0, 2, 2]
    halves = split_padded_tensor_dict(both, 2)
    assert [n_images(non_tensor_list(h, MM_KEY)) for h in halves] == [[1, 0], [2, 2]]
    mbl = split_padded_tensor_dict_into_mb_list(both, max_tokens_per_mb=120)
    assert len(mbl) > 1
    for group, mb in zip(mbl.group_indices, mbl.mbs):
        packed = pack_tensor_dict(mb)
        assert n_images(packed[MM_KEY]) == [[1, 0, 2, 2][i] for i in group]
        assert MM_KEY not in packed["seq_keys"]
        back = unpack_tensor_dict(packed)
        assert n_images(non_tensor_list(back, MM_KEY)) == n_images(packed[MM_KEY])


# ----------------------------------------------------------------------------- trainer


def vlm_engine(path, max_tokens=None, attn_impl="sdpa_varlen"):
    from _torchrun_fsdp import engine_config

    from arealite.engine.fsdp_engine import FSDPEngine

    engine = FSDPEngine(engine_config(path, max_tokens, attn_impl=attn_impl))
    engine.initialize(None, None)
    return engine


def reference_logprobs(model, encs) -> list[torch.Tensor]:
    out = []
    for e in encs:
        ids = e["input_ids"][0]
        lp = full_forward_logprobs(model, ids.tolist(), e, 1)
        out.append(torch.tensor([0.0, *lp]))
    return out


@pytest.mark.parametrize("attn_impl", ["sdpa_varlen", "sdpa", "eager"])
def test_packed_vlm_logprobs_equal_per_sequence_forward(
    runner, processor, image_sets, tiny_vlm_dir, attn_impl
):
    """1 / 0 / 2 images per sequence, packed whole and split into micro-batches."""
    batch, encs = vlm_batch(processor, image_sets)
    refs = reference_logprobs(runner.model, encs)
    for max_tokens in (None, 120):
        engine = vlm_engine(tiny_vlm_dir, max_tokens, attn_impl)
        try:
            lp = engine.compute_logprobs(batch)
        finally:
            engine.destroy()
        for i, ref in enumerate(refs):
            torch.testing.assert_close(lp[i, : len(ref)], ref, atol=1e-5, rtol=0)
            assert not lp[i, len(ref) :].any()


def test_vlm_training_reaches_the_vision_tower_and_text_only_batches_run(
    processor, image_sets, tiny_vlm_dir
):
    from arealite.engine.sft.lm_engine import sft_loss_fn, sft_loss_weight

    batch, _ = vlm_batch(processor, image_sets)
    engine = vlm_engine(tiny_vlm_dir, max_tokens=120)
    try:

        def visual():
            sd = engine.model.state_dict()
            return {k: v.full_tensor().clone() for k, v in sd.items() if "visual" in k}

        text_only = engine.train_batch(batch[1:2], sft_loss_fn, sft_loss_weight)  # dummy image
        assert text_only["update_successful"] == 1.0
        before = visual()
        stats = engine.train_batch(batch, sft_loss_fn, sft_loss_weight)
        assert stats["update_successful"] == 1.0 and stats["n_mbs"] > 1
        after = visual()
        # Adam moves a parameter with a gradient by ~lr = 1e-3; weight decay alone by ~1e-5.
        assert max((before[k] - after[k]).abs().max().item() for k in before) > 5e-4
    finally:
        engine.destroy()


def vlm_training_batch(model_dir: str):
    """Rows with 1 / 0 / 2 images, then a text-only row (deterministic; used across ranks)."""
    processor = load_vlm_processor(model_dir)
    imgs = [r["images"][0] for r in generate_synthetic_counting(3, seed=0)]
    sets = [
        [fit_image(imgs[0], 112, 28)],
        [],
        [fit_image(imgs[1], 56, 28), fit_image(imgs[2], 84, 28)],
        [],
    ]
    return vlm_batch(processor, sets)[0]


def test_vlm_hf_checkpoint_load_maps_disk_names_and_save_round_trips(
    tiny_vlm_dir, tiny_vlm_dir_v2, tmp_path
):
    from _torchrun_fsdp import full_weights
    from transformers import AutoModelForImageTextToText

    from arealite.api.io_struct import SaveLoadMeta

    engine = vlm_engine(tiny_vlm_dir)
    try:
        engine.load(SaveLoadMeta(path=tiny_vlm_dir_v2, weight_format="hf"))  # disk names
        want = AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir_v2).state_dict()
        got = full_weights(engine)
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want)
        engine.save(SaveLoadMeta(path=str(tmp_path / "hf"), weight_format="hf"))
    finally:
        engine.destroy()
    back = AutoModelForImageTextToText.from_pretrained(str(tmp_path / "hf")).state_dict()
    assert all(torch.equal(back[k], want[k]) for k in want)


@pytest.mark.integration
def test_two_gloo_ranks_with_images_on_one_rank_match_one_rank(tiny_vlm_dir, tmp_path):
    """Rank 1 holds only a text-only row: its micro-batches run the dummy image, so both ranks
    call the same FSDP units; the step equals the 1-rank step on the whole batch."""
    import os

    from _torchrun_fsdp import full_weights

    from arealite.engine.sft.lm_engine import sft_loss_fn, sft_loss_weight

    out = tmp_path / "r.pt"
    script = os.path.join(os.path.dirname(__file__), "_torchrun_vlm.py")
    torchrun(script, 2, "--model", tiny_vlm_dir, "--out", out, timeout=300)
    two = torch.load(out, weights_only=False)
    assert two["world"] == 2
    engine = vlm_engine(tiny_vlm_dir, max_tokens=120)
    try:
        one = engine.train_batch(vlm_training_batch(tiny_vlm_dir), sft_loss_fn, sft_loss_weight)
        weights = full_weights(engine)
    finally:
        engine.destroy()
    assert abs(one["loss"] - two["stats"]["loss"]) < 1e-5
    assert abs(one["grad_norm"] - two["stats"]["grad_norm"]) < 1e-4
    for k in weights:
        torch.testing.assert_close(weights[k], two["weights"][k], atol=1e-5, rtol=0, msg=k)


def test_vlm_runner_never_samples_image_pads(runner, processor, image_sets):
    """Near-uniform sampling over ~650 tokens, 2048 draws: ~6 pads expected without the ban
    (P(none) ~ 0.2%). A sampled pad would break resubmission and training."""
    ids = encode(processor, image_sets[0])["input_ids"][0].tolist()
    seqs = [
        runner.new_sequence(make_request(runner, ids, image_sets[0], 256, temperature=50.0))
        for _ in range(8)
    ]
    with torch.inference_mode():
        runner.step(seqs)
        while runner.num_running:
            runner.step([])
    out = [t for s in seqs for t in s.output_ids]
    assert len(out) == 2048 and len(set(out)) > 400  # really near-uniform
    assert runner.image_token_id not in out and runner.video_token_id not in out


def test_vlm_batch_whose_pads_do_not_match_its_images_is_rejected(
    processor, image_sets, tiny_vlm_dir
):
    from arealite.utils.data import non_tensor_list, stack_non_tensor
    from arealite.utils.vision import MM_KEY

    batch, _ = vlm_batch(processor, image_sets)
    items = non_tensor_list(batch, MM_KEY)
    first = int(items[2]["image_grid_thw"][0].prod())  # keep row 2's first image only
    items[2] = {
        "pixel_values": items[2]["pixel_values"][:first],
        "image_grid_thw": items[2]["image_grid_thw"][:1],
    }
    batch.set(MM_KEY, stack_non_tensor(items))
    engine = vlm_engine(tiny_vlm_dir)
    try:
        with pytest.raises(
            ValueError, match=r"row 2: 13 <\|image_pad\|> tokens in input_ids, but .* need 4"
        ):
            engine.compute_logprobs(batch)
    finally:
        engine.destroy()
