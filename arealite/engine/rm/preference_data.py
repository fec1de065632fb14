"""Preference pairs for reward-model training.

A row is `{"prompt": str | "messages": [...], "chosen": str, "rejected": str}` (jsonl). Each
becomes ONE training row `prompt ++ chosen ++ EOS ++ prompt ++ rejected ++ EOS` cut at
`chosen_len` (see reward_model.py), the prompt chat-templated as the policy would see it.

`arith_preferences` writes the synthetic task offline: for an expression "a+b", the correct
sum is chosen and a wrong one (off by 1..9) rejected; train and held-out rows never share an
expression (split by a fixed hash, like the arithmetic RL task).
"""

from __future__ import annotations

import hashlib
import json
import random
from typing import Any

import torch

from arealite.api.rm_config import (  # noqa: F401  the row format is the contract; re-exported
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
    """One `chosen ++ rejected` training row with its cut point."""
    p = prompt_ids(tokenizer, row)
    chosen = p + completion_ids(tokenizer, row["chosen"])
    rejected = p + completion_ids(tokenizer, row["rejected"])
    return {
        "input_ids": torch.tensor(chosen + rejected),
        "chosen_len": torch.tensor(len(chosen)),
    }


def collate_pairs(tokenizer: Any, rows: list[dict]) -> Any:
    """A padded pair batch (TensorDict) for FSDPRewardModel.train_rm / evaluate_rm."""
    return pad_sequences_to_tensors([pair_row(tokenizer, r) for r in rows])


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
) -> list[dict[str, str]]:
    """`n` preference rows on "a+b=": the correct sum chosen, a wrong one (off by
    `offsets` = (min, max) in either direction) rejected.

    test_fraction > 0 holds out whole expressions (generalising the sum, which a randomly
    initialised tiny model does not learn in minutes); test_fraction = 0 draws both splits from
    all expressions with different seeds (held-out pairs, seen expressions)."""
    rng = random.Random(f"{seed}-{split}")
    held_out = split != "train"
    hi = 10**max_digits - 1
    rows = []
    while len(rows) < n:
        a, b = rng.randint(0, hi), rng.randint(0, hi)
        expr = f"{a}+{b}"
        if test_fraction > 0 and _held_out(expr, test_fraction) != held_out:
            continue
        lo, hi_off = offsets
        deltas = [d for d in range(-hi_off, hi_off + 1) if abs(d) >= lo and a + b + d >= 0]
        wrong = a + b + rng.choice(deltas)
        rows.append({"prompt": f"{expr}=", "chosen": str(a + b), "rejected": str(wrong)})
    return rows


def write_jsonl(rows: list[dict], path: str) -> None:
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
