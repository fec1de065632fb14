"""The `long_sums` task: long, variable-length reasoning that a ~3M-parameter model learns on a CPU.

A prompt is a list of labelled digits to add up, one a line ("a7", "b3", "c9", "d1"); the answer is worked as a
scratchpad, one line per partial sum, then the total:

    b3: 7+3=10
    c9: 10+9=19
    d1: 19+1=20
    #### 20

Why this shape: it is the regime the system exists for. The number of operands is drawn from a
long-tailed law (P(k) ~ (k - 1)^-tail for k in [min_operands, max_operands]), so most answers are
short and a few run to ~256 tokens: a batch's longest output is many times its median, which is
what a synchronous system waits for and an asynchronous one overlaps. Every step of the pad is
learnable by a small transformer (the next label; the digit after that label in the prompt, which
a line repeats right after its label - a plain induction match; the last total plus one digit),
but errors compound over lines, so
accuracy falls with length and RL has room on the long tail. The reward checks the final answer
only (`long_sums_reward_fn`: the last integer, like arith), so the policy may learn any pad.

Train and held-out splits never share a problem: a hash of the expression picks its split.
"""

from __future__ import annotations

import random
from typing import Any

from arealite.dataset.common import sft_row
from arealite.tasks.arith import ExactMatchReward, is_held_out, last_integer

OPTIONS = ("size", "seed", "min_operands", "max_operands", "tail", "test_fraction")
HELD_OUT_SPLITS = ("test", "valid", "validation")
LABELS = "abcdefghijklmnopqrstuvwxyz"  # one per operand, so at most 26 operands


def operand_count_weights(min_operands: int, max_operands: int, tail: float) -> list[float]:
    """P(k) for k = min_operands..max_operands: (k - 1)^-tail, normalised (the length law)."""
    raw = [(k - 1) ** -tail for k in range(min_operands, max_operands + 1)]
    return [w / sum(raw) for w in raw]


def prompt_text(operands: list[int]) -> str:
    """ "a7\nb3\nc9": each digit after its label, one a line, the labels in alphabetical order
    (a label then tokenizes as it does at the start of a scratchpad line)."""
    return "\n".join(f"{label}{x}" for label, x in zip(LABELS, operands))


def scratchpad(operands: list[int]) -> str:
    """The worked answer: "<label><x>: total+x=new total" for each operand after the first,
    then "#### total"."""
    lines, total = [], operands[0]
    for label, x in zip(LABELS[1:], operands[1:]):
        lines.append(f"{label}{x}: {total}+{x}={total + x}")
        total += x
    return "\n".join(lines) + f"\n#### {total}"


def generate_problems(
    size: int,
    seed: int = 0,
    split: str = "train",
    min_operands: int = 2,
    max_operands: int = 20,
    tail: float = 1.2,
    test_fraction: float = 0.2,
) -> list[list[int]]:
    """`size` distinct operand lists of `split` (the operand count drawn from the length law)."""
    _validate(size, split, min_operands, max_operands, tail, test_fraction)
    held_out = split in HELD_OUT_SPLITS
    rng = random.Random(f"long_sums-{seed}-{'test' if held_out else 'train'}")
    counts = list(range(min_operands, max_operands + 1))
    weights = operand_count_weights(min_operands, max_operands, tail)
    out, seen = [], set()
    while len(out) < size:
        operands = [rng.randrange(10) for _ in range(rng.choices(counts, weights)[0])]
        expression = prompt_text(operands)
        if expression in seen or is_held_out(expression, test_fraction) != held_out:
            continue
        seen.add(expression)
        out.append(operands)
    return out


def _validate(size, split, min_operands, max_operands, tail, test_fraction) -> None:
    if split != "train" and split not in HELD_OUT_SPLITS:
        raise ValueError(
            f"long_sums split must be 'train' or one of {HELD_OUT_SPLITS}, got {split!r}"
        )
    if size < 1:
        raise ValueError(f"long_sums size must be >= 1, got {size}")
    if not 2 <= min_operands <= max_operands <= len(LABELS):
        raise ValueError(
            f"long_sums needs 2 <= min_operands <= max_operands <= {len(LABELS)}, "
            f"got min_operands={min_operands}, max_operands={max_operands}"
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
    **length_law: Any,
) -> Any:
    """RL rows {"messages", "answer", "query_id"} or SFT rows (prompt + worked scratchpad)."""
    import datasets

    problems = generate_problems(size, seed, split, test_fraction=test_fraction, **length_law)
    prompts = [prompt_text(ops) for ops in problems]
    if type == "sft":
        rows = [
            sft_row(tokenizer, [{"role": "user", "content": p}], scratchpad(ops))
            for p, ops in zip(prompts, problems)
        ]
    else:
        rows = [
            {
                "messages": [{"role": "user", "content": p}],
                "answer": str(sum(ops)),
                "query_id": f"long_sums-{split}-{seed}-{i}",
            }
            for i, (p, ops) in enumerate(zip(prompts, problems))
        ]
    return datasets.Dataset.from_list(rows)


# 1.0 if the completion's last integer is the total, else 0.0 (the pad itself is not graded).
long_sums_reward_fn = ExactMatchReward(
    "long_sums_reward_fn", last_integer, True, "is not an integer"
)
