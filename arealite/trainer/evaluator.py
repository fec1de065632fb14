"""Held-out evaluation on a schedule (every N epochs / steps / seconds).

The training script owns *what* evaluation means (a closure over its engines and valid
dataloader); the evaluator owns *when*, and its schedule is part of the recover state.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

from arealite.api.cli_args import EvaluatorConfig
from arealite.api.io_struct import FinetuneSpec
from arealite.trainer.timer import EpochStepTimeFreqCtl

logger = logging.getLogger(__name__)
T = TypeVar("T")


class Evaluator:
    """Runs `evaluate_fn()` when due (freq_epochs / freq_steps / freq_secs); `ft_spec`'s
    `steps_per_epoch` tells when an epoch ends."""

    def __init__(self, config: EvaluatorConfig, ft_spec: FinetuneSpec):
        self.config = config
        self.ft_spec = ft_spec
        self.freq_ctl = EpochStepTimeFreqCtl.from_config(config)

    def evaluate(
        self,
        evaluate_fn: Callable[[], T],
        epoch: int,
        step: int,
        global_step: int,
        force: bool = False,
    ) -> T | None:
        """After finishing (0-based) `step` of `epoch`: `evaluate_fn()`'s result if due, else None.

        Call once per training step on every rank (evaluation is usually collective).
        """
        end_of_epoch = step == self.ft_spec.steps_per_epoch - 1
        due = self.freq_ctl.check(epochs=int(end_of_epoch), steps=1)
        if not (due or force):
            return None
        logger.info("Evaluating at epoch %d step %d (global step %d)", epoch, step, global_step)
        return evaluate_fn()

    def state_dict(self) -> dict[str, Any]:
        return {"freq_ctl": self.freq_ctl.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.freq_ctl.load_state_dict(state["freq_ctl"])
