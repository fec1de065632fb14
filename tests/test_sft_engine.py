"""SFT (FSDPLMEngine) on the tiny model."""

from __future__ import annotations

import pytest
from _torchrun_fsdp import engine_config, make_batch

from arealite.api.cli_args import OptimizerConfig
from arealite.engine.sft.lm_engine import FSDPLMEngine


@pytest.fixture
def sft_engine(tiny_model_dir, build_engine):
    def make(max_tokens=48, lr=3e-3):
        cfg = engine_config(tiny_model_dir, max_tokens, optimizer=OptimizerConfig(lr=lr))
        return build_engine(FSDPLMEngine, cfg)

    return make


def test_evaluate_equals_train_loss_before_the_update(sft_engine):
    batch = make_batch(n=6, seed=7)
    engine = sft_engine()
    before = engine.evaluate_lm(batch)
    stats = engine.train_lm(batch)
    assert stats["loss"] == pytest.approx(before, abs=1e-5)
    assert engine.evaluate_lm(batch) < before
    # the loss is the token mean of the NLL over loss_mask tokens (position 0 excluded)
    lp = engine.compute_logprobs(batch)
    mask = batch["loss_mask"].bool() & batch["attention_mask"].bool()
    mask[:, 0] = False
    assert engine.evaluate_lm(batch) == pytest.approx(float(-(lp[mask]).mean()), abs=1e-5)


def test_loss_falls_over_steps(sft_engine):
    batch = make_batch(n=8, seed=1)
    engine = sft_engine(lr=3e-3)
    losses = [engine.train_lm(batch)["loss"] for _ in range(6)]
    engine.step_lr_scheduler()
    assert losses[-1] < losses[0] - 0.5, losses
    assert all(b < a for a, b in zip(losses, losses[1:])), losses


def test_evaluate_does_not_depend_on_the_split(sft_engine):
    batch = make_batch(n=8, seed=2)
    small, large = sft_engine(max_tokens=20), sft_engine(max_tokens=None)
    assert small.evaluate_lm(batch) == pytest.approx(large.evaluate_lm(batch), abs=1e-5)


def test_batch_without_loss_mask_is_rejected(sft_engine):
    engine = sft_engine()
    batch = make_batch(n=2).exclude("loss_mask")
    with pytest.raises(KeyError, match="loss_mask"):
        engine.train_lm(batch)
    with pytest.raises(KeyError, match="loss_mask"):
        engine.evaluate_lm(batch)
    assert engine.evaluate_lm(make_batch(n=2)[:0]) is None
