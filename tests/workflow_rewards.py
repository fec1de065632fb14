"""Module-level reward functions for the workflow tests.

They run in RewardPool worker processes, which import this module by name: keeping it free of
heavy imports keeps the pool's start-up short.
"""

from __future__ import annotations

import time


def has_digit(prompt, completions, prompt_ids, completion_ids, **row):
    return float(any(ch.isdigit() for ch in completions))


def raises(prompt, completions, prompt_ids, completion_ids, **row):
    raise ValueError("reward exploded on purpose")


def hangs(prompt, completions, prompt_ids, completion_ids, **row):
    time.sleep(3600)
    return 1.0


def always_one(prompt, completions, prompt_ids, completion_ids, **row):
    return 1.0


def always_zero(prompt, completions, prompt_ids, completion_ids, **row):
    return 0.0


def correct_on_second_turn(prompt, completions, prompt_ids, completion_ids, **row):
    """1 once the context holds two user turns (the question and one feedback message)."""
    return 1.0 if prompt.count("<|im_start|>user") >= 2 else 0.0


def echo_row(prompt, completions, prompt_ids, completion_ids, **row):
    """The row's `target` field must reach the reward function unchanged."""
    return float(row["target"])


def hangs_if_asked(prompt, completions, prompt_ids, completion_ids, **row):
    if row.get("hang"):
        time.sleep(3600)
    return 1.0


def by_row(prompt, completions, prompt_ids, completion_ids, **row):
    """Per-sample behaviour for group tests: row["do"] is "ok", "raise" or "hang"."""
    if row["do"] == "raise":
        raise ValueError(f"sample {row['i']} exploded on purpose")
    if row["do"] == "hang":
        time.sleep(3600)
    return float(row["i"])


def token_id_spread(prompt, completions, prompt_ids, completion_ids, **row):
    """A reward in [0, 1) that differs between almost any two completions (their token ids),
    so GRPO groups of an untrained model still have non-zero advantages and gradients."""
    return (sum((i + 1) * t for i, t in enumerate(completion_ids)) % 101) / 101
