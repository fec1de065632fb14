"""Supervised fine-tuning for any dataset (packed, FSDP2): `train_dataset` is a built-in task
or your own file of `messages` (loss on the assistant turns) or `prompt` + `completion` rows.

    python -m arealite.launcher.local examples/sft.py --config examples/configs/gsm8k_sft.yaml \
        experiment_name=gsm8k-sft trial_name=run1 model.path=Qwen/Qwen2.5-0.5B

Rows with images (pixel_values, image_grid_thw) carry them to the trainer (a vision task loads
the model's processor).
"""

from __future__ import annotations

import logging
import os
import sys

import torch
from torchdata.stateful_dataloader import StatefulDataLoader
from transformers import AutoTokenizer

from arealite.api.cli_args import SFTConfig, load_expr_config
from arealite.api.io_struct import FinetuneSpec
from arealite.dataset import is_vision_dataset, load_rows
from arealite.engine.sft.lm_engine import FSDPLMEngine
from arealite.trainer.evaluator import Evaluator
from arealite.trainer.recover import RecoverHandler, ResumableSampler
from arealite.trainer.saver import Saver
from arealite.trainer.stats_logger import StatsLogger
from arealite.utils import stats_tracker
from arealite.utils.data import pad_sequences_to_tensors
from arealite.utils.run_lock import claim_run_dir
from arealite.utils.vision import load_vlm_processor, sft_row_inputs


def sft_loader(cfg, rank, world, tokenizer, seed, shuffle=None, processor=None):
    ds = load_rows(cfg, rank, world, "sft", tokenizer, processor)
    order = ResumableSampler(len(ds), cfg.shuffle if shuffle is None else shuffle, seed)
    return StatefulDataLoader(
        ds, batch_size=max(1, cfg.batch_size // world), drop_last=cfg.drop_last, sampler=order,
        collate_fn=lambda rows: pad_sequences_to_tensors([sft_row_inputs(r) for r in rows]),
    )  # fmt: skip


def main(argv: list[str], load_processor=None) -> None:
    """`load_processor(path)` (vision) loads the processor the dataset needs."""
    config = load_expr_config(argv, SFTConfig)
    claim_run_dir(config.run_dir, int(os.environ.get("RANK", 0)))  # one owner per run
    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer_path or config.model.path)
    processor_path = config.tokenizer_path or config.model.path
    if load_processor is None and is_vision_dataset(config.train_dataset.path, processor_path):
        load_processor = load_vlm_processor
    processor = load_processor(processor_path) if load_processor else None
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    torch.manual_seed(config.seed)
    train_loader = sft_loader(config.train_dataset, rank, world, tokenizer, config.seed,
                              processor=processor)  # fmt: skip
    valid_loader = None
    if config.valid_dataset is not None:
        valid_loader = sft_loader(config.valid_dataset, rank, world, tokenizer, 0, shuffle=False,
                                  processor=processor)  # fmt: skip
    ft_spec = FinetuneSpec(config.total_train_epochs, len(train_loader.dataset) * world,
                           config.train_dataset.batch_size)  # fmt: skip
    total_steps = min(ft_spec.total_train_steps, config.total_train_steps or 10**12)

    engine = FSDPLMEngine(config.model)
    engine.initialize(None, ft_spec)
    saver = Saver(config.saver, ft_spec, config.run_dir)
    evaluator = Evaluator(config.evaluator, ft_spec)
    states = {"model": engine, "dataloader": train_loader, "saver": saver, "evaluator": evaluator}
    recover = RecoverHandler(config.recover, ft_spec, config.run_dir, states)
    start = recover.load()
    logger = StatsLogger(config.stats_logger, config.run_dir, ft_spec, start_step=start,
                         total_steps=total_steps, exp_config=config)  # fmt: skip

    def validation_loss() -> float:
        losses = [engine.evaluate_lm(b) for b in valid_loader]
        return float(sum(losses) / max(len(losses), 1))

    data_iter = iter(train_loader)
    for global_step in range(start, total_steps):
        epoch, step = divmod(global_step, ft_spec.steps_per_epoch)
        try:
            batch = next(data_iter)
        except StopIteration:
            data_iter = iter(train_loader)
            batch = next(data_iter)
        with stats_tracker.record_timing("train_step"):
            stats = engine.train_lm(batch)
            engine.step_lr_scheduler()
        engine.set_version(global_step + 1)
        saver.save(engine, epoch, step, global_step, tokenizer=tokenizer)
        if valid_loader is not None:
            loss = evaluator.evaluate(validation_loss, epoch, step, global_step)
            if loss is not None:
                stats["eval/loss"] = loss
        stats.update(stats_tracker.export())
        logger.commit(epoch, step, global_step, stats)
        # Last: a checkpoint for step s+1 implies step s is logged (resuming never leaves a gap).
        recover.dump(global_step + 1)

    saver.save(engine, 0, 0, total_steps, tokenizer=tokenizer, name="final", force=True)
    logger.close()
    engine.destroy()


if __name__ == "__main__":
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    main(sys.argv[1:])
