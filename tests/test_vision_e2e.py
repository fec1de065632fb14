"""Vision RL end to end on the tiny Qwen2-VL and the synthetic counting set: the embedded server
with images, VisionRLVRWorkflow through the remote engine, the trainer reproducing the server's
logprobs, a disk weight update reaching the server; then SFT and GRPO through the local launcher
(examples/clevr_count_70k_{sft,grpo}.py), 2 steps each."""

from __future__ import annotations

import math
import os

import pytest
from _launch import local_launch, read_metrics
from _rollout import rollout_executor

from arealite.api.io_struct import GenerationHyperparameters, WeightUpdateMeta
from arealite.server.process import launch_server
from arealite.tasks import get_custom_dataset
from arealite.tasks.clevr_count import clevr_count_reward_fn
from arealite.utils.data import non_tensor_list
from arealite.utils.vision import MM_KEY, load_vlm_processor
from arealite.workflow.vision_rlvr import VisionRLVRWorkflow

pytestmark = pytest.mark.integration

SAMPLES = 3


@pytest.fixture(scope="module")
def server(tiny_vlm_dir, weight_roots):
    s = launch_server(
        tiny_vlm_dir, dtype="float32", extra_args=["--num-threads", "1", *weight_roots]
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def rollout(server):
    with rollout_executor(
        server.address, consumer_batch_size=2, max_head_offpolicyness=10**6
    ) as executor:
        yield executor


@pytest.fixture(scope="module")
def processor(tiny_vlm_dir):
    return load_vlm_processor(tiny_vlm_dir)


@pytest.fixture(scope="module")
def rows(processor):
    ds = get_custom_dataset("synthetic_counting", type="rl", processor=processor, size=4, seed=5)
    return [ds[i] for i in range(2)]


@pytest.fixture(scope="module")
def actor(tiny_vlm_dir):
    from _torchrun_fsdp import engine_config

    from arealite.engine.fsdp_engine import FSDPEngine

    e = FSDPEngine(engine_config(tiny_vlm_dir, max_tokens=200))
    e.initialize(None, None)
    yield e
    e.destroy()


@pytest.fixture(scope="module")
def workflow(processor):
    g = GenerationHyperparameters(n_samples=SAMPLES, max_new_tokens=6)
    wf = VisionRLVRWorkflow(clevr_count_reward_fn, g, processor, reward_workers=1)
    yield wf
    wf.close()


def behaviour_gap(actor, batch) -> float:
    """Largest |server logprob - trainer logprob| over generated tokens."""
    lp = actor.compute_logprobs(batch)
    mask = batch["loss_mask"].bool()
    return (lp - batch["logprobs"]).abs()[mask].max().item()


def test_episodes_carry_images_and_trainer_matches_server_logprobs(
    rollout, workflow, processor, rows, actor
):
    batch = rollout.rollout_batch(rows, workflow)
    assert batch.batch_size[0] == 2 * SAMPLES
    items = non_tensor_list(batch, MM_KEY)
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for i, mm in enumerate(items):
        n_pads = int((batch["input_ids"][i] == pad).sum())
        assert n_pads == int(mm["image_grid_thw"].prod(-1).sum()) // 4 > 0
    assert set(batch["rewards"].tolist()) <= {0.0, 1.0}
    assert behaviour_gap(actor, batch) < 1e-3


def test_bad_image_request_is_a_400_naming_the_image(server, processor, rows):
    import requests

    from arealite.utils.vision import image_to_base64
    from arealite.workflow.vision_rlvr import vision_prompt

    _, ids, images, _ = vision_prompt(processor, rows[0])
    small = images[0].resize((28, 28))
    url = f"http://{server.address}/generate"
    for image_data, needle in (
        ([image_to_base64(small)], "image_data[0]: its <|image_pad|> run"),
        ([], "0 images for 1 <|image_pad|> runs"),
    ):
        r = requests.post(url, json={"input_ids": ids, "image_data": image_data}, timeout=60)
        assert r.status_code == 400 and needle in r.json()["error"], r.text
    ok = requests.post(
        url,
        json={
            "input_ids": ids,
            "image_data": [image_to_base64(images[0])],
            "sampling_params": {"max_new_tokens": 2},
        },
        timeout=60,
    )
    assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 2
    assert ok.json()["meta_info"]["prompt_tokens"] == len(ids)


def test_disk_weight_update_reaches_the_server(rollout, workflow, rows, actor, tmp_path):
    """Train one step, push through an HF checkpoint on disk: the server then samples with the
    trained weights (its logprobs equal the trainer's again, and differ from the old ones)."""
    from arealite.engine.sft.lm_engine import sft_loss_fn, sft_loss_weight

    batch = rollout.rollout_batch(rows, workflow)
    before = actor.compute_logprobs(batch)
    for _ in range(3):
        actor.train_batch(batch, sft_loss_fn, sft_loss_weight)
    after = actor.compute_logprobs(batch)
    mask = batch["loss_mask"].bool()
    assert (after - before).abs()[mask].max().item() > 1e-2
    meta = WeightUpdateMeta.from_disk(str(tmp_path / "weights"), version=1)
    actor.upload_weights(meta)
    rollout.pause()
    rollout.engine.update_weights(meta).result()
    rollout.set_version(1)
    rollout.resume()
    new = rollout.rollout_batch(rows, workflow)
    assert set(new["versions"][new["loss_mask"].bool()].tolist()) == {1}
    assert behaviour_gap(actor, new) < 1e-3


# --------------------------------------------------------------------------- launcher runs


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory, tiny_vlm_dir):
    root = str(tmp_path_factory.mktemp("vision_sft"))
    local_launch(
        "sft.py",
        "clevr_count_70k_sft.yaml",
        *[
            f"cluster.fileroot={root}",
            "experiment_name=vsft",
            "trial_name=t",
            f"model.path={tiny_vlm_dir}",
            "total_train_steps=2",
            "train_dataset.options.size=16",
            "train_dataset.batch_size=4",
            "valid_dataset.options.size=4",
            "valid_dataset.batch_size=4",
            "evaluator.freq_steps=2",
        ],
    )
    return os.path.join(root, "vsft", "t")


