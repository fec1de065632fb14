"""Reward-model training (Bradley-Terry on chosen/rejected pairs, packed, FSDP2).

    python -m arealite.launcher.local examples/rm.py --config examples/configs/arith_rm.yaml \
        experiment_name=arith-rm trial_name=run1

`train_dataset.path`: a jsonl of {prompt | messages, chosen, rejected} rows, or
`arith_preferences` (synthetic, generated offline). The final model (`<run_dir>/.../final`) is an
HF checkpoint (`model.head`: scalar, a token-classification model; implicit / likelihood,
the causal LM plus reward_head.json): name it as the reward of a GRPO run (README "PPO with a
critic, reward models, LoRA").
"""

from __future__ import annotations

import logging
import sys

from transformers import AutoTokenizer

from arealite.api.cli_args import load_expr_config
from arealite.api.rm_config import BUILTIN_PREFERENCES, LM_HEADS, RMConfig
from arealite.engine.rm.implicit import FSDPImplicitRewardModel
from arealite.engine.rm.preference_data import (
    arith_preferences_from_options,
    collate_pairs,
    read_preference_rows,
    with_reference_scores,
)
from arealite.engine.rm.reward_model import FSDPRewardModel
from arealite.lifecycle.fast_exit import run_then_exit_fast
from arealite.tasks.arith import arith_reward_fn
from arealite.trainer.supervised import rank_loader, start_run, train_supervised


def is_correct_sum(answer_text: str, row: dict) -> bool:
    """The exact verifier of the arithmetic task labels sampled negatives."""
    return arith_reward_fn(row["prompt"], answer_text, [], [], answer=row["answer"]) == 1.0


def preference_rows(cfg) -> list[dict]:
    if cfg.path != BUILTIN_PREFERENCES:
        return read_preference_rows(cfg.path)
    rows, sampled = arith_preferences_from_options(dict(cfg.options), cfg.split, is_correct_sum)
    if sampled:
        logging.getLogger("arealite.rm").info(
            "%s: %.0f%% of %d pairs reject the sampling model's own wrong answer",
            cfg.split,
            100 * sampled,
            len(rows),
        )
    return rows


def pair_loader(cfg, rank, world, tokenizer, seed, shuffle=None, reference=None):
    rows = preference_rows(cfg)[rank::world]  # each rank its own share of the pairs
    if reference is not None:  # the implicit head: the frozen reference's scores, once per row
        rows = with_reference_scores(rows, reference, tokenizer)
    return rank_loader(
        cfg, rows, world, seed, lambda batch: collate_pairs(tokenizer, batch), shuffle
    )


def main(argv: list[str]) -> None:
    config = load_expr_config(argv, RMConfig)
    rank, world = start_run(config)
    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer_path or config.model.path)
    lm_head = config.model.head in LM_HEADS
    engine = (FSDPImplicitRewardModel if lm_head else FSDPRewardModel)(config.model)
    ref = engine.reference_path if lm_head else None
    train_loader = pair_loader(
        config.train_dataset, rank, world, tokenizer, config.seed, reference=ref
    )
    valid = None
    if config.valid_dataset is not None:
        valid = pair_loader(config.valid_dataset, rank, world, tokenizer, 0, False, ref)

    def held_out_accuracy() -> float:
        stats = [engine.evaluate_rm(b) for b in valid]
        return sum(s["accuracy"] * s["n_pairs"] for s in stats) / sum(s["n_pairs"] for s in stats)

    summary = train_supervised(
        config,
        engine,
        tokenizer,
        train_loader,
        engine.train_rm,
        held_out_accuracy if valid is not None else None,
        "eval/pair_accuracy",
        eval_last=True,
    )
    if summary and valid is not None:
        print(f"held-out pair accuracy: {summary['last'].get('eval/pair_accuracy')}", flush=True)


if __name__ == "__main__":
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    run_then_exit_fast(main, sys.argv[1:])  # a finished run skips ~1 s of interpreter teardown
