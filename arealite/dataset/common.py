"""Row building blocks shared by the datasets: field checks, chat prompts, SFT rows, filters.

Every dataset yields the same two row shapes, so the workflows and trainers never care where the
data came from:
  RL:  {"messages": [{"role": "user", "content": ...}], "answer": str, "query_id": str}
  SFT: {"input_ids": list[int], "loss_mask": list[int]}   (loss only on the answer and EOS)
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger("arealite.dataset")


class DatasetFormatError(ValueError):
    """A source row lacks a field the task needs (the message names the row and the field)."""


def require_fields(row: dict, index: int, fields: Sequence[str], source: str) -> None:
    for f in fields:
        if row.get(f) is None:
            raise DatasetFormatError(
                f"{source}: row {index} is missing field {f!r} "
                f"(its fields: {sorted(k for k, v in row.items() if v is not None)})"
            )


def chat_prompt_ids(tokenizer: Any, messages: list[dict]) -> list[int]:
    """Token ids of the chat-templated prompt, ending with the assistant header."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def sft_row(tokenizer: Any, messages: list[dict], answer_text: str) -> dict[str, list[int]]:
    """Prompt + answer + EOS, with loss on the answer and EOS only.

    Prompt and answer are tokenized separately so the mask boundary is exact (no BPE merge
    across it); the answer then ends with EOS so the model learns to stop.
    """
    if tokenizer.eos_token_id is None:
        raise ValueError("SFT rows need a tokenizer with an eos_token")
    prompt = chat_prompt_ids(tokenizer, messages)
    answer = tokenizer(answer_text, add_special_tokens=False)["input_ids"]
    answer = answer + [tokenizer.eos_token_id]
    return {"input_ids": prompt + answer, "loss_mask": [0] * len(prompt) + [1] * len(answer)}


def map_rows(raw: Any, fn: Any, fn_kwargs: dict) -> Any:
    """`raw.map(fn)` (with row indices, for errors that name the row) into the canonical columns
    alone; kept in memory and never read from the datasets cache, where a task edited since
    would silently win."""
    return raw.map(
        fn,
        with_indices=True,
        fn_kwargs=fn_kwargs,
        remove_columns=raw.column_names,
        keep_in_memory=True,
        load_from_cache_file=False,
    )


def drop_long_rows(
    ds: Any, max_length: int | None, type: str, tokenizer: Any, name: str, on_long: str = "drop"
) -> Any:
    """Drop rows longer than `max_length` tokens (RL: the prompt; SFT: the whole sequence,
    which is what gets trained on), and log how many went; `on_long="fail"` raises instead,
    naming the first such row."""
    if max_length is None:
        return ds
    if on_long not in ("drop", "fail"):
        raise ValueError(f"on_long must be 'drop' or 'fail', got {on_long!r}")
    if type == "sft":
        kept = ds.filter(lambda r: len(r["input_ids"]) <= max_length, keep_in_memory=True)
    else:
        if tokenizer is None:
            raise ValueError("max_length needs a tokenizer to measure RL prompts")
        kept = ds.filter(
            lambda r: len(chat_prompt_ids(tokenizer, r["messages"])) <= max_length,
            keep_in_memory=True,
        )
    n_dropped = len(ds) - len(kept)
    if n_dropped and on_long == "fail":
        lengths = (
            [len(r["input_ids"]) for r in ds]
            if type == "sft"
            else [len(chat_prompt_ids(tokenizer, r["messages"])) for r in ds]
        )
        first = next(i for i, n in enumerate(lengths) if n > max_length)
        raise DatasetFormatError(
            f"{name}: row {first} has {lengths[first]} tokens, over max_length={max_length} "
            f"({n_dropped} rows in all; set too_long=drop to skip them)"
        )
    if n_dropped:
        logger.warning(
            "%s: dropped %d of %d rows longer than max_length=%d tokens",
            name,
            n_dropped,
            len(ds),
            max_length,
        )
    return kept
