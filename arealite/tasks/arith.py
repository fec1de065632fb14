"""The `arith` task: synthetic arithmetic, which a ~3M-parameter model learns on a CPU in minutes.
Its loader (`load`, settings in OPTIONS), its reward (`arith_reward_fn`, exact match) and its
held-out rule (a hash of the expression) are all here.

The prompt is the bare expression ("12+34=") and the answer its value in plain digits ("46"), so
prompts are a handful of tokens (the tokenizer splits digits one by one) and the reward is an
exact match. Difficulty knobs: `max_digits` per operand, `n_operands`, `ops` (any of "+-*",
usual precedence). `mix` makes a set of mixed difficulty: a list of tiers, each overriding some
knobs (`[{n_operands: 2}, {n_operands: 3}, {max_digits: 2, ops: "*"}]`), with equal shares of the
rows, interleaved. Real RL sets mix easy and hard problems, and that is what a critic can learn:
how likely a prompt is to be solved.

Train and held-out splits never share a problem: each expression belongs to one split by a hash
of its text (`test_fraction` of the problem space is held out), whatever the seed or size.

`ExactMatchReward` is shared with the counting tasks: the task only names its extractor.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import random
import re
from collections.abc import Callable
from typing import Any

from arealite.api.reward_api import Reward, RewardInput
from arealite.dataset.common import sft_row

logger = logging.getLogger("arealite.dataset")

OPTIONS = (
    "size",
    "seed",
    "max_digits",
    "n_operands",
    "ops",
    "test_fraction",
    "mix",
    "follow_up",
)
HELD_OUT_SPLITS = ("test", "valid", "validation")
_ENUMERATE_LIMIT = 200_000  # problem spaces up to this size are enumerated exactly
_HASH_BUCKETS = 10_000


def evaluate_expression(operands: list[int], ops: list[str]) -> int:
    """Value of operands[0] ops[0] operands[1] ... with * before + and -."""
    terms, signs = [operands[0]], [1]
    for op, x in zip(ops, operands[1:]):
        if op == "*":
            terms[-1] *= x
        else:
            terms.append(x)
            signs.append(1 if op == "+" else -1)
    return sum(s * t for s, t in zip(signs, terms))


def format_expression(operands: list[int], ops: list[str]) -> str:
    return str(operands[0]) + "".join(f"{op}{x}" for op, x in zip(ops, operands[1:]))


def is_held_out(expression: str, test_fraction: float) -> bool:
    """Which split an expression belongs to: a fixed hash, so splits can never overlap."""
    h = int.from_bytes(hashlib.blake2b(expression.encode(), digest_size=8).digest(), "big")
    return h % _HASH_BUCKETS < test_fraction * _HASH_BUCKETS


def _space_size(max_digits: int, n_operands: int, ops: str) -> int:
    return (10**max_digits) ** n_operands * len(ops) ** (n_operands - 1)


def _enumerate(max_digits: int, n_operands: int, ops: str):
    numbers = range(10**max_digits)
    for operands in itertools.product(numbers, repeat=n_operands):
        for op_seq in itertools.product(ops, repeat=n_operands - 1):
            yield list(operands), list(op_seq)


def generate_arith_problems(
    size: int,
    seed: int = 0,
    split: str = "train",
    max_digits: int = 2,
    n_operands: int = 2,
    ops: str = "+",
    test_fraction: float = 0.2,
) -> list[tuple[str, int]]:
    """`size` (expression, value) pairs of `split`, unique unless the split has fewer problems;
    then a train split repeats them and a held-out split stops at the distinct ones."""
    _validate(size, max_digits, n_operands, ops, test_fraction)
    if split != "train" and split not in HELD_OUT_SPLITS:
        raise ValueError(f"arith split must be 'train' or one of {HELD_OUT_SPLITS}, got {split!r}")
    held_out = split in HELD_OUT_SPLITS
    rng = random.Random(f"arith-{seed}-{'test' if held_out else 'train'}")
    if _space_size(max_digits, n_operands, ops) <= _ENUMERATE_LIMIT:
        pool = [
            (e, evaluate_expression(o, p))
            for o, p in _enumerate(max_digits, n_operands, ops)
            if is_held_out(e := format_expression(o, p), test_fraction) == held_out
        ]
        if not pool:
            raise ValueError(f"arith split {split!r} is empty; raise test_fraction or max_digits")
        rng.shuffle(pool)
        if size > len(pool) and held_out:  # a held-out set never counts a problem twice
            logger.warning(
                "arith %s: only %d distinct problems exist; using %d rows, not size=%d",
                split,
                len(pool),
                len(pool),
                size,
            )
            return pool
        if size > len(pool):
            logger.info(
                "arith %s: %d problems exist, repeating to reach %d", split, len(pool), size
            )
        return [pool[i % len(pool)] for i in range(size)]
    return _sample(rng, size, held_out, max_digits, n_operands, ops, test_fraction)


MIX_KNOBS = ("max_digits", "n_operands", "ops")


def generate_mixed_problems(
    size: int, seed: int, split: str, defaults: dict, mix: list[dict], test_fraction: float
) -> list[tuple[str, int]]:
    """Equal shares of `size` from each tier of `mix` (tier knobs over `defaults`), round-robin
    so every batch sees every tier; a held-out tier stops at its distinct problems."""
    if not isinstance(mix, (list, tuple)) or not all(isinstance(t, dict) for t in mix):
        raise ValueError(f"arith mix must be a list of tiers (dicts of {MIX_KNOBS}), got {mix!r}")
    if size < len(mix):
        raise ValueError(f"arith size={size} is smaller than the {len(mix)} tiers of mix")
    tiers = []
    for i, tier in enumerate(mix):
        unknown = set(tier) - set(MIX_KNOBS)
        if unknown:
            raise ValueError(
                f"arith mix[{i}]: unknown knob(s) {sorted(unknown)}; allowed: {MIX_KNOBS}"
            )
        knobs = {**defaults, **tier, "ops": "".join(tier.get("ops", defaults["ops"]))}
        share = size // len(mix) + (i < size % len(mix))
        tiers.append(
            generate_arith_problems(share, seed, split, test_fraction=test_fraction, **knobs)
        )
    rows = []
    for j in range(max(map(len, tiers))):
        rows.extend(t[j] for t in tiers if j < len(t))
    return rows


def _sample(rng, size, held_out, max_digits, n_operands, ops, test_fraction):
    """Rejection sampling for spaces too big to enumerate (duplicates are then rare)."""
    out, seen = [], set()
    while len(out) < size:
        operands = [rng.randrange(10**max_digits) for _ in range(n_operands)]
        op_seq = [rng.choice(ops) for _ in range(n_operands - 1)]
        e = format_expression(operands, op_seq)
        if e in seen or is_held_out(e, test_fraction) != held_out:
            continue
        seen.add(e)
        out.append((e, evaluate_expression(operands, op_seq)))
    return out


def _validate(size, max_digits, n_operands, ops, test_fraction) -> None:
    if size < 1:
        raise ValueError(f"arith size must be >= 1, got {size}")
    if not 1 <= max_digits <= 9:
        raise ValueError(f"arith max_digits must be in [1, 9], got {max_digits}")
    if n_operands < 2:
        raise ValueError(f"arith n_operands must be >= 2, got {n_operands}")
    if not ops or set(ops) - set("+-*"):
        raise ValueError(f"arith ops must be a non-empty string of '+', '-', '*', got {ops!r}")
    if not 0 < test_fraction < 1:
        raise ValueError(f"arith test_fraction must be in (0, 1), got {test_fraction}")


def get_arith_dataset(
    split: str = "train",
    type: str = "rl",
    tokenizer: Any = None,
    size: int = 2000,
    seed: int = 0,
    max_digits: int = 2,
    n_operands: int = 2,
    ops: str = "+",
    test_fraction: float = 0.2,
    mix: list[dict] | None = None,
    follow_up: float = 0.0,
) -> Any:
    """RL rows {"messages", "answer", "query_id"} or SFT rows {"input_ids", "loss_mask"};
    `follow_up` (SFT only) is the fraction of SFT rows that are two-turn (see follow_up_row)."""
    import datasets

    if not 0.0 <= follow_up <= 1.0:
        raise ValueError(f"arith follow_up must be in [0, 1], got {follow_up}")
    if follow_up and type != "sft":
        raise ValueError(
            "arith follow_up makes two-turn SFT rows (type sft); RL prompts stay one turn, the "
            "agent asks its own second turn"
        )

    knobs = dict(max_digits=max_digits, n_operands=n_operands, ops="".join(ops))
    if mix:
        problems = generate_mixed_problems(size, seed, split, knobs, mix, test_fraction)
    else:
        problems = generate_arith_problems(size, seed, split, test_fraction=test_fraction, **knobs)
    if type == "rl":
        rows = [
            {
                "messages": [{"role": "user", "content": f"{e}="}],
                "answer": str(v),
                "query_id": f"arith-{split}-{seed}-{i}",
            }
            for i, (e, v) in enumerate(problems)
        ]
    else:
        rng = random.Random(f"arith-follow-up-{seed}")
        rows = [
            follow_up_row(tokenizer, e, v, rng.randint(1, 9))
            if rng.random() < follow_up
            else sft_row(tokenizer, [{"role": "user", "content": f"{e}="}], str(v))
            for e, v in problems
        ]
    return datasets.Dataset.from_list(rows)


def follow_up_row(tokenizer: Any, expression: str, value: int, c: int) -> dict[str, list[int]]:
    """A two-turn SFT row: "3+4=" -> "7", then "+c=" -> 7 + c, loss on the second answer only.
    Why: a model warm-started on one-turn sums never answers a follow-up (0% two-turn success,
    so GRPO sees no signal); a share of these rows gives the multi-turn agent a start."""
    messages = [
        {"role": "user", "content": f"{expression}="},
        {"role": "assistant", "content": str(value)},
        {"role": "user", "content": f"+{c}="},
    ]
    return sft_row(tokenizer, messages, str(value + c))


def load(split: str, type: str, tokenizer: Any, processor: Any, **options: Any) -> Any:
    """The task's rows (the registry's loader signature); `options` are OPTIONS."""
    return get_arith_dataset(split, type, tokenizer, **options)


# ----------------------------------------------------------------------------- reward

_INT = re.compile(r"-?\d+")


def last_integer(text: str) -> int | None:
    """The last (signed) integer in `text`, e.g. 46 in "12+34=46" or in "\\boxed{46}"."""
    found = _INT.findall(text)
    return int(found[-1]) if found else None


class ExactMatchReward(Reward):
    """1.0 if the value `extract` finds in the completion equals the one in row["answer"],
    else 0.0.

    A class rather than one function per task so the task only names its extractor; an
    instance pickles (its extractor is a module-level function) for the reward worker processes.
    `strict`: the reference answer must be exactly the extracted value (e.g. "16", not "x=16").
    """

    def __init__(self, name: str, extract: Callable[[str], int | None], strict: bool, why: str):
        self.__name__ = self.name = name
        self.extract, self.strict, self.why = extract, strict, why

    def score(self, sample: RewardInput) -> float:
        answer = sample.row.get("answer")
        if answer is None:
            raise ValueError(f"{self.name} needs the dataset row's 'answer' field")
        gold = self.extract(str(answer))
        if gold is None or (self.strict and str(gold) != str(answer).strip()):
            raise ValueError(f"{self.name}: reference answer {answer!r} {self.why}")
        return float(self.extract(sample.completion) == gold)


# 1.0 if the completion's last integer equals row["answer"], else 0.0.
arith_reward_fn = ExactMatchReward("arith_reward_fn", last_integer, True, "is not an integer")
