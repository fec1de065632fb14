"""Math answers checked by math-verify (symbolic equality, so "0.5", "1/2", "\\frac{1}{2}" agree).

math-verify bounds its parsing time with `signal.alarm`, which works only in a process's main
thread. The RLVR workflow runs reward functions in worker processes (a process pool, where each
task runs in the worker's main thread), so timeouts stay on there; when called from any other
thread we switch them off (the caller's own timeout must then cover a runaway parse).
"""

from __future__ import annotations

import threading

from math_verify import parse, verify

PARSE_TIMEOUT_SECS = 5


def _timeout() -> int | None:
    return PARSE_TIMEOUT_SECS if threading.current_thread() is threading.main_thread() else None


def verify_math(completion: str, answer: str) -> bool:
    """True if the completion's final answer (its \\boxed{} if any, else the last expression
    math-verify finds) equals `answer`. Unparseable text is simply wrong."""
    timeout = _timeout()
    gold = parse(
        "\\boxed{" + str(answer).replace(",", "") + "}",
        parsing_timeout=timeout,
    )
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
    """1.0 if the completion's final answer equals row["answer"] (math-verify), else 0.0."""
    if answer is None:
        raise ValueError("math_reward_fn needs the dataset row's 'answer' field")
    return float(verify_math(completions, answer))


# GSM8K: the row's answer is the number after '####' (see arealite.dataset.gsm8k), which
# math-verify reads as is.
gsm8k_reward_fn = math_reward_fn
