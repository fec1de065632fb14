"""The LM reward heads (arealite/engine/rm/implicit.py): implicit, r = beta * (summed response
logprob of the trained LM - the reference's); likelihood, r = beta * the LM's mean response
logprob; against a plain per-sequence HF computation; their config checks; and the GRPO scorer
reading a saved checkpoint of each."""

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
from arealite.api.reward_api import RewardSpecError
from arealite.api.rm_config import RM_HEAD_FILE, RMConfig, RMEngineConfig
from arealite.engine.rm.implicit import FSDPImplicitRewardModel
from arealite.engine.rm.preference_data import (
    arith_preferences,
    collate_pairs,
    completion_ids,
    prompt_ids,
    with_reference_scores,
)
from arealite.reward.resolve import resolve_reward
from arealite.reward.reward_model import RewardModelScorer

BETA = 0.5


def plain_response_logprob(model, tok, prompt: str, answer: str, mean: bool = False) -> float:
    """sum (or mean) log p(response token) of prompt ++ answer ++ EOS, one sequence, no
    packing."""
    p = prompt_ids(tok, {"prompt": prompt})
    ids = p + completion_ids(tok, answer)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    total = sum(float(logp[t - 1, ids[t]]) for t in range(len(p), len(ids)))
    return total / (len(ids) - len(p)) if mean else total


@pytest.fixture
def implicit_rm(tiny_model_dir, tiny_model_dir_v2, build_engine):
    def make(max_tokens=None, head="implicit"):
        ref = tiny_model_dir_v2 if head == "implicit" else None
        cfg = RMEngineConfig(
            path=tiny_model_dir,
            head=head,
            beta=BETA,
            reference=ref,
            fsdp=FSDPConfig(param_dtype="float32", reduce_dtype="float32"),
            mb_spec=MicroBatchSpec(max_tokens_per_mb=max_tokens),
            optimizer=OptimizerConfig(lr=1e-3, weight_decay=0.0),
        )
        return build_engine(FSDPImplicitRewardModel, cfg)

    return make


def independent_pair_scores(tiny_model_dir, ref_dir, rows):
    """beta * (policy - reference) summed response logprobs; ref_dir None (likelihood head):
    beta * the policy's mean response logprob."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    pol = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    ref = ref_dir and AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    out = []
    for r in rows:
        for k in ("chosen", "rejected"):
            lp = plain_response_logprob(pol, tok, r["prompt"], r[k], mean=ref is None)
            lp_ref = plain_response_logprob(ref, tok, r["prompt"], r[k]) if ref else 0.0
            out.append(BETA * (lp - lp_ref))
    return torch.tensor(out)


@pytest.mark.parametrize("head", ["implicit", "likelihood"])
def test_lm_head_loss_and_scores_match_a_plain_computation(
    implicit_rm, tiny_model_dir, tiny_model_dir_v2, head
):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = arith_preferences(5, seed=4, n_operands=3)
    ref = tiny_model_dir_v2 if head == "implicit" else None
    if ref:
        rows = with_reference_scores(rows, ref, tok)
    expect = independent_pair_scores(tiny_model_dir, ref, rows)
    margin = expect[0::2] - expect[1::2]
    assert float(margin.abs().min()) > 1e-3  # distinct scores: a non-trivial check
    pairs = collate_pairs(tok, rows)
    engine = implicit_rm(max_tokens=48, head=head)  # several micro-batches
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
    base = [
        "experiment_name=x",
        "trial_name=y",
        f"model.path={tiny_model_dir}",
        "train_dataset.path=arith_preferences",
    ]
    cfg = load_expr_config(base + ["model.head=implicit"], RMConfig)
    assert cfg.model.head == "implicit" and not cfg.model.is_critic
    assert load_expr_config(base, RMConfig).model.is_critic  # scalar by default
    with pytest.raises(ConfigError, match=r"model.head='linear' is not allowed"):
        load_expr_config(base + ["model.head=linear"], RMConfig)
    with pytest.raises(ConfigError, match=r"model.beta=0.0: the implicit head needs beta > 0"):
        load_expr_config(base + ["model.head=implicit", "model.beta=0.0"], RMConfig)
    with pytest.raises(ConfigError, match=r"model.reference='ref' is only read by"):
        load_expr_config(base + ["model.reference=ref"], RMConfig)
    with pytest.raises(ConfigError, match=r"the likelihood head has no reference model"):
        load_expr_config(base + ["model.head=likelihood", "model.reference=ref"], RMConfig)


@pytest.mark.parametrize("kind", ["implicit", "likelihood"])
def test_grpo_scorer_reads_a_saved_lm_head_checkpoint(
    implicit_rm, tiny_model_dir, tiny_model_dir_v2, tmp_path, kind
):
    engine = implicit_rm(head=kind)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    out = str(tmp_path / "rm")
    engine.save(SaveLoadMeta(path=out, tokenizer=tok))
    head = json.load(open(os.path.join(out, RM_HEAD_FILE)))
    ref = tiny_model_dir_v2 if kind == "implicit" else None
    assert head == {"head": kind, "beta": BETA, "reference": ref}
    scorer = resolve_reward(out)
    assert isinstance(scorer, RewardModelScorer) and scorer.head["head"] == kind
    rows = [{"prompt": "1+2+3=", "chosen": "6", "rejected": "16"}]
    expect = independent_pair_scores(tiny_model_dir, ref, rows)
    p = prompt_ids(tok, rows[0])
    for answer, want in zip(("6", "16"), expect.tolist()):
        ids = tok(answer, add_special_tokens=False)["input_ids"]  # no EOS: the scorer adds it
        assert scorer("", answer, p, ids) == pytest.approx(want, abs=1e-4)
    if kind == "likelihood":
        return
    head["reference"] = str(tmp_path / "gone")
    json.dump(head, open(os.path.join(out, RM_HEAD_FILE), "w"))
    with pytest.raises(RewardSpecError, match="reference model .* is not an HF model directory"):
        resolve_reward(out)
