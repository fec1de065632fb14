"""Where a long_sums model is right, by term count m: greedy accuracy on the held-out problems
and the reward at the sampling temperature (what GRPO's groups see), per m; and how much of
that reward is earned by right work (every scratchpad line right) rather than by luck.

A held-out accuracy alone hides which problems it comes from: the first warm start's 23.5% was
m = 1 alone (79% there, 0% for m = 2-8), a model that had never learned when to stop. This prints
the table that showed it, for any checkpoint:

    python bench/long_sums_by_length.py MODEL_DIR [--samples 8] [--temperature 1.0] [--size 200]

(`--samples 0`: greedy only.) Plain HF `generate`, fp32, sampling with top-k and top-p off, as
the embedded server samples. "lucky": rewarded answers whose work has a wrong line - the reward
checks the final number only, and an approximate adder's errors can cancel; where most rewarded
answers are lucky, GRPO reinforces wrong arithmetic as often as right.
"""

from __future__ import annotations

import argparse
import collections
import statistics
from typing import NamedTuple

import torch
from bench_io import emit, emit_machine
from transformers import AutoModelForCausalLM, AutoTokenizer

from arealite.tasks.arith import last_integer
from arealite.tasks.long_sums import generate_problems, prompt_text, scratchpad


def left_padded(tokenizer, problems) -> tuple[torch.Tensor, torch.Tensor]:
    """Chat-templated prompts, left-padded into one batch, and their attention mask."""
    ids = []
    for p in problems:
        chat = [{"role": "user", "content": prompt_text(*p)}]
        out = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        ids.append(list(out["input_ids"] if not isinstance(out, list) else out))
    width = max(map(len, ids))
    pad = tokenizer.pad_token_id
    batch = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
    return batch, mask


class Answer(NamedTuple):
    reward: float  # the final number is right
    work: bool  # the whole answer is the worked scratchpad, every line right


def grade(text: str, start: int, digit: int, terms: int) -> Answer:
    """The reward (final number) and whether the work is the worked scratchpad line by line (the
    recipe's count-down pad)."""
    reward = float(last_integer(text) == start + digit * terms)
    return Answer(reward, text.strip() == scratchpad(start, digit, terms))


def correct_by_terms(model, tokenizer, problems, samples: int, temperature: float) -> dict:
    """{m: [Answer per answer]}; samples 0 = one greedy answer per problem."""
    hits: dict[int, list[Answer]] = collections.defaultdict(list)
    n = max(samples, 1)
    for i in range(0, len(problems), 50):
        chunk = problems[i : i + 50]
        batch, mask = left_padded(tokenizer, chunk)
        # top_k 0 / top_p 1: no truncation (transformers' default top_k is 50)
        sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        with torch.no_grad():
            out = model.generate(
                batch,
                attention_mask=mask,
                max_new_tokens=320,
                num_return_sequences=n,
                pad_token_id=tokenizer.pad_token_id,
                **(sampling if samples else {"do_sample": False}),
            )
        for j, seq in enumerate(out):
            start, digit, terms = chunk[j // n]
            text = tokenizer.decode(seq[batch.shape[1] :], skip_special_tokens=True)
            hits[terms].append(grade(text, start, digit, terms))
    return hits


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model")
    p.add_argument("--samples", type=int, default=8, help="per problem at --temperature; 0: none")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--size", type=int, default=200, help="held-out problems (the configs': 200)")
    args = p.parse_args()
    emit_machine()
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    problems = generate_problems(args.size, 0, "test")
    greedy = correct_by_terms(model, tokenizer, problems, 0, 0.0)
    sampled = (
        correct_by_terms(model, tokenizer, problems, args.samples, args.temperature)
        if args.samples
        else {}
    )
    print("| m | problems | greedy | greedy, right work | reward at T | lucky share at T |")
    print("|---|---|---|---|---|---|")
    for m in sorted(greedy):
        row = summarize(greedy[m], sampled.get(m, []))
        print(f"| {m} | {len(greedy[m])} | " + " | ".join(_cell(v) for v in row.values()) + " |")
        emit("by_terms", terms=m, problems=len(greedy[m]), **row)
    every = [a for answers in greedy.values() for a in answers]
    drawn = [a for answers in sampled.values() for a in answers]
    emit("all", problems=len(every), **summarize(every, drawn))


def summarize(greedy: list[Answer], sampled: list[Answer]) -> dict:
    """Greedy accuracy (and with right work), reward at T and its lucky share."""
    rewarded = [a for a in sampled if a.reward]
    return {
        "greedy": statistics.mean(a.reward for a in greedy),
        "greedy_right_work": statistics.mean(a.reward * a.work for a in greedy),
        "sampled": statistics.mean(a.reward for a in sampled) if sampled else None,
        "lucky_share": sum(not a.work for a in rewarded) / len(rewarded) if rewarded else None,
    }


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


if __name__ == "__main__":
    main()
