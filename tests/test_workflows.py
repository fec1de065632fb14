"""RLVRWorkflow, MultiTurnWorkflow and the reward process pool, end to end on a real server."""

from __future__ import annotations

import asyncio
import json
import math
import os
import time

import pytest
import torch
import workflow_rewards as rewards
from _engine_recorder import Recorder
from _rollout import remote_engine
from transformers import AutoModelForCausalLM, AutoTokenizer

from arealite.api.io_struct import GenerationHyperparameters
from arealite.reward.pool import RewardPool
from arealite.rollout import WorkflowExecutor
from arealite.workflow.multi_turn import MultiTurnWorkflow
from arealite.workflow.rlvr import RLVRWorkflow

pytestmark = pytest.mark.integration

DATA = {
    "messages": [{"role": "user", "content": "What is 2+3?"}],
    "answer": "5",
    "query_id": "q0",
}


@pytest.fixture(scope="module")
def engine(tiny_server):
    with remote_engine(tiny_server.address, consumer_batch_size=4) as e:
        yield e


@pytest.fixture(scope="module")
def executor(engine):
    ex = WorkflowExecutor(engine.config, engine)
    ex.initialize()
    yield ex
    ex.destroy()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def prompt_ids_of(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_rlvr_episode_tensors(engine, tokenizer, tiny_model_dir, tmp_path):
    n, budget = 4, 8
    g = GenerationHyperparameters(n_samples=n, max_new_tokens=budget, temperature=1.0)
    wf = RLVRWorkflow(rewards.has_digit, g, tokenizer, dump_dir=str(tmp_path))
    td = asyncio.run(wf.arun_episode(engine, DATA))

    prompt = prompt_ids_of(tokenizer, DATA["messages"])
    P, L = len(prompt), td["input_ids"].shape[1]
    assert td.batch_size[0] == n
    assert set(td.keys()) >= {
        "input_ids",
        "attention_mask",
        "loss_mask",
        "logprobs",
        "versions",
        "rewards",
        "seq_no_eos_mask",
    }
    assert td["rewards"].dtype == torch.float32 and td["rewards"].shape == (n,)
    lengths = td["attention_mask"].sum(1).tolist()
    for i, length in enumerate(lengths):
        n_out = length - P
        assert 1 <= n_out <= budget
        ids = td["input_ids"][i]
        assert ids[:P].tolist() == prompt
        assert td["loss_mask"][i].tolist() == [0] * P + [1] * n_out + [0] * (L - length)
        assert td["logprobs"][i, :P].eq(0).all()
        lp = td["logprobs"][i, P:length]
        assert torch.isfinite(lp).all() and (lp < 0).all()
        assert td["versions"][i].tolist()[:length] == [-1] * P + [0] * n_out
        ends_with_eos = ids[length - 1].item() == tokenizer.eos_token_id
        assert td["seq_no_eos_mask"][i].item() == (not ends_with_eos and n_out == budget)
        completion = tokenizer.decode(ids[P:length].tolist(), skip_special_tokens=True)
        assert td["rewards"][i].item() == float(any(c.isdigit() for c in completion))

    # Alignment: logprobs[t] = log p(input_ids[t] | input_ids[:t]) under the served weights.
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=td["input_ids"], attention_mask=td["attention_mask"]).logits
    ref = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, td["input_ids"][:, 1:, None])
    mask = td["loss_mask"][:, 1:].bool()
    assert torch.allclose(ref[..., 0][mask], td["logprobs"][:, 1:][mask], atol=1e-3)

    lines = (tmp_path / "rollouts_v0.jsonl").read_text().splitlines()
    assert len(lines) == n and json.loads(lines[0])["prompt"].endswith("assistant\n")


def test_rlvr_through_rollout_batch(engine, executor, tokenizer):
    g = GenerationHyperparameters(n_samples=2, max_new_tokens=3)
    wf = RLVRWorkflow(rewards.echo_row, g, tokenizer)
    data = [{**DATA, "target": t} for t in (0.25, 0.5, 0.75)]
    td = executor.rollout_batch(data, wf)
    assert td.batch_size[0] == 6
    assert td["rewards"].tolist() == [0.25, 0.25, 0.5, 0.5, 0.75, 0.75]
    # data["input_ids"] bypasses the chat template.
    td = asyncio.run(wf.arun_episode(engine, {"input_ids": [5, 6, 7], "target": 1.0}))
    assert td["input_ids"][:, :3].tolist() == [[5, 6, 7]] * 2


def test_reward_errors_and_timeouts_score_zero_and_are_counted(engine, tokenizer):
    g = GenerationHyperparameters(n_samples=2, max_new_tokens=2)
    wf = RLVRWorkflow(rewards.raises, g, tokenizer)
    td = asyncio.run(wf.arun_episode(engine, DATA))
    assert td["rewards"].tolist() == [0.0, 0.0]
    assert wf.reward_stats == {"calls": 2, "ok": 0, "timeouts": 0, "errors": 2}

    wf = RLVRWorkflow(rewards.hangs, g, tokenizer, reward_timeout=2.0)
    start = time.monotonic()
    td = asyncio.run(wf.arun_episode(engine, DATA))
    assert time.monotonic() - start < 30
    assert td["rewards"].tolist() == [0.0, 0.0]
    assert wf.reward_stats["timeouts"] == 2
    wf.reward_pool.close()


