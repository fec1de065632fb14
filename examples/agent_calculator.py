"""A tool-using agent trained in process: 2-digit arithmetic (`47*28=`) that a tiny model
cannot compute, but can answer by calling a `calc` tool and copying its result.

The agent (`solve`) is written against the `openai` SDK's interface and runs on arealite's
`TrainingOpenAIClient` through `AgentWorkflow` (no HTTP). Two phases:

    python examples/agent_calculator.py sft --base <tiny model> --out <dir> [--steps N]
    python -m arealite.launcher.local examples/agent_calculator.py \
        --config examples/configs/agent_calculator.yaml actor.path=<dir>

`sft` writes synthetic tool traces by running the same agent against a scripted teacher (so the
tokens are exactly those the client builds during RL) and fits them briefly (stopped early on
purpose, so GRPO has room to improve); the second command is GRPO (`grpo.py`'s loop) on the
agent. Held-out success is the greedy agent's final answer.

What makes it learnable by the ~2.7M-parameter demo model (see README, Agents): digits at fixed
offsets (`fixed_width`) and the tool protocol's fixed text as single tokens (PROTOCOL_TOKENS),
so that every digit the agent copies (question -> call, tool result -> answer) sits exactly 12
tokens back: the tiny model learns that one positional copy in ~50 batches.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import re
import shutil
import sys

# A compact schema: the tiny model copies the call's JSON token by token, so short names help.
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "integers with + - *",
        "parameters": {
            "type": "object",
            "properties": {"expr": {"type": "string"}},
            "required": ["expr"],
        },
    },
}
# The call's fixed text around the expression, and the tool-response tags, one token each (as
# Qwen's tokenizers have `<tool_call>` as one token; the tiny tokenizer spells all of it letter
# by letter). The digits to copy then sit 12 tokens back in both copies (question -> call, tool
# result -> answer) instead of 56 and 24: one short, fixed offset the tiny model learns fast.
CALL_OPEN = '<tool_call>\n{"name": "calc", "arguments": {"expr": "'
PROTOCOL_TOKENS = [CALL_OPEN, '"}}\n</tool_call>', "<tool_response>", "</tool_response>"]
TASK = dict(max_digits=2, n_operands=2, ops="+*")  # keep in step with agent_calculator.yaml
RESULT_DIGITS = 4  # 99*99 = 9801
_EXPRESSION = re.compile(r"\s*\d+(\s*[-+*]\s*\d+)*\s*")


def calculator(expression: str) -> str:
    """The tool: integers with + - * only (never `eval` of arbitrary text). The result has a
    sign and RESULT_DIGITS digits (`+0075`), see `fixed_width`."""
    if not isinstance(expression, str) or not _EXPRESSION.fullmatch(expression):
        return "error: expected integers joined by + - *"
    tokens = re.findall(r"\d+|[-+*]", expression)
    terms, sign, term = [], 1, int(tokens[0])
    for op, num in zip(tokens[1::2], tokens[2::2]):
        if op == "*":
            term *= int(num)
        else:
            terms.append(sign * term)
            sign, term = (1 if op == "+" else -1), int(num)
    return f"{sum(terms) + sign * term:+0{RESULT_DIGITS + 1}d}"


def fixed_width(question: str) -> str:
    """`7+61=` -> `07+61=`. The tiny model has no induction heads to copy digits by content;
    it learns to copy them by position, which needs each digit at a fixed offset: operands
    (and the tool's results) are written at a fixed width."""
    return re.sub(r"\d+", lambda m: m.group().zfill(TASK["max_digits"]), question)


def last_integer(text: str | None) -> int | None:
    found = re.findall(r"-?\d+", text or "")
    return int(found[-1]) if found else None


async def solve(client, row: dict, partial_credit: bool = False) -> float:
    """Ask with the calculator available; run the tool calls; 1.0 if the final answer is right.
    With `partial_credit` (training only) a wrong answer earns up to 0.5 for the digits it
    copied right (question -> call, tool result -> answer): a denser signal for GRPO."""
    question = fixed_width(row["messages"][-1]["content"])
    messages = [{"role": "user", "content": question}]
    copied = []  # (what should have been copied, what was written)
    for _ in range(2):  # a tool round, then the answer
        r = await client.chat.completions.create(
            model="policy", messages=messages, tools=[CALCULATOR]
        )
        msg = r.choices[0].message
        if not msg.tool_calls:
            if last_integer(msg.content) == int(row["answer"]):
                return 1.0
            copied.append((messages[-1]["content"], msg.content or ""))
            return _copy_credit(copied) if partial_credit else 0.0
        messages.append(msg)
        for call in msg.tool_calls:
            try:
                expression = json.loads(call.function.arguments).get("expr")
            except (json.JSONDecodeError, AttributeError):
                expression = None
            copied.append((question.rstrip("="), str(expression or "")))
            messages.append(
                {"role": "tool", "tool_call_id": call.id, "content": calculator(expression)}
            )
    return _copy_credit(copied) if partial_credit else 0.0


def _copy_credit(copied: list[tuple[str, str]]) -> float:
    """0.25 per copy (at most two): the fraction of characters in the right place."""
    return sum(
        0.25 * sum(a == b for a, b in zip(want, got)) / max(len(want), len(got))
        for want, got in copied[:2]
    )


# ---- SFT warm start ---------------------------------------------------------------------------
class ScriptedTeacher:
    """An engine that answers like a perfect agent: a calculator call for the question, then
    the tool's result. Running `solve` on it through a TrainingOpenAIClient gives traces
    tokenized exactly as the client tokenizes them during RL."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    async def agenerate(self, req):
        from arealite.api.io_struct import ModelResponse

        text = self.tokenizer.decode(req.input_ids)
        last_user = text.rsplit("<|im_start|>user\n", 1)[-1]
        if "<tool_response>" in last_user:
            reply = last_user.split("<tool_response>\n", 1)[1].split("\n</tool_response>")[0]
        else:
            question = last_user.split("<|im_end|>")[0].rstrip("=")
            arguments = json.dumps({"expr": question})
            reply = f'<tool_call>\n{{"name": "calc", "arguments": {arguments}}}\n</tool_call>'
        ids = self.tokenizer.encode(reply, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        return ModelResponse(
            input_tokens=list(req.input_ids),
            output_tokens=ids,
            output_logprobs=[0.0] * len(ids),
            output_versions=[0] * len(ids),
        )


def without_system_turn(trace: tuple[list[int], list[int]], im_end: int):
    """The copy drill's sample: a trace cut after its system turn (the tool schemas). The
    digits keep their distances (what a position-based copy needs) in a 4x shorter context,
    where the tiny model finds the copy much sooner than behind the schemas."""
    ids, mask = trace
    start = ids.index(im_end) + 2  # `<|im_end|>\n`
    return ids[start:], mask[start:]


def tool_traces(tokenizer, rows: list[dict], agent=solve) -> list[tuple[list[int], list[int]]]:
    """(input_ids, loss_mask) of the teacher's conversation with `agent` on each row."""
    from arealite.agent import TrainingOpenAIClient
    from arealite.api.io_struct import GenerationHyperparameters

    async def one(row):
        client = TrainingOpenAIClient(
            ScriptedTeacher(tokenizer), tokenizer, GenerationHyperparameters(max_new_tokens=64)
        )
        assert await agent(client, row) == 1.0, row
        td = client.export_samples("concat")
        n = int(td["attention_mask"][0].sum())
        return td["input_ids"][0, :n].tolist(), td["loss_mask"][0, :n].tolist()

    async def all_rows():
        return await asyncio.gather(*(one(r) for r in rows))

    return asyncio.run(all_rows())


def trace_loss(model, batch: list[tuple[list[int], list[int]]], pad_id: int):
    """Mean loss over the model's tokens of a batch of traces. Every trace starts with the same
    system turn (the tool schemas, about 2/3 of its tokens), so that shared prefix is run once
    and its keys/values are broadcast to the batch: the same loss and gradients as padding the
    full traces, at about a third of the cost."""
    import torch

    first = batch[0][0]
    shared = min(
        next((i for i, (a, b) in enumerate(zip(first, ids)) if a != b), len(ids))
        for ids, _ in batch
    )
    shared = min(shared, *(mask.index(1) - 1 for _, mask in batch))  # no trained token in it
    cache = model(input_ids=torch.tensor([first[:shared]]), use_cache=True).past_key_values
    for layer in cache.layers:
        layer.keys = layer.keys.expand(len(batch), -1, -1, -1)
        layer.values = layer.values.expand(len(batch), -1, -1, -1)
    width = max(len(ids) for ids, _ in batch) - shared
    ids = torch.full((len(batch), width), pad_id)
    labels = torch.full((len(batch), width), -100)
    for i, (x, mask) in enumerate(batch):  # right padding: causal attention never sees it
        x, mask = torch.tensor(x[shared:]), torch.tensor(mask[shared:]).bool()
        ids[i, : len(x)] = x
        labels[i, : len(x)] = torch.where(mask, x, -100)
    positions = torch.arange(shared, shared + width).expand(len(batch), -1)
    return model(input_ids=ids, position_ids=positions, past_key_values=cache, labels=labels).loss


def tool_model_dir(base: str, out: str):
    """Copy `base` to `out` with the tool-aware chat template and PROTOCOL_TOKENS added to its
    tokenizer; returns the tokenizer (the model's embeddings are resized when it is loaded)."""
    from transformers import AutoTokenizer

    from arealite.agent import install_chat_template

    shutil.copytree(base, out, dirs_exist_ok=True)
    install_chat_template(out)
    tok = AutoTokenizer.from_pretrained(out)
    tok.add_tokens(PROTOCOL_TOKENS)
    tok.save_pretrained(out)
    return AutoTokenizer.from_pretrained(out)


def sft(a: argparse.Namespace) -> None:
    """Two stages on teacher traces: `a.copy_steps` batches of the copy drill (the traces
    without their system turn: the model learns to copy the digits at the traces' distances),
    then `a.steps` batches of full traces at a lower lr (the copy carries over to the
    longer context). Stopped early on purpose, so GRPO has room to improve."""
    import torch
    from transformers import AutoModelForCausalLM

    from arealite.tasks.arith import generate_arith_problems

    tok = tool_model_dir(a.base, a.out)

    def rows(n: int, seed: int) -> list[dict]:
        return [
            {"messages": [{"role": "user", "content": f"{e}="}], "answer": str(v)}
            for e, v in generate_arith_problems(n, seed, "train", **TASK)
        ]

    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    drills = [
        without_system_turn(t, im_end)
        for t in tool_traces(tok, rows(a.copy_steps * a.copy_batch_size, a.seed + 1))
    ]
    traces = tool_traces(tok, rows(a.steps * a.batch_size, a.seed))
    torch.manual_seed(a.seed)
    model = AutoModelForCausalLM.from_pretrained(a.out, dtype=torch.float32)
    model.resize_token_embeddings(len(tok))
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
    for step in range(a.copy_steps):
        for group in opt.param_groups:  # a short warmup: the full lr at once diverged
            group["lr"] = a.lr * min(1.0, (step + 1) / 30)
        batch = drills[step * a.copy_batch_size : (step + 1) * a.copy_batch_size]
        _sgd_step(opt, trace_loss(model, batch, tok.pad_token_id), "copy drill", step, a.copy_steps)
    for group in opt.param_groups:
        group["lr"] = a.trace_lr
    for step in range(a.steps):
        batch = traces[step * a.batch_size : (step + 1) * a.batch_size]
        _sgd_step(opt, trace_loss(model, batch, tok.pad_token_id), "tool traces", step, a.steps)
    model.save_pretrained(a.out, safe_serialization=True)
    print(f"tool-trace SFT model: {a.out}", flush=True)


def _sgd_step(opt, loss, stage: str, step: int, steps: int) -> None:
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step % 20 == 0 or step == steps - 1:
        print(f"sft {stage} step {step + 1}/{steps} loss {loss.item():.4f}", flush=True)


# ---- GRPO -------------------------------------------------------------------------------------
def make_workflow(reward_fn, gconfig, tokenizer, **_):
    """The loop's workflow factory: greedy evaluation scores exact answers only; training runs
    earn partial credit."""
    from arealite.agent import AgentWorkflow

    agent = solve if gconfig.greedy else functools.partial(solve, partial_credit=True)
    return AgentWorkflow(agent, tokenizer, gconfig, export_style="concat")


def main() -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    if sys.argv[1:2] == ["sft"]:
        p = argparse.ArgumentParser(description="SFT warm start on synthetic tool traces")
        p.add_argument("phase")
        p.add_argument("--base", required=True, help="model dir (e.g. the tiny model)")
        p.add_argument("--out", required=True, help="where the warm-started model goes")
        p.add_argument("--copy-steps", type=int, default=42, help="copy-drill batches")
        p.add_argument("--copy-batch-size", type=int, default=32)
        p.add_argument("--steps", type=int, default=1, help="tool-trace batches")
        p.add_argument("--batch-size", type=int, default=16)
        p.add_argument("--lr", type=float, default=3e-3, help="copy-drill lr")
        p.add_argument("--trace-lr", type=float, default=1e-3, help="tool-trace lr")
        p.add_argument("--seed", type=int, default=1)
        a = p.parse_args()
        sft(a)
        return
    from grpo import main as grpo_main  # the GRPO loop; this folder is on sys.path

    grpo_main(sys.argv[1:], workflow_cls=make_workflow)


if __name__ == "__main__":
    main()
