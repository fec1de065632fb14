"""LoRA through peft on the tiny model: only adapters train, merged HF export equals the
trainer, the PEFT adapter reloads, checkpoints hold the adapter (and the merged model on
request), DCP recovery restores adapters and optimizer, a real server serves the merged weights
with the trainer's logprobs, bad configs fail before anything starts, a LoRA GRPO run through
the launcher."""

from __future__ import annotations

import json
import os
import re

import pytest
import requests
import torch
from _launch import local_launch
from _torchrun_fsdp import engine_config, make_batch, server_logprob_gap, train_variant
from tensordict import TensorDict
from test_ppo_critic import run_two_gloo_ranks
from transformers import AutoModelForCausalLM

from arealite.api.cli_args import ConfigError, GRPOConfig, OptimizerConfig, load_expr_config
from arealite.api.io_struct import SaveLoadMeta, WeightUpdateMeta
from arealite.api.lora_config import LoRAConfig
from arealite.engine.lora import count_parameters, optimizer_state_bytes
from arealite.engine.sft.lm_engine import FSDPLMEngine

pytest.importorskip("peft")


@pytest.fixture
def lora_engine(tiny_model_dir, build_engine):
    def make(**lora_kw):
        lora = LoRAConfig(rank=4, alpha=8.0, **lora_kw)
        cfg = engine_config(
            tiny_model_dir, optimizer=OptimizerConfig(lr=1e-2), lora=lora, weight_update_bucket_mb=1
        )
        return build_engine(FSDPLMEngine, cfg)

    return make


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
    assert optimizer_state_bytes(engine.optimizer) == 0  # AdamW allocates at its first step
    batch = make_batch(n=4, seed=3)
    frozen = {
        n: p.detach().full_tensor().clone()
        for n, p in engine.model.named_parameters()
        if not p.requires_grad
    }
    losses = [engine.train_lm(batch)["loss"] for _ in range(4)]
    assert losses[-1] < losses[0], losses
    n_tensors = sum(1 for p in engine.model.parameters() if p.requires_grad)
    # fp32 exp_avg + exp_avg_sq per adapter weight, plus one 4-byte step counter per tensor
    assert optimizer_state_bytes(engine.optimizer) == 8 * trainable + 4 * n_tensors
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


