"""LoRA through peft on the tiny model: only adapters train, merged HF export equals the
trainer, the PEFT adapter reloads, DCP recovery restores adapters and optimizer, bad configs."""

from __future__ import annotations

import pytest
import torch
from _torchrun_fsdp import engine_config, make_batch, train_variant
from test_ppo_critic import run_two_gloo_ranks
from transformers import AutoModelForCausalLM

from arealite.api.cli_args import ConfigError, GRPOConfig, OptimizerConfig, load_expr_config
from arealite.api.io_struct import SaveLoadMeta
from arealite.api.lora_config import LoRAConfig
from arealite.engine.lora import count_parameters
from arealite.engine.sft.lm_engine import FSDPLMEngine

pytest.importorskip("peft")


@pytest.fixture
def lora_engine(tiny_model_dir):
    engines = []

    def make(**lora_kw):
        lora = LoRAConfig(rank=4, alpha=8.0, **lora_kw)
        cfg = engine_config(tiny_model_dir, optimizer=OptimizerConfig(lr=1e-2), lora=lora)
        e = FSDPLMEngine(cfg)
        e.initialize(None, None)
        engines.append(e)
        return e

    yield make
    for e in engines:
        e.destroy()


def _hf_logprobs(path, batch):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids, m in zip(batch["input_ids"], batch["attention_mask"]):
            ids = ids[m.bool()][None]
            logp = model(ids).logits.log_softmax(-1)[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]
            out.append(torch.cat([torch.zeros(1), logp]))
    return out


def test_only_adapters_train_and_merged_export_equals_trainer(lora_engine, tmp_path):
    engine = lora_engine()
    trainable, total = count_parameters(engine.model)
    assert 0 < trainable < 0.1 * total
    n_opt = sum(p.numel() for g in engine.optimizer.param_groups for p in g["params"])
    assert n_opt == trainable
    batch = make_batch(n=4, seed=3)
    frozen = {n: p.detach().full_tensor().clone() for n, p in engine.model.named_parameters()
              if not p.requires_grad}  # fmt: skip
    losses = [engine.train_lm(batch)["loss"] for _ in range(4)]
    assert losses[-1] < losses[0], losses
    for n, p in engine.model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p.detach().full_tensor(), frozen[n]), n
    engine.save(SaveLoadMeta(path=str(tmp_path / "hf"), weight_format="hf"))
    trainer = engine.compute_logprobs(batch)
    for i, lp in enumerate(_hf_logprobs(str(tmp_path / "hf"), batch)):
        assert torch.allclose(trainer[i, : len(lp)], lp, atol=1e-4), i


def test_adapter_saves_in_peft_format(lora_engine, tmp_path, tiny_model_dir):
    from peft import PeftModel

    engine = lora_engine()
    batch = make_batch(n=4, seed=4)
    engine.train_lm(batch)
    engine.save_adapter(str(tmp_path / "adapter"))
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    ids = batch["input_ids"][0][batch["attention_mask"][0].bool()][None]
    with torch.no_grad():
        logp = model(ids).logits.log_softmax(-1)[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]
    trainer = engine.compute_logprobs(batch)[0, 1 : ids.shape[1]]
    assert torch.allclose(trainer, logp, atol=1e-4)


def test_recovery_restores_adapters_and_optimizer(lora_engine, tmp_path):
    batch = make_batch(n=4, seed=5)
    a = lora_engine()
    a.train_lm(batch)
    a.save(SaveLoadMeta(path=str(tmp_path / "dcp"), weight_format="dcp", with_optim=True))
    b = lora_engine()
    b.load(SaveLoadMeta(path=str(tmp_path / "dcp"), weight_format="dcp", with_optim=True))
    assert a.train_lm(batch)["loss"] == pytest.approx(b.train_lm(batch)["loss"], abs=1e-6)
    assert torch.allclose(a.compute_logprobs(batch), b.compute_logprobs(batch), atol=1e-6)


def test_bad_lora_configs_fail_clearly(lora_engine, tiny_model_dir):
    base = ["experiment_name=x", "trial_name=y", f"actor.path={tiny_model_dir}"]
    with pytest.raises(ConfigError, match="lora.rank must be >= 1"):
        load_expr_config(base + ["actor.lora.rank=0"], GRPOConfig)
    with pytest.raises(ValueError, match=r"match no module.*q_proj"):
        lora_engine(target_modules=["no_such_proj"])


def test_lora_actor_on_two_gloo_ranks_matches_one_rank(tiny_model_dir, tmp_path):
    """FSDP2 over the PEFT model, uneven row slices per rank: losses, adapters and the frozen
    base equal 1 rank's."""
    two = run_two_gloo_ranks("lora", tiny_model_dir, tmp_path / "lora.pt")
    one_stats, one_weights = train_variant("lora", tiny_model_dir, 48, 2, 0, 1)
    for a, b in zip(one_stats, two["stats"], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5, abs=1e-5)
    assert one_weights.keys() == two["weights"].keys()
    assert any("lora_B" in k for k in one_weights)
    for k, w in one_weights.items():
        torch.testing.assert_close(w, two["weights"][k], atol=1e-5, rtol=0, msg=k)
