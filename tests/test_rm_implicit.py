"""The implicit reward head (arealite/engine/rm/implicit.py): r = beta * (summed response logprob
of the trained LM - the reference's), against a plain per-sequence HF computation; its config
checks; and the GRPO scorer reading a saved implicit checkpoint."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from arealite.api.cli_args import (
    ConfigError,
    FSDPConfig,
    MicroBatchSpec,
    OptimizerConfig,
    load_expr_config,
)
from arealite.api.io_struct import SaveLoadMeta
from arealite.api.reward_api import RewardSpecError, resolve_reward
from arealite.api.rm_config import RM_HEAD_FILE, RMConfig, RMEngineConfig
from arealite.engine.rm.implicit import FSDPImplicitRewardModel
from arealite.engine.rm.preference_data import (
    arith_preferences,
    collate_pairs,
    completion_ids,
    prompt_ids,
    with_reference_scores,
)
from arealite.reward.reward_model import RewardModelScorer

BETA = 0.5


def plain_response_logprob(model, tok, prompt: str, answer: str) -> float:
    """sum log p(response token) of prompt ++ answer ++ EOS, one sequence, no packing."""
    p = prompt_ids(tok, {"prompt": prompt})
    ids = p + completion_ids(tok, answer)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    return sum(float(logp[t - 1, ids[t]]) for t in range(len(p), len(ids)))


@pytest.fixture
def implicit_rm(tiny_model_dir, tiny_model_dir_v2, build_engine):
    def make(max_tokens=None):
        cfg = RMEngineConfig(
            path=tiny_model_dir, head="implicit", beta=BETA, reference=tiny_model_dir_v2,
            fsdp=FSDPConfig(param_dtype="float32", reduce_dtype="float32"),
            mb_spec=MicroBatchSpec(max_tokens_per_mb=max_tokens),
            optimizer=OptimizerConfig(lr=1e-3, weight_decay=0.0),
        )  # fmt: skip
        return build_engine(FSDPImplicitRewardModel, cfg)

    return make


def independent_pair_scores(tiny_model_dir, tiny_model_dir_v2, rows):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    pol = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir_v2, dtype=torch.float32).eval()
    out = []
    for r in rows:
        for k in ("chosen", "rejected"):
            diff = plain_response_logprob(pol, tok, r["prompt"], r[k])
            out.append(BETA * (diff - plain_response_logprob(ref, tok, r["prompt"], r[k])))
    return torch.tensor(out)


def test_implicit_head_loss_and_scores_match_a_plain_computation(
    implicit_rm, tiny_model_dir, tiny_model_dir_v2
):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = with_reference_scores(arith_preferences(5, seed=4, n_operands=3), tiny_model_dir_v2, tok)
    expect = independent_pair_scores(tiny_model_dir, tiny_model_dir_v2, rows)
    margin = expect[0::2] - expect[1::2]
    assert float(margin.abs().min()) > 1e-3  # two different models: a non-trivial check
    pairs = collate_pairs(tok, rows)
    engine = implicit_rm(max_tokens=48)  # several micro-batches
    st = engine.evaluate_rm(pairs)
    assert st["chosen_reward"] == pytest.approx(float(expect[0::2].mean()), abs=1e-4)
    assert st["rejected_reward"] == pytest.approx(float(expect[1::2].mean()), abs=1e-4)
    assert st["loss"] == pytest.approx(float(-F.logsigmoid(margin).mean()), abs=1e-4)
    assert st["accuracy"] == pytest.approx(float((margin > 0).float().mean()))
    trained = engine.train_rm(pairs)  # the loss is the one before the step
    assert trained["loss"] == pytest.approx(float(-F.logsigmoid(margin).mean()), abs=1e-4)
    assert engine.evaluate_rm(pairs)["loss"] < st["loss"]  # the step follows the BT gradient


def test_implicit_batches_without_reference_scores_fail_naming_them(implicit_rm, tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    pairs = collate_pairs(tok, arith_preferences(2, seed=1))  # no with_reference_scores
    with pytest.raises(KeyError, match=r"lacks \['ref_chosen', 'ref_rejected'\]"):
        implicit_rm().evaluate_rm(pairs)


def test_rm_head_config_is_validated(tiny_model_dir):
    base = ["experiment_name=x", "trial_name=y", f"model.path={tiny_model_dir}",
            "train_dataset.path=arith_preferences"]  # fmt: skip
    cfg = load_expr_config(base + ["model.head=implicit"], RMConfig)
    assert cfg.model.head == "implicit" and not cfg.model.is_critic
    assert load_expr_config(base, RMConfig).model.is_critic  # scalar by default
    with pytest.raises(ConfigError, match=r"model.head='linear' is not allowed"):
        load_expr_config(base + ["model.head=linear"], RMConfig)
    with pytest.raises(ConfigError, match=r"model.beta=0.0: the implicit head needs beta > 0"):
        load_expr_config(base + ["model.head=implicit", "model.beta=0.0"], RMConfig)
    with pytest.raises(ConfigError, match=r"model.reference='ref' is only read by"):
        load_expr_config(base + ["model.reference=ref"], RMConfig)


def test_grpo_scorer_reads_a_saved_implicit_checkpoint(
    implicit_rm, tiny_model_dir, tiny_model_dir_v2, tmp_path
):
    engine = implicit_rm()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    out = str(tmp_path / "rm")
    engine.save(SaveLoadMeta(path=out, tokenizer=tok))
    head = json.load(open(os.path.join(out, RM_HEAD_FILE)))
    assert head == {"head": "implicit", "beta": BETA, "reference": tiny_model_dir_v2}
    scorer = resolve_reward(out)
    assert isinstance(scorer, RewardModelScorer) and scorer.head["head"] == "implicit"
    rows = [{"prompt": "1+2+3=", "chosen": "6", "rejected": "16"}]
    expect = independent_pair_scores(tiny_model_dir, tiny_model_dir_v2, rows)
    p = prompt_ids(tok, rows[0])
    for answer, want in zip(("6", "16"), expect.tolist()):
        ids = tok(answer, add_special_tokens=False)["input_ids"]  # no EOS: the scorer adds it
        assert scorer("", answer, p, ids) == pytest.approx(want, abs=1e-4)
    head["reference"] = str(tmp_path / "gone")
    json.dump(head, open(os.path.join(out, RM_HEAD_FILE), "w"))
    with pytest.raises(RewardSpecError, match="reference model .* is not an HF model directory"):
        resolve_reward(out)
