"""The `gsm8k` task: grade-school math from the hub (`openai/gsm8k`, config "main") or a local
copy (`options: {source: <path>}`); its reward is math-verify (`math_reward_fn`, also the
built-in `reward: math_verify` for any math data); held out: `test` / `valid` / `validation`
(the hub set's `test`).

Local copies: a .jsonl / .json / .parquet file, or a directory holding `<split>*.jsonl|parquet`
files (a hub snapshot's `main/train-00000-of-00001.parquet` works). Rows have "question" and
"answer", where "answer" is a worked solution ending in "#### <number>".
`write_synthetic_gsm8k_jsonl` writes such a file for offline tests and demos.

math-verify checks answers by symbolic equality ("0.5", "1/2", "\\frac{1}{2}" agree) and bounds
its parsing time with `signal.alarm`, which works only in a process's main thread. The RLVR
workflow runs rewards in worker processes (a process pool, where each task runs in the worker's
main thread), so timeouts stay on there; when called from any other thread they are off (the
caller's own timeout must then cover a runaway parse).
"""

from __future__ import annotations

import glob
import json
import os
import random
import re
import threading
from typing import Any

from math_verify import parse, verify

from arealite.dataset.common import DatasetFormatError, map_rows, require_fields, sft_row

GSM8K_HUB_ID = "openai/gsm8k"
OPTIONS = ("source",)
INSTRUCTION = "\nPlease put your final answer within \\boxed{}."
_LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_HELD_OUT = ("test", "valid", "validation")


def extract_final_answer(solution: str) -> str | None:
    """The number after the last '####' (thousands separators removed), or None."""
    if "####" not in solution:
        return None
    final = solution.rsplit("####", 1)[1].strip().replace(",", "")
    return final or None


def solution_to_completion(solution: str) -> str:
    """A GSM8K solution as an SFT target: calculator notes `<<48/2=24>>` removed and the final
    '#### 72' turned into '\\boxed{72}', the format the RL instruction asks for."""
    body, _, final = solution.rpartition("####")
    body = re.sub(r"<<[^>]*>>", "", body).strip()
    return f"{body}\nThe final answer is \\boxed{{{final.strip().replace(',', '')}}}."


def _split_files(directory: str, split: str) -> list[str]:
    names = [split] + ([n for n in _HELD_OUT if n != split] if split in _HELD_OUT else [])
    for name in names:
        files = sorted(
            f
            for ext in _LOCAL_FORMATS
            for f in glob.glob(os.path.join(directory, "**", f"{name}*{ext}"), recursive=True)
        )
        preferred = [f for f in files if f"{os.sep}main{os.sep}" in f]
        if files:
            return preferred or files
    raise FileNotFoundError(
        f"No {split!r} split in {directory}: expected files named {split}*.jsonl / .parquet"
    )


def load_gsm8k_raw(path: str, split: str = "train") -> Any:
    """The raw rows (question, answer) as a `datasets.Dataset`."""
    import datasets

    if os.path.exists(path):
        files = _split_files(path, split) if os.path.isdir(path) else [path]
        exts = {os.path.splitext(f)[1] for f in files}
        if len(exts) != 1 or next(iter(exts)) not in _LOCAL_FORMATS:
            raise ValueError(
                f"GSM8K files must all be one of {sorted(_LOCAL_FORMATS)}; got {files}"
            )
        builder = _LOCAL_FORMATS[exts.pop()]
        return datasets.load_dataset(builder, data_files=files, split="train", keep_in_memory=True)
    config = None
    if path == GSM8K_HUB_ID:  # configs main / socratic; splits train / test only
        config, split = "main", ("test" if split in _HELD_OUT else split)
    try:
        return datasets.load_dataset(path, config, split=split)
    except Exception as e:
        raise RuntimeError(
            f"Could not load GSM8K from hub id {path!r} (split {split!r}): {e}. Offline? Pass a "
            "local .jsonl/.parquet path or directory (write_synthetic_gsm8k_jsonl makes one)."
        ) from e


def _rl_row(row: dict, index: int, source: str) -> dict:
    require_fields(row, index, ("question", "answer"), source)
    final = extract_final_answer(row["answer"])
    if final is None:
        raise DatasetFormatError(f"{source}: row {index} field 'answer' has no '#### <number>'")
    return {
        "messages": [{"role": "user", "content": row["question"] + INSTRUCTION}],
        "answer": final,
        "query_id": str(row.get("query_id") or f"gsm8k-{index}"),
    }


