"""HF checkpoints for export, written on a schedule (every N epochs / steps / seconds).

These are the weights a user takes away (loadable with `from_pretrained`), unlike the DCP recover
checkpoints, which also hold optimizer state. Every rank calls `save` (an FSDP save is collective);
the engine decides which rank writes files.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from arealite.api.cli_args import SaverConfig
from arealite.api.engine_api import TrainEngine
from arealite.api.io_struct import FinetuneSpec, SaveLoadMeta
from arealite.trainer.timer import EpochStepTimeFreqCtl

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


class Saver:
    """Saves `engine` as an HF model under `<run_dir>/checkpoints/` when the schedule says so
    (freq_epochs / freq_steps / freq_secs); `ft_spec.steps_per_epoch` tells when an epoch ends.
    """

    def __init__(self, config: SaverConfig, ft_spec: FinetuneSpec, run_dir: str):
        self.config = config
        self.ft_spec = ft_spec
        self.run_dir = run_dir
        self.freq_ctl = EpochStepTimeFreqCtl.from_config(config)

    @staticmethod
    def get_save_path(run_dir: str, epoch: int, global_step: int, name: str | None = None) -> str:
        root = os.path.join(run_dir, "checkpoints", *([name] if name else []))
        return os.path.join(root, f"epoch{epoch}globalstep{global_step}")

    def save(
        self,
        engine: TrainEngine,
        epoch: int,
        step: int,
        global_step: int,
        tokenizer: PreTrainedTokenizerBase | None = None,
        name: str | None = None,
        base_model_path: str | None = None,
        force: bool = False,
    ) -> str | None:
        """Save if due after finishing (0-based) `step` of `epoch`; returns the path or None.

        Call once per training step on every rank; `force=True` saves regardless (e.g. at the
        end of training) without disturbing the schedule.
        """
        end_of_epoch = step == self.ft_spec.steps_per_epoch - 1
        due = self.freq_ctl.check(epochs=int(end_of_epoch), steps=1)
        if not (due or force):
            return None
        path = self.get_save_path(self.run_dir, epoch, global_step, name)
        meta = SaveLoadMeta(
            path=path, weight_format="hf", tokenizer=tokenizer, base_model_path=base_model_path
        )
        engine.save(meta)
        logger.info("Saved HF checkpoint to %s", path)
        return path

    def state_dict(self) -> dict[str, Any]:
        return {"freq_ctl": self.freq_ctl.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.freq_ctl.load_state_dict(state["freq_ctl"])