def _adam_state(engine) -> dict[str, torch.Tensor]:
    names = {id(p): n for n, p in engine.model.named_parameters()}
    return {
        f"{names[id(p)]}.{k}": (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
        for p, st in engine.optimizer.state.items()
        for k, v in st.items()
    }


def test_checkpoint_holds_peft_adapter_and_merged_model_on_request(lora_engine, tmp_path):
    """engine.save(hf) (the saver's call): merged model + <path>/adapter in PEFT format by
    default; `save_merged: false` writes the adapter only."""
    from peft import PeftModel

    engine = lora_engine()
    batch = make_batch(n=4, seed=6)
    engine.train_lm(batch)
    engine.save(SaveLoadMeta(path=str(tmp_path / "both"), weight_format="hf"))
    assert {"config.json", "model.safetensors", "adapter"} <= set(os.listdir(tmp_path / "both"))
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(
        os.listdir(tmp_path / "both" / "adapter")
    )
    merged = _hf_logprobs(str(tmp_path / "both"), batch)
    base = AutoModelForCausalLM.from_pretrained(engine.config.path, dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, str(tmp_path / "both" / "adapter")).eval()
    ids = batch["input_ids"][1][batch["attention_mask"][1].bool()][None]
    with torch.no_grad():
        logp = peft(ids).logits.log_softmax(-1)[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]
    assert torch.allclose(merged[1][1:], logp, atol=1e-4)

    only = lora_engine(save_merged=False)
    only.save(SaveLoadMeta(path=str(tmp_path / "adapter_only"), weight_format="hf"))
    assert os.listdir(tmp_path / "adapter_only") == ["adapter"]


def test_recovery_restores_adapters_and_optimizer(lora_engine, tmp_path):
    batch = make_batch(n=4, seed=5)
    a = lora_engine()
    a.train_lm(batch)
    a.save(SaveLoadMeta(path=str(tmp_path / "dcp"), weight_format="dcp", with_optim=True))
    b = lora_engine()
    b.load(SaveLoadMeta(path=str(tmp_path / "dcp"), weight_format="dcp", with_optim=True))
    saved, restored = _adam_state(a), _adam_state(b)
    assert saved.keys() == restored.keys() and any("lora_B" in k for k in saved)
    for k, v in saved.items():
        torch.testing.assert_close(restored[k], v, atol=0, rtol=0, msg=k)
    assert a.train_lm(batch)["loss"] == pytest.approx(b.train_lm(batch)["loss"], abs=1e-6)
    assert torch.allclose(a.compute_logprobs(batch), b.compute_logprobs(batch), atol=1e-6)


def test_bad_lora_configs_fail_clearly(lora_engine, tiny_model_dir):
    base = ["experiment_name=x", "trial_name=y", f"actor.path={tiny_model_dir}"]
    with pytest.raises(ConfigError, match="lora.rank must be >= 1"):
        load_expr_config(base + ["actor.lora.rank=0"], GRPOConfig)
    with pytest.raises(ConfigError, match="lora.target_modules is empty"):
        load_expr_config(base + ["actor.lora.target_modules=[]"], GRPOConfig)
    with pytest.raises(ConfigError, match=r"\['no_such_proj'\] match no module.*q_proj"):
        lora_engine(target_modules=["no_such_proj"])
    with pytest.raises(ConfigError, match=r"\['typo_proj'\] match no module"):
        lora_engine(target_modules=["q_proj", "typo_proj"])  # one bad entry is enough


@pytest.mark.parametrize(
    "override, error",
    [
        ("actor.lora.rank=0", "lora.rank must be >= 1, got 0"),
        (
            "actor.lora.target_modules=[nothing_proj]",
            r"actor.lora.target_modules: \['nothing_proj'\] match no module.*'v_proj'",
        ),
    ],
)
def test_bad_lora_config_stops_the_launcher_before_any_server(
    tiny_model_dir, tmp_path, override, error
):
    """Through the real launcher: the error names the key, and no process was started."""
    where = [f"cluster.fileroot={tmp_path}", f"actor.path={tiny_model_dir}"]
    p = local_launch("grpo.py", "arith_grpo_lora.yaml", *where, override, ok=False, timeout=120)
    assert p.returncode != 0
    assert re.search(error, p.stdout + p.stderr), (p.stdout + p.stderr)[-2000:]
    assert not (tmp_path / "arith-grpo").exists()  # no run dir, logs or servers


@pytest.mark.integration
def test_server_logprobs_after_merged_sync_equal_the_trainer(lora_engine, tmp_path):
    """The embedded server (a real process) reloads the merged weights the LoRA trainer
    uploads; its sampling logprobs then equal the trainer's (they differ before the sync)."""
    from arealite.server.process import launch_server

    engine = lora_engine()
    prompt = make_batch(n=1, seed=9)["input_ids"][0, :6].tolist()
    extra = ["--allowed-weight-roots", str(tmp_path)]
    with launch_server(engine.config.path, dtype="float32", extra_args=extra) as server:
        post = lambda path, body: requests.post(server.url + path, json=body, timeout=300).json()  # noqa: E731

        def max_logprob_gap() -> float:
            return server_logprob_gap(post, engine, prompt)

        for seed in range(3):
            engine.train_lm(make_batch(n=4, seed=seed))
        assert max_logprob_gap() > 1e-2  # the server still has the base weights
        engine.upload_weights(WeightUpdateMeta.from_disk(str(tmp_path / "w"), version=1))
        assert post("/update_weights_from_disk", {"model_path": str(tmp_path / "w")})["success"]
        assert max_logprob_gap() < 1e-4
        with pytest.raises(ValueError, match="LoRA weights sync through disk"):
            engine.upload_weights(WeightUpdateMeta.from_nccl("127.0.0.1", 1, version=2))


@pytest.mark.integration
@pytest.mark.vllm
def test_saved_adapter_loads_into_vllm_with_the_trainers_logprobs(
    lora_engine, tmp_path, monkeypatch
):
    """The PEFT adapter `save_adapter` writes loads into a real vLLM server at runtime
    (`--enable-lora`, POST /v1/load_lora_adapter); sampling with it gives the trainer's
    logprobs, while the base model's differ."""
    from test_vllm_remote import VLLMServer, vllm_unavailable

    why = vllm_unavailable()
    if why:
        pytest.skip(why)
    engine = lora_engine()
    for seed in range(3):
        engine.train_lm(make_batch(n=4, seed=seed))
    engine.save_adapter(str(tmp_path / "adapter"))
    prompt = make_batch(n=1, seed=9)["input_ids"][0, :6].tolist()
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    server = VLLMServer(engine.config.path, ("--enable-lora", "--max-lora-rank", "8"))
    url = f"http://{server.address}"
    try:
        server.wait_healthy(timeout=420)
        load = {"lora_name": "policy", "lora_path": str(tmp_path / "adapter")}
        r = requests.post(f"{url}/v1/load_lora_adapter", json=load, timeout=300)
        assert r.status_code == 200, r.text

        def logprob_gap(model: str) -> float:
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": 8,
                "temperature": 1.0,
                "logprobs": 0,
                "return_tokens_as_token_ids": True,
                "ignore_eos": True,
            }
            r = requests.post(f"{url}/v1/completions", json=body, timeout=300)
            assert r.status_code == 200, r.text
            lp = r.json()["choices"][0]["logprobs"]
            out = [int(t.removeprefix("token_id:")) for t in lp["tokens"]]
            ids = torch.tensor([prompt + out])
            td = TensorDict({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, [1])
            trainer = engine.compute_logprobs(td)[0, len(prompt) :]
            return (trainer - torch.tensor(lp["token_logprobs"])).abs().max().item()

        assert logprob_gap("policy") < 1e-3
        assert logprob_gap(engine.config.path) > 1e-2  # the base weights, no adapter
    finally:
        server.stop()


@pytest.mark.integration
def test_lora_grpo_runs_through_the_launcher(tiny_model_dir, tmp_path):
    """examples/grpo.py + arith_grpo_lora.yaml, 2 steps: the logged trainable share is under
    10% with optimizer state for the adapters only; the final checkpoint holds the merged
    model and the PEFT adapter."""
    local_launch(
        "grpo.py",
        "arith_grpo_lora.yaml",
        f"cluster.fileroot={tmp_path}",
        f"actor.path={tiny_model_dir}",
        "total_train_steps=2",
        "train_dataset.batch_size=4",
        "valid_dataset.options.size=4",
        "evaluator.freq_steps=null",
    )
    run = tmp_path / "arith-grpo" / "lora"
    first = json.loads(open(run / "metrics.jsonl").readline())
    trainable, total = first["actor/trainable_params"], first["actor/total_params"]
    assert 0 < trainable < 0.1 * total
    assert 8 * trainable <= first["actor/optimizer_state_bytes"] < 8 * trainable + 4096
    (final,) = os.listdir(run / "checkpoints" / "final")
    files = os.listdir(run / "checkpoints" / "final" / final)
    assert "model.safetensors" in files and "adapter" in files, files


@pytest.mark.integration  # a multi-second run: not in `make test-fast`
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