def test_reward_pool_replaces_stuck_workers():
    pool = RewardPool(rewards.hangs_if_asked, max_workers=2, timeout=2.0)
    try:

        async def run():
            hung = await pool(prompt="", completions="", prompt_ids=[], completion_ids=[], hang=1)
            stuck = pool.worker_pids()
            ok = await asyncio.gather(
                *(
                    pool(prompt="", completions="", prompt_ids=[], completion_ids=[])
                    for _ in range(3)
                )
            )
            return hung, ok, stuck

        hung, ok, stuck = asyncio.run(run())
        assert hung == 0.0 and ok == [1.0, 1.0, 1.0]
        assert pool.stats == {"calls": 4, "ok": 3, "timeouts": 1, "errors": 0}
        deadline = time.monotonic() + 10
        while set(stuck) & set(pool.worker_pids()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not set(stuck) & set(pool.worker_pids())  # the retired pool was killed
        for pid in stuck:
            assert not _alive(pid)
    finally:
        pool.close()
    with pytest.raises(TypeError, match="picklable"):
        RewardPool(lambda **kw: 1.0)


def test_a_group_is_scored_in_one_task_per_worker_and_one_bad_sample_spares_the_rest():
    """pool.many: 6 calls in 2 worker tasks; a raising call scores 0 with its worker-side
    traceback kept; a hanging one times its chunk out, whose calls are retried one by one so
    only the stuck call scores 0."""
    pool = RewardPool(rewards.by_row, max_workers=2, timeout=2.0)
    base = dict(prompt="", completions="", prompt_ids=[], completion_ids=[])
    plan = ["ok", "raise", "ok", "ok", "hang", "ok"]
    calls = [((), {**base, "i": i, "do": do}) for i, do in enumerate(plan)]
    try:
        scores = asyncio.run(pool.many(calls))
        assert scores == [0.0, 0.0, 2.0, 3.0, 0.0, 5.0]
        assert pool.stats == {"calls": 6, "ok": 4, "timeouts": 1, "errors": 1}
        assert "sample 1 exploded" in pool.errors.first_traceback
        assert "in by_row" in pool.errors.first_traceback  # the worker's frames, not ours
        assert asyncio.run(pool.many(calls[:1])) == [0.0]  # a fresh pool serves on
    finally:
        pool.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead too
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def test_multi_turn_feedback_is_token_in_token_out(engine, tokenizer):
    g = GenerationHyperparameters(max_new_tokens=6)
    wf = MultiTurnWorkflow(
        rewards.correct_on_second_turn, g, tokenizer, max_turns=3, turn_discount=0.5
    )
    rec = Recorder(engine)
    td = asyncio.run(wf.arun_episode(rec, DATA))

    assert len(rec.calls) == 2 and td["num_turns"].tolist() == [2]
    assert td["rewards"].tolist() == [0.5]  # 1.0 * 0.5 ** (2 - 1)
    (in1, r1), (in2, r2) = rec.calls
    assert in1 == prompt_ids_of(tokenizer, DATA["messages"])
    eos = tokenizer.eos_token_id
    closing = [] if r1.output_tokens[-1] == eos else [eos]
    assert tokenizer.decode(wf.feedback_ids).endswith("again.<|im_end|>\n<|im_start|>assistant\n")
    # The second turn extends the first turn's exact tokens: nothing was re-tokenized.
    assert in2 == in1 + r1.output_tokens + closing + wf.feedback_ids
    full = in2 + r2.output_tokens
    n = int(td["attention_mask"][0].sum())
    assert td["input_ids"][0, :n].tolist() == full
    n_user = len(closing) + len(wf.feedback_ids)
    expected_mask = [0] * len(in1) + [1] * r1.output_len + [0] * n_user + [1] * r2.output_len
    assert td["loss_mask"][0, :n].tolist() == expected_mask
    model_pos = td["loss_mask"][0].bool()
    assert td["logprobs"][0][model_pos].tolist() == pytest.approx(
        r1.output_logprobs + r2.output_logprobs
    )
    assert td["logprobs"][0][:n][~model_pos[:n]].eq(0).all()
    assert (td["versions"][0][:n][~model_pos[:n]] == -1).all()


def test_multi_turn_stops_at_max_turns(engine, tokenizer):
    g = GenerationHyperparameters(n_samples=2, max_new_tokens=3)
    wf = MultiTurnWorkflow(rewards.always_zero, g, tokenizer, max_turns=3, turn_discount=0.9)
    rec = Recorder(engine)
    td = asyncio.run(wf.arun_episode(rec, DATA))
    assert len(rec.calls) == 6
    assert td["num_turns"].tolist() == [3, 3] and td["rewards"].tolist() == [0.0, 0.0]
    assert int(td["loss_mask"].sum()) == sum(r.output_len for _, r in rec.calls)
    assert all(math.isfinite(x) for x in td["logprobs"].flatten().tolist())
    with pytest.raises(ValueError, match="max_turns"):
        MultiTurnWorkflow(rewards.always_zero, g, tokenizer, max_turns=0, turn_discount=1.0)
