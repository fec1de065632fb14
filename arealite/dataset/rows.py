"""Canonical rows out of any table: what RL and SFT need, whatever the file looked like.

RL rows: `messages` (a chat list) or `prompt` (a string, made into one user message through an
optional `prompt_template` such as "{prompt}\\nPut the final answer in \\\\boxed{{}}."); every
other column (`answer`, `images`, the user's own) stays on the row and reaches the reward
function as a keyword argument, and a column renamed by `columns:` arrives under both names
(`answer` and the user's `solution`). A trailing assistant turn of `messages` is dropped (RL samples
the answer itself). SFT rows: `messages` with the loss on every assistant turn, or `prompt` +
`completion` with the loss on the completion and EOS.
"""

from __future__ import annotations

from typing import Any

from arealite.dataset.common import DatasetFormatError, sft_row


def _user_prompt(row: dict, index: int, template: str | None, source: str) -> list[dict]:
    prompt = row.get("prompt")
    if not isinstance(prompt, str):
        raise DatasetFormatError(
            f"{source}: row {index} column 'prompt' must be a string, got {type(prompt).__name__}"
        )
    if template:
        try:
            prompt = template.format(**row)
        except (KeyError, IndexError, ValueError) as e:
            raise DatasetFormatError(
                f"{source}: row {index}: prompt_template {template!r} failed ({e!r}); it may "
                "use the row's columns as {name} and must write literal braces as {{ }}"
            ) from None
    return [{"role": "user", "content": prompt}]


def _checked_messages(row: dict, index: int, source: str) -> list[dict]:
    messages = row.get("messages")
    if not isinstance(messages, list) or not messages:
        raise DatasetFormatError(
            f"{source}: row {index} column 'messages' must be a non-empty list of "
            "{role, content} dicts"
        )
    for turn, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise DatasetFormatError(
                f"{source}: row {index} column 'messages' turn {turn} needs 'role' and 'content'"
            )
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def prompt_messages(row: dict, index: int, template: str | None, source: str) -> list[dict]:
    """The chat the policy answers: `messages` (minus a final assistant turn) or `prompt`."""
    if row.get("messages") is not None:
        messages = _checked_messages(row, index, source)
        while messages and messages[-1]["role"] == "assistant":
            messages = messages[:-1]
        if not messages:
            raise DatasetFormatError(f"{source}: row {index} 'messages' has no prompt turn")
        return messages
    if row.get("prompt") is not None:
        return _user_prompt(row, index, template, source)
    raise DatasetFormatError(
        f"{source}: row {index} has neither 'messages' nor 'prompt' (its columns: "
        f"{sorted(row)}); map yours with columns: {{prompt: <your column>}}"
    )


def rl_row(
    row: dict,
    index: int,
    template: str | None,
    source: str,
    id_prefix: str,
    aliases: dict[str, str] | None = None,
) -> dict:
    """messages + every other column; a `query_id` unless the row has one. `aliases` (the
    config's `columns:`, canonical -> the data's own name) copy each mapped column back under
    the user's own name too, so a reward reading `solution` after `{answer: solution}` gets it
    (images excepted: they are not copied twice)."""
    out = {k: v for k, v in row.items() if k not in ("prompt", "messages")}
    out["messages"] = prompt_messages(row, index, template, source)
    if out.get("query_id") is None:
        out["query_id"] = f"{id_prefix}-{index}"
    out["query_id"] = str(out["query_id"])
    for canon, own in (aliases or {}).items():
        if canon != "images" and own != canon and own not in out and canon in row:
            out[own] = row[canon]
    return out


def _template(tokenizer: Any, messages: list[dict], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=generation_prompt, tokenize=False
    )


def assistant_masked_ids(tokenizer: Any, messages: list[dict], index: int, source: str) -> dict:
    """Chat-templated ids with loss_mask 1 on exactly the assistant turns' tokens (their
    content and end-of-turn marker), 0 on everything else.

    Each turn's text is the difference of two chat-template renderings, tokenized on its own so
    no token straddles a mask boundary."""
    ids: list[int] = []
    mask: list[int] = []
    done = ""
    for turn, m in enumerate(messages):
        if m["role"] == "assistant":
            before = _template(tokenizer, messages[:turn], True) if turn else ""
            pieces = [(before, 0), (_template(tokenizer, messages[: turn + 1], False), 1)]
        else:
            pieces = [(_template(tokenizer, messages[: turn + 1], False), 0)]
        for text, is_loss in pieces:
            if not text.startswith(done):
                raise DatasetFormatError(
                    f"{source}: row {index}: the chat template does not render turn {turn} as "
                    "an extension of the turns before it; give SFT rows as prompt + completion"
                )
            new = tokenizer(text[len(done) :], add_special_tokens=False)["input_ids"]
            ids += new
            mask += [is_loss] * len(new)
            done = text
    if not any(mask):
        raise DatasetFormatError(f"{source}: row {index} 'messages' has no assistant turn")
    return {"input_ids": ids, "loss_mask": mask}


def sft_row_from(row: dict, index: int, tokenizer: Any, template: str | None, source: str) -> dict:
    """SFT ids + mask of a `messages` row or a `prompt` + `completion` row."""
    if row.get("messages") is not None:
        return assistant_masked_ids(tokenizer, _checked_messages(row, index, source), index, source)
    if row.get("completion") is None:
        raise DatasetFormatError(
            f"{source}: row {index}: SFT needs 'messages' or 'prompt' + 'completion' "
            f"(its columns: {sorted(row)})"
        )
    return sft_row(tokenizer, _user_prompt(row, index, template, source), str(row["completion"]))
