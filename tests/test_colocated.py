"""Colocated generation (arealite/server/colocated.py): the trainer ranks generate in process.

In process: the engine's tokens and logprobs are the model's own (teacher-forced HF forward),
in-memory weight loads change them and tag the tokens, a pause holds and resumes a group, and
a bad request fails naming its rid. Through the launcher: GRPO on two gloo ranks with no server
process, each rank's generator loaded from the trainer after every step."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest
import torch
from _teacher_forced import teacher_forced_logprobs
from _torchrun_fsdp import engine_config, make_batch
from test_weight_sync import metrics_and_versions, run_arith_grpo
from transformers import AutoModelForCausalLM

from arealite.api.cli_args import GenerationHyperparameters, OptimizerConfig, RolloutConfig
from arealite.api.io_struct import ModelRequest, WeightUpdateMeta
from arealite.api.lora_config import LoRAConfig
from arealite.engine.sft.lm_engine import FSDPLMEngine
from arealite.server.colocated import ColocatedEngine, ColocatedGenerator

PROMPTS = [[5, 9, 13, 2, 7], [11, 4, 4, 8], [3, 17, 6, 21, 9, 1], [5, 9, 13, 2, 7]]


@pytest.fixture
def engine(tiny_model_dir):
    gen = ColocatedGenerator.shared(tiny_model_dir, "float32", torch.device("cpu"), 0, 64)
    eng = ColocatedEngine(RolloutConfig(), gen)
    yield eng
    eng.destroy()
    assert not ColocatedGenerator._shared  # the last user stopped the scheduler


def requests_for(prompts, max_new_tokens=6, greedy=True):
    g = GenerationHyperparameters(
        n_samples=1,
        max_new_tokens=max_new_tokens,
        greedy=greedy,
        temperature=0.0 if greedy else 1.0,
    )
    return [ModelRequest(input_ids=p, gconfig=g) for p in prompts]


def teacher_forced(model_dir: str, prompt: list[int], out: list[int]) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return teacher_forced_logprobs(model, prompt, out)


def test_a_group_is_the_models_own_tokens_and_logprobs(engine, tiny_model_dir):
    outs = asyncio.run(engine.agenerate_group(requests_for(PROMPTS)))
    assert [o.input_tokens for o in outs] == PROMPTS
    assert outs[0].output_tokens == outs[3].output_tokens  # greedy: same prompt, same answer
    for p, o in zip(PROMPTS, outs):
        assert 1 <= o.output_len <= 6 and o.output_versions == [0] * o.output_len
        ref = teacher_forced(tiny_model_dir, p, o.output_tokens)
        torch.testing.assert_close(torch.tensor(o.output_logprobs), ref, atol=1e-4, rtol=0)


def test_weights_loaded_in_memory_are_served_and_tagged(engine, tiny_model_dir_v2):
    """The v2 model's tensors, as a trainer hands them over (buckets of checkpoint names)."""
    v2 = AutoModelForCausalLM.from_pretrained(tiny_model_dir_v2, dtype=torch.float32)
    state = v2.state_dict()
    names = list(state)
    engine.load_weights([{n: state[n] for n in names[:3]}, {n: state[n] for n in names[3:]}], 7)
    assert engine.weight_version == 7
    (out,) = asyncio.run(engine.agenerate_group(requests_for(PROMPTS[:1])))
    assert out.output_versions == [7] * out.output_len
    ref = teacher_forced(tiny_model_dir_v2, PROMPTS[0], out.output_tokens)
    torch.testing.assert_close(torch.tensor(out.output_logprobs), ref, atol=1e-4, rtol=0)


