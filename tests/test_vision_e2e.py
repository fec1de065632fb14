"""Vision RL end to end on the tiny Qwen2-VL and the synthetic counting set: the embedded server
with images, VisionRLVRWorkflow through the remote engine, the trainer reproducing the server's
logprobs, a disk weight update reaching the server; then SFT and GRPO through the local launcher
(examples/clevr_count_70k_{sft,grpo}.py), 2 steps each."""

from __future__ import annotations

import os

import pytest

from arealite.api.cli_args import InferenceEngineConfig
from arealite.api.io_struct import GenerationHyperparameters, WeightUpdateMeta
from arealite.dataset import get_custom_dataset
from arealite.engine.sglang_remote import RemoteSGLangEngine
from arealite.reward.clevr_count import clevr_count_reward_fn
from arealite.server.process import launch_server
from arealite.utils.data import non_tensor_list
from arealite.utils.tiny_vlm import load_vlm_processor
from arealite.utils.vision import MM_KEY
from arealite.workflow.vision_rlvr import VisionRLVRWorkflow

pytestmark = pytest.mark.integration

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(REPO, "examples")
SAMPLES = 3


@pytest.fixture(scope="module")
def server(tiny_vlm_dir):
    s = launch_server(tiny_vlm_dir, dtype="float32", extra_args=["--num-threads", "1"])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def rollout(server):
    e = RemoteSGLangEngine(
        InferenceEngineConfig(consumer_batch_size=2, max_head_offpolicyness=10**6)
    )
    e.initialize([server.address])
    yield e
    e.destroy()


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


def episodes(rollout, processor, rows, max_new_tokens=6):
    g = GenerationHyperparameters(n_samples=SAMPLES, max_new_tokens=max_new_tokens)
    wf = VisionRLVRWorkflow(clevr_count_reward_fn, g, processor, reward_workers=1)
    try:
        return rollout.rollout_batch(rows, wf)
    finally:
        wf.close()


def behaviour_gap(actor, batch) -> float:
    """Largest |server logprob - trainer logprob| over generated tokens."""
    lp = actor.compute_logprobs(batch)
    mask = batch["loss_mask"].bool()
    return (lp - batch["logprobs"]).abs()[mask].max().item()


def test_episodes_carry_images_and_trainer_matches_server_logprobs(rollout, processor, rows, actor):
    batch = episodes(rollout, processor, rows)
    assert batch.batch_size[0] == 2 * SAMPLES
    items = non_tensor_list(batch, MM_KEY)
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for i, mm in enumerate(items):
        n_pads = int((batch["input_ids"][i] == pad).sum())
        assert n_pads == int(mm["image_grid_thw"].prod(-1).sum()) // 4 > 0
    assert set(batch["rewards"].tolist()) <= {0.0, 1.0}
    assert behaviour_gap(actor, batch) < 1e-3


def test_disk_weight_update_reaches_the_server(rollout, processor, rows, actor, tmp_path):
    """Train one step, push through an HF checkpoint on disk: the server then samples with the
    trained weights (its logprobs equal the trainer's again, and differ from the old ones)."""
    from arealite.engine.sft.lm_engine import sft_loss_fn, sft_loss_weight

    batch = episodes(rollout, processor, rows)
    before = actor.compute_logprobs(batch)
    for _ in range(3):
        actor.train_batch(batch, sft_loss_fn, sft_loss_weight)
    after = actor.compute_logprobs(batch)
    mask = batch["loss_mask"].bool()
    assert (after - before).abs()[mask].max().item() > 1e-2
    meta = WeightUpdateMeta.from_disk(str(tmp_path / "weights"), version=1)
    actor.upload_weights(meta)
    rollout.pause()
    rollout.update_weights(meta).result()
    rollout.set_version(1)
    rollout.resume()
    new = episodes(rollout, processor, rows)
    assert set(new["versions"][new["loss_mask"].bool()].tolist()) == {1}
    assert behaviour_gap(actor, new) < 1e-3
