"""Preference pairs for reward-model training.

A row is `{"prompt": str | "messages": [...], "chosen": str, "rejected": str}` (jsonl). Each
becomes ONE training row `prompt ++ chosen ++ EOS ++ prompt ++ rejected ++ EOS` cut at
`chosen_len` (see reward_model.py), the prompt chat-templated as the policy would see it.

`arith_preferences` writes the synthetic task offline: for an expression "a+b" (or "a+b+c",
`n_operands`), the correct sum is chosen and a wrong one (off by `offsets`) rejected; train and
held-out rows never share an expression (the arithmetic RL task's hash split, so an RM's held-out
expressions are the policy's). `with_sampled_negatives` swaps in the policy's OWN wrong answers
(sampled from a model, labelled by an exact verifier): an RM that has seen only synthetic
mistakes is gamed by the mistakes the policy actually makes.
"""

from __future__ import annotations

import hashlib
import json
import random
from typing import Any

import torch

from arealite.api.rm_config import (  # noqa: F401  the row format is the contract; re-exported
    ARITH_PREFERENCE_OPTIONS,
    PAIR_FIELDS,
    PreferenceFormatError,
    check_preference_row,
    read_preference_rows,
)
from arealite.utils.data import pad_sequences_to_tensors


def prompt_ids(tokenizer: Any, row: dict) -> list[int]:
    """The chat-templated prompt ids, ending with the assistant header."""
    messages = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def completion_ids(tokenizer: Any, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def pair_row(tokenizer: Any, row: dict) -> dict[str, torch.Tensor]:
    """One `chosen ++ rejected` training row with its cut point; `loss_mask` marks the two
    responses (answer ++ EOS), and the reference's scores travel along when the row has them
    (the implicit head reads both; the scalar head ignores them)."""
    p = prompt_ids(tokenizer, row)
    chosen_resp = completion_ids(tokenizer, row["chosen"])
    rejected_resp = completion_ids(tokenizer, row["rejected"])
    mask = [0] * len(p) + [1] * len(chosen_resp) + [0] * len(p) + [1] * len(rejected_resp)
    out = {
        "input_ids": torch.tensor(p + chosen_resp + p + rejected_resp),
        "chosen_len": torch.tensor(len(p) + len(chosen_resp)),
        "loss_mask": torch.tensor(mask),
    }
    for key in ("ref_chosen", "ref_rejected"):
        if key in row:
            out[key] = torch.tensor(float(row[key]))
    return out


def collate_pairs(tokenizer: Any, rows: list[dict]) -> Any:
    """A padded pair batch (TensorDict) for FSDPRewardModel.train_rm / evaluate_rm."""
    return pad_sequences_to_tensors([pair_row(tokenizer, r) for r in rows])


@torch.no_grad()
def response_logprob_sums(
    model: Any, seqs: list[tuple[list[int], int]], batch: int = 64
) -> list[float]:
    """sum_t log p(ids[t] | ids[:t]) over t >= n_prompt, for each (ids, n_prompt), under an HF
    causal LM (right-padded batches; fp32)."""
    out = []
    for start in range(0, len(seqs), batch):
        chunk = seqs[start : start + batch]
        L = max(len(ids) for ids, _ in chunk)
        ids = torch.zeros(len(chunk), L, dtype=torch.long)
        attn = torch.zeros(len(chunk), L, dtype=torch.long)
        resp = torch.zeros(len(chunk), L)
        for i, (s, n_prompt) in enumerate(chunk):
            ids[i, : len(s)], attn[i, : len(s)], resp[i, n_prompt : len(s)] = torch.tensor(s), 1, 1
        logits = model(input_ids=ids, attention_mask=attn).logits.float()
        logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
        out += (logp * resp[:, 1:]).sum(-1).tolist()
    return out


def with_reference_scores(rows: list[dict], reference: str, tokenizer: Any) -> list[dict]:
    """`rows` with `ref_chosen` / `ref_rejected`: the frozen reference model's summed response
    logprobs, computed once (the implicit head's r = beta * (policy sum - reference sum))."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    seqs = []
    for row in rows:
        p = prompt_ids(tokenizer, row)
        seqs += [(p + completion_ids(tokenizer, row[k]), len(p)) for k in PAIR_FIELDS]
    sums = response_logprob_sums(model, seqs)
    return [
        {**row, "ref_chosen": sums[2 * i], "ref_rejected": sums[2 * i + 1]}
        for i, row in enumerate(rows)
    ]


def _held_out(expression: str, test_fraction: float) -> bool:
    h = int.from_bytes(hashlib.blake2b(expression.encode(), digest_size=8).digest(), "big")
    return h % 10_000 < test_fraction * 10_000


def arith_preferences(
    n: int,
    split: str = "train",
    seed: int = 0,
    max_digits: int = 1,
    test_fraction: float = 0.2,
    offsets: tuple[int, int] = (1, 9),
    n_operands: int = 2,
) -> list[dict[str, str]]:
    """`n` preference rows on "a+b=" (`n_operands` terms): the correct sum chosen, a wrong one
    (off by `offsets` = (min, max) in either direction) rejected. Rows carry `answer`.

    test_fraction > 0 holds out whole expressions (generalising the sum, which a randomly
    initialised tiny model does not learn in minutes); test_fraction = 0 draws both splits from
    all expressions with different seeds (held-out pairs, seen expressions)."""
    if n_operands < 2 or not 1 <= offsets[0] <= offsets[1]:
        raise ValueError(
            f"n_operands must be >= 2 and 1 <= min_offset <= max_offset, got "
            f"n_operands={n_operands}, offsets={offsets}"
        )
    rng = random.Random(f"{seed}-{split}")
    held_out = split != "train"
    hi = 10**max_digits - 1
    rows = []
    while len(rows) < n:
        terms = [rng.randint(0, hi) for _ in range(n_operands)]
        expr, total = "+".join(map(str, terms)), sum(terms)
        if test_fraction > 0 and _held_out(expr, test_fraction) != held_out:
            continue
        lo, hi_off = offsets
        deltas = [d for d in range(-hi_off, hi_off + 1) if abs(d) >= lo and total + d >= 0]
        wrong = total + rng.choice(deltas)
        rows.append(
            {
                "prompt": f"{expr}=",
                "chosen": str(total),
                "rejected": str(wrong),
                "answer": str(total),
            }
        )
    return rows


@torch.no_grad()
def sample_answers(
    model: Any, tokenizer: Any, prompts: list[str], n_samples: int, max_new_tokens: int = 8
) -> list[list[str]]:
    """`n_samples` answers per prompt, sampled at temperature 1 (as GRPO's rollouts are), in
    batches of equal-length prompts (no padding to get wrong)."""
    by_len: dict[int, list[int]] = {}
    ids = [prompt_ids(tokenizer, {"prompt": p}) for p in prompts]
    for i, p in enumerate(ids):
        by_len.setdefault(len(p), []).append(i)
    out: list[list[str]] = [[] for _ in prompts]
    eos = tokenizer.eos_token_id
    for idx in by_len.values():
        for start in range(0, len(idx), 256):
            chunk = idx[start : start + 256]
            batch = torch.tensor([ids[i] for i in chunk])
            gen = model.generate(
                batch,
                attention_mask=torch.ones_like(batch),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=max_new_tokens,
                num_return_sequences=n_samples,
                eos_token_id=eos,
                pad_token_id=eos,
            )
            for j, seq in enumerate(gen[:, batch.shape[1] :].tolist()):
                seq = seq[: seq.index(eos)] if eos in seq else seq
                out[chunk[j // n_samples]].append(tokenizer.decode(seq, skip_special_tokens=True))
    return out


def with_sampled_negatives(
    rows: list[dict],
    model: Any,
    tokenizer: Any,
    is_correct: Any,
    n_samples: int = 4,
    fraction: float = 1.0,
) -> tuple[list[dict], float]:
    """`rows` with `rejected` replaced by one of the model's own WRONG sampled answers to the
    same prompt (`is_correct(answer_text, row)` is the exact verifier), in a random `fraction`
    of the rows; the others, and rows whose samples were all right, keep their synthetic
    rejected answer. Returns (rows, fraction replaced)."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"sampled_negatives_fraction must be in [0, 1], got {fraction}")
    rng = random.Random(0)
    chosen = [i for i in range(len(rows)) if rng.random() < fraction]
    prompts = [rows[i]["prompt"] for i in chosen]
    samples = dict(zip(chosen, sample_answers(model, tokenizer, prompts, n_samples)))
    out, replaced = [], 0
    for i, row in enumerate(rows):
        wrong = [a for a in samples.get(i, []) if not is_correct(a, row)]  # empty answers too
        if wrong:
            row, replaced = {**row, "rejected": rng.choice(wrong)}, replaced + 1
        out.append(row)
    return out, replaced / max(len(rows), 1)


def write_jsonl(rows: list[dict], path: str) -> None:
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def arith_preferences_from_options(
    options: dict, split: str, is_correct: Any = None
) -> tuple[list[dict], float]:
    """The built-in preference rows of a dataset config's `options`, checked (an unknown key
    fails naming it). `sampled_negatives_from: <model dir>` (e.g. the SFT checkpoint the policy
    starts from) swaps in that model's own wrong answers, labelled by `is_correct`. Returns
    (rows, fraction of rows with a sampled negative)."""
    unknown = sorted(set(options) - set(ARITH_PREFERENCE_OPTIONS))
    if unknown:
        allowed = sorted(ARITH_PREFERENCE_OPTIONS)
        raise ValueError(f"arith_preferences: unknown option(s) {unknown}; allowed: {allowed}")
    o = {**ARITH_PREFERENCE_OPTIONS, **options}
    rows = arith_preferences(
        int(o["size"]),
        split,
        int(o["seed"]),
        int(o["max_digits"]),
        float(o["test_fraction"]),
        (int(o["min_offset"]), int(o["max_offset"])),
        int(o["n_operands"]),
    )
    if not o["sampled_negatives_from"]:
        return rows, 0.0
    if is_correct is None:
        raise ValueError("arith_preferences: sampled_negatives_from needs an exact verifier")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = str(o["sampled_negatives_from"])
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(o["seed"]) + (split != "train"))  # the same rows on every rank
        return with_sampled_negatives(
            rows,
            model,
            AutoTokenizer.from_pretrained(path),
            is_correct,
            int(o["sampled_negatives_n"]),
            float(o["sampled_negatives_fraction"]),
        )
