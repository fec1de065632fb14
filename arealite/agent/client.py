"""`TrainingOpenAIClient`: an `AsyncOpenAI`-shaped client whose completions come from the
inference engine being trained, recording exactly what the model saw and sampled.

An agent written against `openai.AsyncOpenAI` runs unchanged (`await client.chat.completions
.create(...)`). Each request is rendered by the model's chat template; when it continues an
earlier completion (same messages + that completion's assistant message + new messages), the
prompt is built from the earlier turn's *tokens* plus the tokens of the new messages only, so
the model's own tokens are never re-tokenized and each turn's prompt extends its parent's
prompt + output (see interactions.py). Works with every InferenceEngine (SGLang, vLLM,
embedded server): it only calls `engine.agenerate`.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

from arealite.agent.interactions import ExportStyle, Interaction, InteractionTree
from arealite.api.io_struct import GenerationHyperparameters, ModelRequest, ModelResponse
from arealite.openai_wire.request import (
    ChatRequest,
    ChatRequestError,
    encode_text,
    normalize_message,
    parse_chat_request,
    render_prompt,
    tool_parser_for,
)
from arealite.openai_wire.response import build_choice, completion_body, completion_chunks

# openai-python call options that are not part of the request body.
_CALL_OPTIONS = ("extra_headers", "extra_query", "timeout")


def _same_assistant_turn(sent: dict[str, Any], returned: dict[str, Any]) -> bool:
    """Did the agent pass our assistant message back unchanged (content and tool calls)?"""

    def calls(m):
        return [
            (c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls", [])
        ]

    return (
        sent["role"] == "assistant"
        and (sent.get("content") or "").strip() == (returned.get("content") or "").strip()
        and calls(sent) == calls(returned)
    )


class _Completions:
    def __init__(self, client: TrainingOpenAIClient):
        self._client = client

    async def create(self, **kwargs: Any):
        return await self._client.create_chat_completion(**kwargs)


class TrainingOpenAIClient:
    """Chat completions through `engine.agenerate`, recorded for training.

    `gconfig` gives the defaults (max_new_tokens, temperature, ...) that a request does not
    set. Rewards: `set_reward(completion_id, r)` per turn and/or `set_final_reward(r)` (the
    last completion); `export_samples(style, turn_discount)` gives the training rows.
    """

    def __init__(
        self,
        engine: Any,
        tokenizer: Any,
        gconfig: GenerationHyperparameters | None = None,
        tool_parser: str = "auto",
        chat_template_kwargs: dict[str, Any] | None = None,
        model_name: str = "arealite-policy",
    ):
        if tokenizer.eos_token_id is None:
            raise ValueError(
                "TrainingOpenAIClient needs a tokenizer with an eos_token (end of turn)"
            )
        self.engine = engine
        self.tokenizer = tokenizer
        self.gconfig = gconfig or GenerationHyperparameters()
        self.tool_parser = tool_parser
        self.template_kwargs = dict(chat_template_kwargs or {})
        self.model_name = model_name
        self.tree = InteractionTree()
        self.chat = SimpleNamespace(completions=_Completions(self))

    # ---- rewards and export -----------------------------------------------------------------
    @property
    def interactions(self) -> list[Interaction]:
        return list(self.tree)

    def set_reward(self, completion_id: str, reward: float, choice_index: int = 0) -> None:
        self.tree.set_reward(completion_id, reward, choice_index)

    def set_final_reward(self, reward: float) -> None:
        self.tree.set_final_reward(reward)

    def export_samples(self, style: ExportStyle = "individual", turn_discount: float = 1.0):
        """TensorDict rows for the trainer (see InteractionTree.export)."""
        return self.tree.export(style, turn_discount)

    # ---- completions ------------------------------------------------------------------------
    async def create_chat_completion(self, **kwargs: Any):
        from openai.types.chat import ChatCompletion

        body = {k: v for k, v in kwargs.items() if k not in _CALL_OPTIONS and k != "extra_body"}
        body.update(kwargs.get("extra_body") or {})
        req = parse_chat_request(body)
        if req.top_logprobs:
            raise ChatRequestError(
                "top_logprobs",
                "not available for training completions (engines return the sampled "
                "token's logprob only); use logprobs=true",
            )
        parser = tool_parser_for(self.tokenizer, req, self.tool_parser)
        prompt_text, prompt_ids = self._prompt(req)
        resps = await asyncio.gather(
            *(
                self.engine.agenerate(
                    ModelRequest(
                        rid=uuid.uuid4().hex, input_ids=prompt_ids, gconfig=self._gconfig(req, i)
                    )
                )
                for i in range(req.n)
            )
        )
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        choices, used = [], 0
        for i, resp in enumerate(resps):
            choice, kept = self._record(req, cid, i, prompt_text, prompt_ids, resp, parser)
            choices.append(choice)
            used += kept
        out = completion_body(cid, req.model or self.model_name, choices, len(prompt_ids), used)
        if req.stream:
            return self._as_stream(out, req.include_usage)
        return ChatCompletion.model_validate(out)

    async def _as_stream(self, body: dict, include_usage: bool) -> AsyncIterator[Any]:
        from openai.types.chat import ChatCompletionChunk

        for chunk in completion_chunks(body, include_usage):
            yield ChatCompletionChunk.model_validate(chunk)

    def _gconfig(self, req: ChatRequest, index: int) -> GenerationHyperparameters:
        g = self.gconfig
        stop_ids = list(g.stop_token_ids)
        for s in req.stop:
            ids = encode_text(self.tokenizer, s)
            if len(ids) == 1:
                stop_ids.append(ids[0])
        return g.new(
            n_samples=1,
            max_new_tokens=g.max_new_tokens if req.max_tokens is None else req.max_tokens,
            temperature=g.temperature if req.temperature is None else req.temperature,
            top_p=g.top_p if req.top_p is None else req.top_p,
            top_k=g.top_k if req.top_k is None else req.top_k,
            stop_token_ids=stop_ids,
            seed=req.choice_seed(index) if req.seed is not None else g.seed,
        )

    def _record(self, req, cid, index, prompt_text, prompt_ids, resp: ModelResponse, parser):
        finish = "length" if resp.stop_reason == "length" else "stop"
        choice, kept = build_choice(
            self.tokenizer, req, index, resp.output_tokens, resp.output_logprobs, finish, parser
        )
        self.tree.add(
            Interaction(
                completion_id=cid,
                choice_index=index,
                messages=req.messages,
                tools=req.tools,
                prompt_text=prompt_text,
                prompt_ids=list(prompt_ids),
                output_ids=resp.output_tokens[:kept],
                output_logprobs=resp.output_logprobs[:kept],
                output_versions=resp.output_versions[:kept],
                stop_reason=resp.stop_reason if kept == len(resp.output_tokens) else "stop",
                message=choice["message"],
            )
        )
        return choice, kept

    # ---- prompts ----------------------------------------------------------------------------
    def _prompt(self, req: ChatRequest) -> tuple[str, list[int]]:
        text = render_prompt(self.tokenizer, req, **self.template_kwargs)
        parent = self._continued(req)
        if parent is not None:
            ids = self._extend(parent, text)
            if ids is not None:
                return text, ids
        return text, encode_text(self.tokenizer, text)

    def _continued(self, req: ChatRequest) -> Interaction | None:
        """The latest interaction whose messages + returned assistant message start `req`."""
        for it in reversed(self.interactions):
            k = len(it.messages)
            if (
                len(req.messages) > k + 1
                and it.tools == req.tools
                and req.messages[:k] == it.messages
                and _same_assistant_turn(req.messages[k], normalize_message(it.message, k))
            ):
                return it
        return None

    def _extend(self, parent: Interaction, text: str) -> list[int] | None:
        """parent prompt + output tokens (+ EOS if the model did not end its turn) + the tokens
        of whatever the template renders after that assistant turn; None if the template
        rewrote the parent's prompt."""
        eos = self.tokenizer.eos_token
        if not text.startswith(parent.prompt_text):
            return None
        cut = text.find(eos, len(parent.prompt_text))
        if cut < 0:
            return None
        head = parent.prompt_ids + parent.output_ids
        if parent.output_ids[-1:] != [self.tokenizer.eos_token_id]:
            head = head + [self.tokenizer.eos_token_id]
        return head + encode_text(self.tokenizer, text[cut + len(eos) :])