def test_a_lora_trainers_weights_arrive_merged(engine, build_engine, tmp_path):
    """What WeightSync hands a colocated generator from a LoRA actor (W + BA, base names)
    serves exactly what the merged HF export computes."""
    pytest.importorskip("peft")
    cfg = engine_config(
        engine.generator.runner.model_path,
        optimizer=OptimizerConfig(lr=1e-2),
        lora=LoRAConfig(rank=4, alpha=8.0),
    )
    actor = build_engine(FSDPLMEngine, cfg)
    for seed in range(3):
        actor.train_lm(make_batch(n=4, seed=seed))
    actor.upload_weights(WeightUpdateMeta.from_disk(str(tmp_path / "merged"), version=1))
    engine.load_weights(actor.full_weight_buckets(), 1)
    (out,) = asyncio.run(engine.agenerate_group(requests_for(PROMPTS[:1])))
    ref = teacher_forced(str(tmp_path / "merged"), PROMPTS[0], out.output_tokens)
    torch.testing.assert_close(torch.tensor(out.output_logprobs), ref, atol=1e-4, rtol=0)
    base = teacher_forced(cfg.path, PROMPTS[0], out.output_tokens)
    assert (ref - base).abs().max() > 1e-3  # the adapters moved the model


def test_a_paused_group_resumes_with_its_whole_budget(engine):
    """Held while paused, then decoded to its full budget once generation continues (ignore_eos:
    the budget, not an end token, ends it)."""
    reqs = requests_for(PROMPTS[:2], max_new_tokens=24, greedy=False)
    for r in reqs:
        r.gconfig = r.gconfig.new(ignore_eos=True)
    engine.pause_generation()
    result: list = []
    t = threading.Thread(target=lambda: result.extend(asyncio.run(engine.agenerate_group(reqs))))
    t.start()
    time.sleep(0.5)
    assert not result  # held
    engine.continue_generation()
    t.join(60)
    assert [o.output_len for o in result] == [24, 24]
    assert all(len(o.output_logprobs) == 24 and o.stop_reason == "length" for o in result)


def test_an_in_place_load_keeps_the_running_group_and_tags_each_token(
    engine, tiny_model_dir, tiny_model_dir_v2
):
    """pause_mode in_place: weights loaded while a group decodes; nothing is aborted, every row
    gets its whole budget, its tokens tagged 0 then 5 (the load's version)."""
    gen = ColocatedGenerator.shared(tiny_model_dir, "float32", torch.device("cpu"), 0, 64)
    in_place = ColocatedEngine(RolloutConfig(pause_mode="in_place"), gen)
    state = AutoModelForCausalLM.from_pretrained(tiny_model_dir_v2, dtype=torch.float32)
    budget = 400
    reqs = requests_for(PROMPTS, max_new_tokens=budget, greedy=False)
    for r in reqs:
        r.gconfig = r.gconfig.new(ignore_eos=True)
    metrics = gen.scheduler.metrics
    tokens_before = metrics.snapshot()["generation_tokens"]
    result: list = []
    t = threading.Thread(target=lambda: result.extend(asyncio.run(in_place.agenerate_group(reqs))))
    t.start()
    deadline = time.monotonic() + 60
    while metrics.snapshot()["generation_tokens"] - tokens_before < 8 * len(reqs):
        assert time.monotonic() < deadline, "the group never started"
        time.sleep(0.01)
    try:
        in_place.load_weights([state.state_dict()], 5)
        t.join(120)
    finally:
        in_place.destroy()
    assert [o.output_len for o in result] == [budget] * len(reqs)
    for o in result:
        assert o.output_versions[0] == 0 and o.output_versions[-1] == 5
        assert o.output_versions == sorted(o.output_versions)
    assert metrics.requests["abort"] == 0


def test_a_bad_request_names_its_rid_and_the_engine_goes_on(engine):
    bad = requests_for([[5, 10**6]])[0]
    with pytest.raises(ValueError, match=bad.rid):
        asyncio.run(engine.agenerate_group([bad]))
    (ok,) = asyncio.run(engine.agenerate_group(requests_for(PROMPTS[:1])))
    assert ok.output_len >= 1


