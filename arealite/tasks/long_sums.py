"""The `long_sums` task: long, variable-length reasoning that a ~3M-parameter model learns on a CPU.

A prompt is a start value plus a digit added m times ("37+7*12"); the answer is worked as a
scratchpad, one line per partial sum numbered by the terms left, then the total:

    12: 37+7=44
    11: 44+7=51
    ...
    1: 114+7=121
    #### 121

Why this shape: it is the regime the system exists for. The number of terms m is drawn from a
long-tailed law (P(m) ~ m^-tail for m in [min_terms, max_terms]), so most answers are short and a
few run to ~230 tokens: a batch's longest output is many times its median, which is what a
synchronous system waits for and an asynchronous one overlaps. Every line is local work a small
transformer learns from a few thousand examples - count one down, copy the last total, add the
prompt's digit, stop after line 1 - but errors compound over lines, so accuracy falls with length
and RL has room on the long tail. The count runs down (`pad: down`) because with lines numbered
up (`pad: up`) the warm start never learned when to stop: its held-out accuracy came from m = 1
alone (79% there, 0% for m = 2-8), where counting down spreads it over m = 1-10
(docs/results.md, "The long regime"). The reward checks the final answer only
(`long_sums_reward_fn`: the last integer, like arith), so the policy may learn any pad.

Train and held-out splits never share a problem: a hash of the expression picks its split.
"""

from __future__ import annotations

import random
from typing import Any

from arealite.dataset.common import sft_row
from arealite.tasks.arith import ExactMatchReward, is_held_out, last_integer

OPTIONS = ("size", "seed", "min_terms", "max_terms", "tail", "test_fraction", "pad")
PADS = ("down", "up")
HELD_OUT_SPLITS = ("test", "valid", "validation")
MAX_START, MAX_TERMS = 99, 40


def term_count_weights(min_terms: int, max_terms: int, tail: float) -> list[float]:
    """P(m) for m = min_terms..max_terms: m^-tail, normalised (the length law)."""
    raw = [m**-tail for m in range(min_terms, max_terms + 1)]
    return [w / sum(raw) for w in raw]


def prompt_text(start: int, digit: int, terms: int) -> str:
    """ "37+7*12": `digit` added `terms` times to `start`."""
    return f"{start}+{digit}*{terms}"


def scratchpad(start: int, digit: int, terms: int, pad: str = "down") -> str:
    """The worked answer: one line "k: total+digit=new total" per term, then "#### total".
    pad "down": k counts the terms left (terms, ..., 1), so the model copies the count from the
    prompt once and stops after "1:" - a decision it reads off its own last line; "up": k = 1,
    ..., terms, so stopping means comparing every line's index with the prompt's count."""
    lines, total = [], start
    for i in range(1, terms + 1):
        k = terms + 1 - i if pad == "down" else i
        lines.append(f"{k}: {total}+{digit}={total + digit}")
        total += digit
    return "\n".join(lines) + f"\n#### {total}"


def generate_problems(
    size: int,
    seed: int = 0,
    split: str = "train",
    min_terms: int = 1,
    max_terms: int = 18,
    tail: float = 1.1,
    test_fraction: float = 0.2,
) -> list[tuple[int, int, int]]:
    """`size` distinct (start, digit, terms) of `split`, the term count drawn from the length
    law; a split with fewer distinct problems than `size` is refused (raise max_terms)."""
    _validate(size, split, min_terms, max_terms, tail, test_fraction)
    held_out = split in HELD_OUT_SPLITS
    rng = random.Random(f"long_sums-{seed}-{'test' if held_out else 'train'}")
    counts = list(range(min_terms, max_terms + 1))
    weights = term_count_weights(min_terms, max_terms, tail)
    out, seen = [], set()
    for _ in range(size * 1000):
        problem = (rng.randint(0, MAX_START), rng.randint(1, 9), rng.choices(counts, weights)[0])
        text = prompt_text(*problem)
        if text not in seen and is_held_out(text, test_fraction) == held_out:
            seen.add(text)
            out.append(problem)
            if len(out) == size:
                return out
    raise ValueError(f"long_sums {split!r}: fewer than size={size} distinct problems; lower size")


def _validate(size, split, min_terms, max_terms, tail, test_fraction) -> None:
    if split != "train" and split not in HELD_OUT_SPLITS:
        raise ValueError(
            f"long_sums split must be 'train' or one of {HELD_OUT_SPLITS}, got {split!r}"
        )
    if size < 1:
        raise ValueError(f"long_sums size must be >= 1, got {size}")
    if not 1 <= min_terms <= max_terms <= MAX_TERMS:
        raise ValueError(
            f"long_sums needs 1 <= min_terms <= max_terms <= {MAX_TERMS}, "
            f"got min_terms={min_terms}, max_terms={max_terms}"
        )
    if tail < 0:
        raise ValueError(f"long_sums tail must be >= 0 (0: every count equally likely), got {tail}")
    if not 0 < test_fraction < 1:
        raise ValueError(f"long_sums test_fraction must be in (0, 1), got {test_fraction}")


def load(
    split: str,
    type: str,
    tokenizer: Any,
    processor: Any,
    size: int = 2000,
    seed: int = 0,
    test_fraction: float = 0.2,
    pad: str = "down",
    **length_law: Any,
) -> Any:
    """RL rows {"messages", "answer", "query_id"} or SFT rows (prompt + worked scratchpad)."""
    import datasets

    if pad not in PADS:
        raise ValueError(f"long_sums pad must be one of {PADS}, got {pad!r}")
    problems = generate_problems(size, seed, split, test_fraction=test_fraction, **length_law)
    if type == "sft":
        rows = [
            sft_row(tokenizer, [{"role": "user", "content": prompt_text(*p)}], scratchpad(*p, pad))
            for p in problems
        ]
    else:
        rows = [
            {
                "messages": [{"role": "user", "content": prompt_text(*p)}],
                "answer": str(p[0] + p[1] * p[2]),
                "query_id": f"long_sums-{split}-{seed}-{i}",
            }
            for i, p in enumerate(problems)
        ]
    return datasets.Dataset.from_list(rows)


# 1.0 if the completion's last integer is the total, else 0.0 (the pad itself is not graded).
long_sums_reward_fn = ExactMatchReward(
    "long_sums_reward_fn", last_integer, True, "is not an integer"
)
