"""The loop of supervised training, shared by `examples/sft.py` (language modelling) and
`examples/rm.py` (reward models): one batch a step from a resumable loader, the engine's train
step and LR schedule, HF export (saver), held-out evaluation, metrics and crash recovery.

The scripts keep what differs: how rows are read and collated, which engine, its train step and
its held-out metric. Imports arealite.api and arealite.utils only (and the trainer services).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from arealite.api.io_struct import FinetuneSpec
from arealite.lifecycle.run_lock import claim_run_dir
from arealite.trainer import timings
from arealite.trainer.evaluator import Evaluator
from arealite.trainer.recover import RecoverHandler, ResumableSampler
from arealite.trainer.saver import Saver
from arealite.trainer.stats_logger import StatsLogger
from arealite.trainer.time_budget import TimeBudget

__all__ = ["start_run", "rank_loader", "train_supervised"]


def start_run(config) -> tuple[int, int]:
    """(rank, world) of this trainer process; claims the run directory (one owner per run) and
    seeds torch with `config.seed`."""
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    claim_run_dir(config.run_dir, rank)
    torch.manual_seed(config.seed)
    return rank, world


def rank_loader(cfg, rows, world: int, seed: int, collate, shuffle=None) -> StatefulDataLoader:
    """A resumable loader over this rank's `rows`: `cfg.batch_size` is the global batch, so each
    of the `world` ranks takes `cfg.batch_size // world` rows a step (at least one)."""
    order = ResumableSampler(len(rows), cfg.shuffle if shuffle is None else shuffle, seed)
    with warnings.catch_warnings():  # torchdata calls torch.set_vital, deprecated in torch 2.10
        warnings.filterwarnings("ignore", "'set_vital' is deprecated", UserWarning)
        return StatefulDataLoader(
            rows,
            batch_size=max(1, cfg.batch_size // world),
            drop_last=cfg.drop_last,
            sampler=order,
            collate_fn=collate,
        )


def train_supervised(
    config,
    engine,
    tokenizer,
    train_loader: StatefulDataLoader,
    train_step: Callable[[Any], dict],
    evaluate: Callable[[], float] | None = None,
    eval_key: str = "eval/loss",
    eval_last: bool = False,
) -> dict[str, Any] | None:
    """Initialise `engine` and train it for `config`'s epochs / steps, resuming where a crashed
    run of the trial stopped; returns the stats logger's summary.

    Each step: `train_step(batch)` (the engine's stats), the LR schedule, version + 1, the saver,
    `evaluate()` when the evaluator is due (logged as `eval_key`; also on the last step with
    `eval_last`), the metrics, then the recovery checkpoint (last: a checkpoint for step s + 1
    implies step s is logged, so resuming never leaves a gap). Ends with a `final` export, after
    `total_steps` or the step during which `config.total_train_secs` ran out.
    """
    world = int(os.environ.get("WORLD_SIZE", 1))
    ft_spec = FinetuneSpec(
        config.total_train_epochs,
        len(train_loader.dataset) * world,
        config.train_dataset.batch_size,
        config.total_train_steps,
    )
    total_steps = ft_spec.total_train_steps
    engine.initialize(None, ft_spec)
    saver = Saver(config.saver, ft_spec, config.run_dir)
    evaluator = Evaluator(config.evaluator, ft_spec)
    states = {"model": engine, "dataloader": train_loader, "saver": saver, "evaluator": evaluator}
    recover = RecoverHandler(config.recover, ft_spec, config.run_dir, states)
    start = recover.load()
    time_budget = TimeBudget(config.total_train_secs)
    logger = StatsLogger(
        config.stats_logger,
        config.run_dir,
        ft_spec,
        start_step=start,
        total_steps=total_steps,
        exp_config=config,
        time_budget=time_budget,
    )
    time_budget.start()

    data_iter = iter(train_loader)
    for global_step in range(start, total_steps):
        epoch, step = divmod(global_step, ft_spec.steps_per_epoch)
        try:
            batch = next(data_iter)
        except StopIteration:
            data_iter = iter(train_loader)
            batch = next(data_iter)
        with timings.record_timing("train_step"):
            stats = train_step(batch)
            engine.step_lr_scheduler()
        engine.set_version(global_step + 1)
        saver.save(engine, epoch, step, global_step, tokenizer=tokenizer)
        last = global_step == total_steps - 1 or time_budget.spent(global_step)
        if evaluate is not None:
            force = eval_last and last
            value = evaluator.evaluate(evaluate, epoch, step, global_step, force=force)
            if value is not None:
                stats[eval_key] = value
        stats.update(timings.export())
        logger.commit(epoch, step, global_step, stats)
        recover.dump(global_step + 1)
        if last:  # total_train_secs can end the run early
            total_steps = global_step + 1
            break

    saver.save(engine, 0, 0, total_steps, tokenizer=tokenizer, name="final", force=True)
    summary = logger.close()
    engine.destroy()
    return summary