@pytest.mark.integration
def test_grpo_on_two_ranks_without_a_server(tmp_path, tiny_model_dir):
    """Synchronous GRPO (eta = 0), 2 torchrun ranks, `colocated+d2p1t1`: no server process,
    each rank's generator serves exactly the trainer's weights after every update (fp32 both:
    behaviour logprobs equal the trainer's), tagged with their version; evaluation shares it."""
    run = tmp_path / "colo" / "t"
    args = [
        f"cluster.fileroot={tmp_path}",
        "experiment_name=colo",
        "trial_name=t",
        f"actor.path={tiny_model_dir}",
        "total_train_steps=3",
        "allocation_mode=colocated+d2p1t1",
        "rollout.max_head_offpolicyness=0",
        "rollout.dynamic_sampling=false",
        "train_dataset.batch_size=4",
        "gconfig.n_samples=2",
        "gconfig.max_new_tokens=4",
        "valid_dataset.options.size=8",
        "evaluator.freq_steps=2",
        "actor.fsdp.param_dtype=float32",
        "server.dtype=float32",
    ]
    run_arith_grpo(args)
    records, versions = metrics_and_versions(run)
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records:  # steps 1 and 2 train on tokens of the weights loaded in memory
        assert r["staleness_max"] == 0 and r["behave_logp_absdiff_max"] < 1e-3, r
    assert "eval/accuracy" in records[-1]
    assert sorted(os.listdir(run / "logs")) == ["trainer.log"]  # no server was started
    assert versions == {0, 1, 2}, versions


def test_server_load_meter_counts_the_batched_steps_of_a_group(engine):
    from arealite.rollout.server_load import ServerLoadMeter

    meter = ServerLoadMeter(engine)
    outs = asyncio.run(engine.agenerate_group(requests_for(PROMPTS, max_new_tokens=6)))
    stats = meter.step_stats()
    # Rows per batched step: the 4 requests decode together until each stops (at most 4 rows).
    assert 1.0 <= stats["rollout/server_batch_rows"] <= len(PROMPTS)
    assert sum(o.output_len for o in outs) >= stats["rollout/server_batch_rows"]
    assert 0.0 < stats["rollout/server_busy_frac"] <= 1.0
    assert stats["rollout/interrupted_requests"] == 0.0
    assert meter.step_stats()["rollout/server_batch_rows"] == 0.0  # nothing since: no steps


@pytest.mark.integration
def test_sampled_evaluation_scores_n_samples_answers_per_held_out_prompt(tmp_path, tiny_model_dir):
    """`evaluator.temperature: 1, n_samples: 3`: every evaluation scores 3 sampled answers of each
    of the 8 held-out prompts (24 reward calls), and the accuracy is their mean reward."""
    calls = tmp_path / "calls.txt"
    (tmp_path / "count.py").write_text(
        "def counted(prompt, completions, prompt_ids, completion_ids, answer=None, **kw):\n"
        f"    with open({str(calls)!r}, 'a') as f:\n"
        "        f.write(completions.replace('\\n', ' ') + '\\n')\n"
        "    return float(completions.strip() == str(answer))\n"
    )
    run = tmp_path / "sampled" / "t"
    args = [
        f"cluster.fileroot={tmp_path}",
        "experiment_name=sampled",
        "trial_name=t",
        f"actor.path={tiny_model_dir}",
        "total_train_steps=2",
        "allocation_mode=colocated+d1p1t1",
        "rollout.dynamic_sampling=false",
        "train_dataset.batch_size=2",
        "gconfig.n_samples=2",
        "gconfig.max_new_tokens=4",
        "valid_dataset.options.size=8",
        "evaluator.freq_steps=1",
        "evaluator.temperature=1.0",
        "evaluator.n_samples=3",
        f"eval_reward={tmp_path / 'count.py'}:counted",
    ]
    run_arith_grpo(args)
    records, _ = metrics_and_versions(run)
    evals = [r[k] for r in records for k in r if k.startswith("eval/accuracy")]
    n_calls = calls.read_bytes().count(b"\n")  # a line a call (bytes: a sample may hold a \r)
    assert n_calls - 24 * len(evals) in (0, 1), (n_calls, evals)  # + 1: the launch's preflight
    assert len(evals) >= 2 and all(round(a * 24, 4).is_integer() for a in evals), evals
