"""Run under torchrun by tests/test_vision_rl.py: one SFT step of the tiny VLM on an uneven split
(rank 0: three image rows; rank 1: one text-only row, so it runs dummy images and dummy
micro-batches while rank 0 runs real ones). Rank 0 saves stats and full weights to --out."""

from __future__ import annotations

import argparse
import os

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()

    from _torchrun_fsdp import engine_config, full_weights
    from test_vision_rl import vlm_training_batch

    from arealite.engine.fsdp_engine import FSDPEngine
    from arealite.engine.sft.lm_engine import sft_loss_fn, sft_loss_weight
    from arealite.utils import distributed as du

    engine = FSDPEngine(engine_config(a.model, 120))
    engine.initialize(None, None)
    batch = vlm_training_batch(a.model)
    part = batch[:3] if du.rank() == 0 else batch[3:]
    stats = engine.train_batch(part, sft_loss_fn, sft_loss_weight)
    weights = full_weights(engine)
    if du.rank() == 0:
        torch.save({"stats": stats, "weights": weights, "world": du.world_size()}, a.out)
    engine.destroy()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