def _sft_row(row: dict, index: int, tokenizer: Any, source: str) -> dict:
    require_fields(row, index, ("question", "answer"), source)
    if extract_final_answer(row["answer"]) is None:
        raise DatasetFormatError(f"{source}: row {index} field 'answer' has no '#### <number>'")
    messages = [{"role": "user", "content": row["question"] + INSTRUCTION}]
    return sft_row(tokenizer, messages, solution_to_completion(row["answer"]))


def get_gsm8k_dataset(path: str, split: str, type: str, tokenizer: Any = None) -> Any:
    """GSM8K as RL rows (messages, answer, query_id) or SFT rows (input_ids, loss_mask)."""
    raw = load_gsm8k_raw(path, split)
    source = f"GSM8K {path!r} split {split!r}"
    if type == "rl":
        fn, kw = _rl_row, {"source": source}
    else:
        fn, kw = _sft_row, {"tokenizer": tokenizer, "source": source}
    return map_rows(raw, fn, kw)


def load(split: str, type: str, tokenizer: Any, processor: Any, source: str = GSM8K_HUB_ID):
    """The task's rows (the registry's loader signature)."""
    return get_gsm8k_dataset(source, split, type, tokenizer)


# ----------------------------------------------------------------------------- reward

PARSE_TIMEOUT_SECS = 5


def _timeout() -> int | None:
    return PARSE_TIMEOUT_SECS if threading.current_thread() is threading.main_thread() else None


def verify_math(completion: str, answer: str) -> bool:
    """True if the completion's final answer (its \\boxed{} if any, else the last expression
    math-verify finds) equals `answer`. Unparseable text is simply wrong."""
    timeout = _timeout()
    gold = parse("\\boxed{" + str(answer).replace(",", "") + "}", parsing_timeout=timeout)
    if not gold:
        raise ValueError(f"math-verify cannot parse the reference answer {answer!r}")
    try:
        pred = parse(completion, parsing_timeout=timeout)
        return bool(pred) and verify(gold, pred, timeout_seconds=timeout)
    except Exception:  # math-verify raises on pathological input (e.g. a timeout)
        return False


def math_reward_fn(
    prompt: str,
    completions: str,
    prompt_ids: list[int],
    completion_ids: list[int],
    answer: str | None = None,
    **row,
) -> float:
    """1.0 if the completion's final answer equals row["answer"] (math-verify), else 0.0. GSM8K
    rows' answer is the number after '####' (extract_final_answer), which math-verify reads as
    is."""
    if answer is None:
        raise ValueError("math_reward_fn needs the dataset row's 'answer' field")
    return float(verify_math(completions, answer))


# ----------------------------------------------------------------------------- synthetic file

_NAMES = ("Tom", "Anna", "Liam", "Mia", "Noah", "Emma", "Omar", "Sara")
_ITEMS = ("apples", "books", "eggs", "cars", "boxes", "pencils", "cookies", "stamps")


def _word_problem(rng: random.Random) -> tuple[str, str, int]:
    """(question, worked solution without the final line, answer)."""
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    a, b, c = rng.randint(2, 60), rng.randint(2, 30), rng.randint(1, 9)
    kind = rng.randrange(4)
    if kind == 0:
        q = f"{name} has {a} {item}. {name} buys {b} more {item}. How many {item} does {name} have now?"
        return q, f"{name} has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} {item}.", a + b
    if kind == 1:
        a = a + b
        q = f"{name} had {a} {item} and gave {b} of them to a friend. How many {item} are left?"
        return q, f"{name} has {a} - {b} = <<{a}-{b}={a - b}>>{a - b} {item} left.", a - b
    if kind == 2:
        q = f"There are {c} boxes with {b} {item} in each box. How many {item} are there in total?"
        return q, f"There are {c} * {b} = <<{c}*{b}={c * b}>>{c * b} {item}.", c * b
    n = a + b - c
    q = (
        f"{name} has {a} {item}, buys {b} more and then gives {c} away. "
        f"How many {item} does {name} have?"
    )
    sol = f"After buying, {name} has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} {item}.\n"
    sol += f"After giving some away, {a + b} - {c} = <<{a + b}-{c}={n}>>{n} {item} are left."
    return q, sol, n


def write_synthetic_gsm8k_jsonl(path: str, n: int = 64, seed: int = 0) -> str:
    """Write `n` GSM8K-format word problems ({"question", "answer": "... #### N"}) to `path`."""
    rng = random.Random(seed)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        for _ in range(n):
            q, sol, ans = _word_problem(rng)
            f.write(json.dumps({"question": q, "answer": f"{sol}\n#### {ans}"}) + "\n")
    return path