def test_sft_through_the_launcher_trains_and_exports_a_vlm(sft_run, tiny_vlm_dir):
    from transformers import AutoModelForImageTextToText

    records = read_metrics(sft_run)
    assert [r["step"] for r in records] == [0, 1]
    assert all(math.isfinite(r["loss"]) and r["n_seqs"] == 4 for r in records), records
    assert math.isfinite(records[-1]["eval/loss"])
    export = os.path.join(sft_run, "checkpoints", "final", "epoch0globalstep2")
    assert os.path.exists(os.path.join(export, "preprocessor_config.json"))
    trained = AutoModelForImageTextToText.from_pretrained(export).state_dict()
    init = AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir).state_dict()
    assert trained.keys() == init.keys()
    assert max((trained[k] - init[k]).abs().max().item() for k in init) > 1e-4


def test_grpo_through_the_launcher_from_the_sft_export(sft_run, tmp_path):
    export = os.path.join(sft_run, "checkpoints", "final", "epoch0globalstep2")
    local_launch(
        "grpo.py",
        "clevr_count_70k_grpo.yaml",
        *[
            f"cluster.fileroot={tmp_path}",
            "experiment_name=vgrpo",
            "trial_name=t",
            f"actor.path={export}",
            "total_train_steps=2",
            "train_dataset.options.size=16",
            "train_dataset.batch_size=2",
            "gconfig.n_samples=2",
            "gconfig.max_new_tokens=4",
            "valid_dataset.options.size=4",
            "valid_dataset.batch_size=4",
            "evaluator.freq_steps=2",
        ],
    )
    run_dir = os.path.join(tmp_path, "vgrpo", "t")
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [0, 1]
    for r in records:
        assert r["n_seqs"] == 4 and math.isfinite(r["loss"]), r
        assert r["behave_logp_absdiff_max"] < 1e-3, r  # fp32 server and trainer agree
    assert records[0]["staleness_max"] == 0
    assert "eval/accuracy" in records[-1]
    server_log = open(os.path.join(run_dir, "logs", "server0.log")).read()
    assert "weights updated to version 2" in server_log
