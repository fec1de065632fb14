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
import os
import sys

import torch
from torchdata.stateful_dataloader import StatefulDataLoader
from transformers import AutoTokenizer

from arealite.api.cli_args import load_expr_config
from arealite.api.io_struct import FinetuneSpec
from arealite.api.rm_config import BUILTIN_PREFERENCES, LM_HEADS, RMConfig
from arealite.engine.rm.implicit import FSDPImplicitRewardModel
from arealite.engine.rm.preference_data import (
    arith_preferences_from_options,
    collate_pairs,
    read_preference_rows,
    with_reference_scores,
)
from arealite.engine.rm.reward_model import FSDPRewardModel
from arealite.reward.arith import arith_reward_fn
from arealite.trainer.evaluator import Evaluator
from arealite.trainer.recover import RecoverHandler, ResumableSampler
from arealite.trainer.saver import Saver
from arealite.trainer.stats_logger import StatsLogger
from arealite.utils import stats_tracker
from arealite.utils.run_lock import claim_run_dir


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
            cfg.split, 100 * sampled, len(rows),
        )  # fmt: skip
    return rows


def pair_loader(cfg, rank, world, tokenizer, seed, shuffle=None, reference=None):
    rows = preference_rows(cfg)[rank::world]  # each rank its own share of the pairs
    if reference is not None:  # the implicit head: the frozen reference's scores, once per row
        rows = with_reference_scores(rows, reference, tokenizer)
    order = ResumableSampler(len(rows), cfg.shuffle if shuffle is None else shuffle, seed)
    return StatefulDataLoader(
        rows, batch_size=max(1, cfg.batch_size // world), drop_last=cfg.drop_last, sampler=order,
        collate_fn=lambda batch: collate_pairs(tokenizer, batch),
    )  # fmt: skip


def main(argv: list[str]) -> None:
    config = load_expr_config(argv, RMConfig)
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    claim_run_dir(config.run_dir, rank)
    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer_path or config.model.path)
    torch.manual_seed(config.seed)
    lm_head = config.model.head in LM_HEADS
    engine = (FSDPImplicitRewardModel if lm_head else FSDPRewardModel)(config.model)
    ref = engine.reference_path if lm_head else None
    train_loader = pair_loader(config.train_dataset, rank, world, tokenizer, config.seed,
                               reference=ref)  # fmt: skip
    valid = None
    if config.valid_dataset is not None:
        valid = pair_loader(config.valid_dataset, rank, world, tokenizer, 0, False, ref)
    ft_spec = FinetuneSpec(config.total_train_epochs, len(train_loader.dataset) * world,
                           config.train_dataset.batch_size)  # fmt: skip
    total_steps = min(ft_spec.total_train_steps, config.total_train_steps or 10**12)

    engine.initialize(None, ft_spec)
    saver = Saver(config.saver, ft_spec, config.run_dir)
    evaluator = Evaluator(config.evaluator, ft_spec)
    states = {"model": engine, "dataloader": train_loader, "saver": saver, "evaluator": evaluator}
    recover = RecoverHandler(config.recover, ft_spec, config.run_dir, states)
    start = recover.load()
    logger = StatsLogger(config.stats_logger, config.run_dir, ft_spec, start_step=start,
                         total_steps=total_steps, exp_config=config)  # fmt: skip

    def held_out_accuracy() -> float:
        stats = [engine.evaluate_rm(b) for b in valid]
        return sum(s["accuracy"] * s["n_pairs"] for s in stats) / sum(s["n_pairs"] for s in stats)

    data_iter = iter(train_loader)
    for global_step in range(start, total_steps):
        epoch, step = divmod(global_step, ft_spec.steps_per_epoch)
        try:
            batch = next(data_iter)
        except StopIteration:
            data_iter = iter(train_loader)
            batch = next(data_iter)
        with stats_tracker.record_timing("train_step"):
            stats = engine.train_rm(batch)
            engine.step_lr_scheduler()
        engine.set_version(global_step + 1)
        saver.save(engine, epoch, step, global_step, tokenizer=tokenizer)
        if valid is not None:
            last = global_step == total_steps - 1
            acc = evaluator.evaluate(held_out_accuracy, epoch, step, global_step, force=last)
            if acc is not None:
                stats["eval/pair_accuracy"] = acc
        stats.update(stats_tracker.export())
        logger.commit(epoch, step, global_step, stats)
        recover.dump(global_step + 1)

    saver.save(engine, 0, 0, total_steps, tokenizer=tokenizer, name="final", force=True)
    summary = logger.close()
    if summary and valid is not None:
        print(f"held-out pair accuracy: {summary['last'].get('eval/pair_accuracy')}", flush=True)
    engine.destroy()


if __name__ == "__main__":
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    main(sys.argv[1:])
