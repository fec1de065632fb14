"""Held-out pair accuracy of a trained reward model on the arithmetic task, by kind of mistake:
near misses (off by 1, 2, 3), far misses (off by 10..30), and the policy's own wrong samples
(`--policy`, labelled by the exact verifier). Scored the way a GRPO run scores (the reward
worker's RewardModelScorer), on expressions the RM never trained on. One JSON line per kind.

    .venv/bin/python bench/rm_pair_accuracy.py RM_DIR --policy SFT_DIR [--n-operands 3]
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from arealite.engine.rm.preference_data import arith_preferences, prompt_ids, with_sampled_negatives
from arealite.reward.reward_model import RewardModelScorer
from arealite.tasks.arith import arith_reward_fn


def pair_accuracy(scorer, tokenizer, rows) -> float:
    def score(row, answer):
        p = prompt_ids(tokenizer, row)
        return scorer(
            row["prompt"], answer, p, tokenizer(answer, add_special_tokens=False)["input_ids"]
        )

    return sum(score(r, r["chosen"]) > score(r, r["rejected"]) for r in rows) / len(rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("rm_dir")
    ap.add_argument("--policy", help="model whose own wrong samples are the rejected answers")
    ap.add_argument("--n-operands", type=int, default=3)
    ap.add_argument("--n", type=int, default=200)
    args = ap.parse_args()
    scorer, tok = RewardModelScorer(args.rm_dir), AutoTokenizer.from_pretrained(args.rm_dir)
    kinds = {f"off_by_{k}": (k, k) for k in (1, 2, 3)} | {"off_by_10_30": (10, 30)}
    for kind, offsets in kinds.items():
        rows = arith_preferences(args.n, "test", 0, 1, 0.2, offsets, args.n_operands)
        print(
            json.dumps({"kind": kind, "held_out_pair_accuracy": pair_accuracy(scorer, tok, rows)})
        )
    if args.policy:
        rows = arith_preferences(args.n, "test", 0, 1, 0.2, (1, 3), args.n_operands)
        model = AutoModelForCausalLM.from_pretrained(args.policy).eval()

        def is_correct(text, row):
            return arith_reward_fn(row["prompt"], text, [], [], answer=row["answer"]) == 1.0

        torch.manual_seed(1)
        mixed, frac = with_sampled_negatives(rows, model, tok, is_correct, n_samples=4)
        rows = [m for r, m in zip(rows, mixed) if m is not r]  # only the replaced rows
        print(
            json.dumps(
                {
                    "kind": "policy_own_mistakes",
                    "sampled_fraction": frac,
                    "held_out_pair_accuracy": pair_accuracy(scorer, tok, rows),
                }
            )
        )


if __name__ == "__main__":
    main()
