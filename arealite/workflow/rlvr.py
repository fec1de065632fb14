"""RLVR: one prompt, n sampled answers, a verifiable reward per answer (GRPO's group).

Token-in/token-out: the prompt is tokenized once here, the server returns token ids, and the
trajectory is built from exactly those ids, so the trainer sees what the sampler saw.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDict

from arealite.api.engine_api import InferenceEngine
from arealite.api.io_struct import GenerationHyperparameters, ModelRequest, ModelResponse
from arealite.api.workflow_api import RolloutWorkflow
from arealite.reward.pool import RewardPool
from arealite.utils.data import pad_sequences_to_tensors

# Keyword arguments the workflow passes to reward_fn itself; same-named data fields are dropped.
REWARD_ARGS = ("prompt", "completions", "prompt_ids", "completion_ids")


def chat_prompt_ids(tokenizer: Any, data: dict[str, Any], enable_thinking: bool) -> list[int]:
    """`data["input_ids"]` if given, else the chat template of `data["messages"]` with the
    assistant header appended."""
    if data.get("input_ids") is not None:
        return [int(t) for t in data["input_ids"]]
    if "messages" not in data:
        raise KeyError(f"data item needs 'messages' or 'input_ids', has {sorted(data)}")
    text = tokenizer.apply_chat_template(
        data["messages"],
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=enable_thinking,
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def sample_seed(base: int, data: dict[str, Any], prompt_ids: list[int], index: int, version: int):
    """The sampling seed of sample `index` of a data item: a re-run of the same item at the
    same policy version (a resumed run) draws the same tokens; other items, samples and
    versions draw independently. Items are known by `query_id`, else by their prompt."""
    qid = data.get("query_id")
    key = qid if isinstance(qid, str) else prompt_ids
    digest = hashlib.blake2b(json.dumps([base, key, index, version]).encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "big") >> 1  # < 2**63: fits every server's seed


def reward_row(data: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in data.items() if k not in REWARD_ARGS}


def trajectory(
    input_ids: list[int],
    loss_mask: list[int],
    logprobs: list[float],
    versions: list[int],
    reward: float,
    no_eos: bool,
) -> dict[str, torch.Tensor]:
    """One row of the padded batch every trainer consumes (all per-token lists aligned)."""
    return {
        "input_ids": torch.tensor(input_ids, dtype=torch.long),
        "attention_mask": torch.ones(len(input_ids), dtype=torch.bool),
        "loss_mask": torch.tensor(loss_mask, dtype=torch.int32),
        "logprobs": torch.tensor(logprobs, dtype=torch.float32),
        "versions": torch.tensor(versions, dtype=torch.int32),
        "rewards": torch.tensor(float(reward), dtype=torch.float32),
        "seq_no_eos_mask": torch.tensor(bool(no_eos)),
    }


class RLVRWorkflow(RolloutWorkflow):
    """`gconfig.n_samples` concurrent generations of one prompt, each scored by
    `reward_fn(prompt, completions, prompt_ids, completion_ids, **row)` (called once per
    sample; `completions` is that sample's decoded text, special tokens skipped) in a process
    pool; a reward that raises or exceeds `reward_timeout` scores 0 and is counted in
    `reward_stats`.

    Returns TensorDict [n, L]: input_ids, attention_mask, loss_mask (1 on completion tokens),
    logprobs (server logprobs aligned to input_ids, 0 on the prompt), versions (per token, -1 on
    the prompt), rewards [n] float32, seq_no_eos_mask [n] (stopped by the length budget).
    """

    def __init__(
        self,
        reward_fn: Callable[..., float],
        gconfig: GenerationHyperparameters,
        tokenizer: Any,
        enable_thinking: bool = False,
        dump_dir: str | None = None,
        reward_timeout: float = 15.0,
        reward_workers: int = 2,
        reward_pool: RewardPool | None = None,
    ):
        self.reward_fn = reward_fn
        self.gconfig = gconfig
        self.tokenizer = tokenizer
        self.enable_thinking = enable_thinking
        self.dump_dir = dump_dir
        self.reward_pool = reward_pool or RewardPool(reward_fn, reward_workers, reward_timeout)
        if dump_dir:
            os.makedirs(dump_dir, exist_ok=True)

    def close(self) -> None:
        """Stop the reward worker processes."""
        self.reward_pool.close()

    @property
    def reward_stats(self) -> dict[str, int]:
        """calls / ok / timeouts / errors of the reward function so far."""
        return dict(self.reward_pool.stats)

    def state_dict(self) -> dict[str, Any]:
        """Cumulative counters a resumed run continues from (see RecoverHandler's `extra`)."""
        return {"reward_stats": self.reward_stats}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.reward_pool.stats.update({k: int(v) for k, v in state["reward_stats"].items()})

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> TensorDict:
        prompt_ids = chat_prompt_ids(self.tokenizer, data, self.enable_thinking)
        version = engine.get_version()
        g = self.gconfig.new(n_samples=1)
        gs = [
            g if g.seed is None else g.new(seed=sample_seed(g.seed, data, prompt_ids, i, version))
            for i in range(self.gconfig.n_samples)
        ]
        resps: list[ModelResponse] = await engine.agenerate_group(
            [ModelRequest(rid=uuid.uuid4().hex, input_ids=prompt_ids, gconfig=gi) for gi in gs]
        )
        prompt = self.tokenizer.decode(prompt_ids)
        completions = [
            self.tokenizer.decode(r.output_tokens, skip_special_tokens=True) for r in resps
        ]
        row = reward_row(data)
        rewards = await self.reward_pool.many(
            [
                (
                    (),
                    dict(
                        prompt=prompt,
                        completions=c,
                        prompt_ids=prompt_ids,
                        completion_ids=r.output_tokens,
                        **row,
                    ),
                )
                for c, r in zip(completions, resps)
            ]
        )
        rows = []
        for r, reward in zip(resps, rewards):
            p, o = r.input_len, r.output_len
            rows.append(
                trajectory(
                    r.input_tokens + r.output_tokens,
                    [0] * p + [1] * o,
                    [0.0] * p + r.output_logprobs,
                    [-1] * p + r.output_versions,
                    reward,
                    r.stop_reason == "length",
                )
            )
        if self.dump_dir:
            self._dump(version, prompt, completions, resps, rewards, data.get("query_id"))
        return pad_sequences_to_tensors(rows)

    def _dump(self, version, prompt, completions, resps, rewards, query_id=None) -> None:
        """Append the episode to <dump_dir>/rollouts_v<version>.jsonl for inspection."""
        path = os.path.join(self.dump_dir, f"rollouts_v{version}.jsonl")
        with open(path, "a") as f:
            for c, r, rw in zip(completions, resps, rewards):
                rec = {
                    "query_id": query_id,
                    "version": version,
                    "prompt": prompt,
                    "completion": c,
                    "reward": rw,
                    "output_len": r.output_len,
                    "stop_reason": r.stop_reason,
                    "output_versions": sorted(set(r.output_versions)),
                }
                f.write(json.dumps(rec) + "\n")
