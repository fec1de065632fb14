"""Multi-turn RLVR: answer, get "wrong, try again" feedback, answer again, up to max_turns.

Token-in/token-out across turns: earlier turns are never re-tokenized (re-tokenizing decoded
text can merge tokens differently, so the trainer would score tokens the sampler never
produced). Each turn appends the server's own output ids, then the token ids of the feedback
user message as the chat template renders it after a finished assistant turn.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDict

from arealite.api.engine_api import InferenceEngine
from arealite.api.io_struct import GenerationHyperparameters, ModelRequest
from arealite.api.workflow_api import RolloutWorkflow
from arealite.reward.pool import RewardPool
from arealite.utils.data import pad_sequences_to_tensors
from arealite.workflow.rlvr import chat_prompt_ids, reward_row, trajectory

DEFAULT_FEEDBACK = (
    "Your answer is either wrong or not parsable to the reward function. "
    "Please try to answer it again."
)

_USER, _ASSISTANT = "\x00arealite-user\x00", "\x00arealite-assistant\x00"


def feedback_suffix_ids(tokenizer: Any, content: str, enable_thinking: bool = False) -> list[int]:
    """Token ids that follow an assistant turn's end-of-turn token (the EOS) to add a user
    message with `content` and open the next assistant turn.

    Rendered by the tokenizer's own chat template: we render a placeholder conversation with
    and without the extra user message and keep the text after the assistant's EOS.
    """
    eos = tokenizer.eos_token
    if not eos:
        raise ValueError("MultiTurnWorkflow needs a tokenizer with an eos_token (end of turn)")
    base = [{"role": "user", "content": _USER}, {"role": "assistant", "content": _ASSISTANT}]
    kw = {"tokenize": False, "enable_thinking": enable_thinking}
    base_text = tokenizer.apply_chat_template(base, **kw)
    full_text = tokenizer.apply_chat_template(
        base + [{"role": "user", "content": content}], add_generation_prompt=True, **kw
    )
    end = base_text.find(_ASSISTANT)
    cut = base_text.find(eos, end) if end >= 0 else -1
    if cut < 0 or full_text[: cut + len(eos)] != base_text[: cut + len(eos)]:
        raise ValueError(
            "cannot derive the feedback turn from the chat template: an assistant message does "
            f"not end with eos_token {eos!r}, or adding a user turn rewrites earlier turns"
        )
    return tokenizer(full_text[cut + len(eos) :], add_special_tokens=False)["input_ids"]


class MultiTurnWorkflow(RolloutWorkflow):
    """Up to `max_turns` answers per trajectory; after a wrong one (reward <= 0) a feedback
    user message is appended and the model answers again. The reward of the last answer is
    discounted by `turn_discount ** (turns - 1)`.

    Returns TensorDict [n_samples, L] like RLVRWorkflow (loss_mask 1 only on model tokens,
    logprobs/versions 0/-1 elsewhere) plus `num_turns` [n].
    """

    def __init__(
        self,
        reward_fn: Callable[..., float],
        gconfig: GenerationHyperparameters,
        tokenizer: Any,
        max_turns: int,
        turn_discount: float,
        feedback: str = DEFAULT_FEEDBACK,
        enable_thinking: bool = False,
        reward_timeout: float = 15.0,
        reward_workers: int = 2,
        reward_pool: RewardPool | None = None,
    ):
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        if not 0 < turn_discount <= 1:
            raise ValueError(f"turn_discount must be in (0, 1], got {turn_discount}")
        self.gconfig = gconfig
        self.tokenizer = tokenizer
        self.max_turns = max_turns
        self.turn_discount = turn_discount
        self.enable_thinking = enable_thinking
        self.eos_id = tokenizer.eos_token_id
        self.feedback_ids = feedback_suffix_ids(tokenizer, feedback, enable_thinking)
        self.reward_pool = reward_pool or RewardPool(reward_fn, reward_workers, reward_timeout)

    def close(self) -> None:
        """Stop the reward worker processes."""
        self.reward_pool.close()

    @property
    def reward_stats(self) -> dict[str, int]:
        return dict(self.reward_pool.stats)

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> TensorDict:
        prompt_ids = chat_prompt_ids(self.tokenizer, data, self.enable_thinking)
        rows = await asyncio.gather(
            *(self._one_trajectory(engine, prompt_ids, data) for _ in range(self.gconfig.n_samples))
        )
        return pad_sequences_to_tensors(rows)

    async def _one_trajectory(self, engine: InferenceEngine, prompt_ids: list[int], data: dict):
        g = self.gconfig.new(n_samples=1)
        rid = uuid.uuid4().hex  # one rid for all turns: the same server keeps the prefix
        seq, loss_mask = list(prompt_ids), [0] * len(prompt_ids)
        logprobs, versions = [0.0] * len(prompt_ids), [-1] * len(prompt_ids)
        row = reward_row(data)
        reward, turns, no_eos = 0.0, 0, False
        while turns < self.max_turns:
            resp = await engine.agenerate(ModelRequest(rid=rid, input_ids=list(seq), gconfig=g))
            turns += 1
            reward = await self.reward_pool(
                prompt=self.tokenizer.decode(seq),
                completions=self.tokenizer.decode(resp.output_tokens, skip_special_tokens=True),
                prompt_ids=list(seq),
                completion_ids=resp.output_tokens,
                **row,
            )
            seq += resp.output_tokens
            loss_mask += [1] * resp.output_len
            logprobs += resp.output_logprobs
            versions += resp.output_versions
            no_eos = resp.stop_reason == "length"
            if reward > 0 or turns == self.max_turns:
                break
            # Close the turn ourselves if the model did not, then the feedback message.
            extra = [] if resp.output_tokens[-1:] == [self.eos_id] else [self.eos_id]
            extra += self.feedback_ids
            seq += extra
            loss_mask += [0] * len(extra)
            logprobs += [0.0] * len(extra)
            versions += [-1] * len(extra)
        out = trajectory(
            seq, loss_mask, logprobs, versions, reward * self.turn_discount ** (turns - 1), no_eos
        )
        out["num_turns"] = torch.tensor(turns, dtype=torch.int32)
        return out
