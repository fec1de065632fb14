"""Supervised fine-tuning for any dataset (packed, FSDP2): `train_dataset` is a built-in task
or your own file of `messages` (loss on the assistant turns) or `prompt` + `completion` rows.

    python -m arealite.launcher.local examples/sft.py --config examples/configs/gsm8k_sft.yaml \
        experiment_name=gsm8k-sft trial_name=run1 model.path=Qwen/Qwen2.5-0.5B

Rows with images (pixel_values, image_grid_thw) carry them to the trainer (a vision task loads
the model's processor).
"""

from __future__ import annotations

import logging
import sys

from transformers import AutoTokenizer

from arealite.api.cli_args import SFTConfig, load_expr_config
from arealite.engine.sft.lm_engine import FSDPLMEngine
from arealite.lifecycle.fast_exit import run_then_exit_fast
from arealite.tasks import is_vision_dataset, load_rows
from arealite.trainer.supervised import rank_loader, start_run, train_supervised
from arealite.utils.data import pad_sequences_to_tensors
from arealite.utils.vision import load_vlm_processor, sft_row_inputs


def sft_loader(cfg, rank, world, tokenizer, seed, shuffle=None, processor=None):
    ds = load_rows(cfg, rank, world, "sft", tokenizer, processor)

    def collate(rows):
        return pad_sequences_to_tensors([sft_row_inputs(r) for r in rows])

    return rank_loader(cfg, ds, world, seed, collate, shuffle)


def main(argv: list[str], load_processor=None) -> None:
    """`load_processor(path)` (vision) loads the processor the dataset needs."""
    config = load_expr_config(argv, SFTConfig)
    rank, world = start_run(config)
    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer_path or config.model.path)
    processor_path = config.tokenizer_path or config.model.path
    if load_processor is None and is_vision_dataset(config.train_dataset.path, processor_path):
        load_processor = load_vlm_processor
    processor = load_processor(processor_path) if load_processor else None
    train_loader = sft_loader(
        config.train_dataset, rank, world, tokenizer, config.seed, processor=processor
    )
    valid_loader = None
    if config.valid_dataset is not None:
        valid_loader = sft_loader(
            config.valid_dataset, rank, world, tokenizer, 0, shuffle=False, processor=processor
        )
    engine = FSDPLMEngine(config.model)

    def validation_loss() -> float:
        losses = [engine.evaluate_lm(b) for b in valid_loader]
        return float(sum(losses) / max(len(losses), 1))

    train_supervised(
        config,
        engine,
        tokenizer,
        train_loader,
        engine.train_lm,
        validation_loss if valid_loader is not None else None,
    )


if __name__ == "__main__":
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    run_then_exit_fast(main, sys.argv[1:])  # a finished run skips ~1 s of interpreter teardown
