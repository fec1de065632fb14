"""Frequency control shared by the saver, the evaluator and recover checkpoints.

A service fires every N epochs, every N steps, or every N seconds (whichever comes first); its
counters are part of the recover state, so a resumed run keeps the same rhythm instead of firing
right away or waiting a whole period again.
"""

from __future__ import annotations

import time
from typing import Any

import torch.distributed as dist


class EpochStepTimeFreqCtl:
    """Fires when `freq_epoch` epochs, `freq_step` steps or `freq_sec` seconds have passed.

    `None` disables a criterion; with all three `None` the control never fires. Each criterion
    keeps its own counter and resets it when it fires. Saving and evaluating are collective, so
    under torch.distributed the time criterion follows rank 0 (clocks differ by a few ms across
    ranks, which would deadlock a collective save): with `freq_sec` set, `check` is then a
    collective call that every rank must make.
    """

    def __init__(
        self,
        freq_epoch: int | None = None,
        freq_step: int | None = None,
        freq_sec: float | None = None,
    ):
        for name, v in (
            ("freq_epoch", freq_epoch),
            ("freq_step", freq_step),
            ("freq_sec", freq_sec),
        ):
            if v is not None and v <= 0:
                raise ValueError(f"{name} must be > 0 or None, got {v}")
        self.freq_epoch = freq_epoch
        self.freq_step = freq_step
        self.freq_sec = freq_sec
        self.epoch_counter = 0
        self.step_counter = 0
        self._last_time = time.monotonic()

    @classmethod
    def from_config(cls, config: Any) -> EpochStepTimeFreqCtl:
        """From any config with `freq_epochs`, `freq_steps`, `freq_secs` (SaverConfig etc.)."""
        return cls(config.freq_epochs, config.freq_steps, config.freq_secs)

    def check(self, epochs: int = 0, steps: int = 0) -> bool:
        """Count `epochs` and `steps` just finished; True if any criterion is due now."""
        fire = False
        if self.freq_epoch is not None:
            self.epoch_counter += epochs
            if self.epoch_counter >= self.freq_epoch:
                self.epoch_counter = 0
                fire = True
        if self.freq_step is not None:
            self.step_counter += steps
            if self.step_counter >= self.freq_step:
                self.step_counter = 0
                fire = True
        if self.freq_sec is not None:
            now = time.monotonic()
            if _rank0_decides(now - self._last_time >= self.freq_sec):
                self._last_time = now
                fire = True
        return fire

    def state_dict(self) -> dict[str, Any]:
        # Elapsed seconds, not a timestamp: monotonic clocks do not survive a restart.
        return {
            "epoch_counter": self.epoch_counter,
            "step_counter": self.step_counter,
            "elapsed_sec": time.monotonic() - self._last_time,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch_counter = int(state["epoch_counter"])
        self.step_counter = int(state["step_counter"])
        self._last_time = time.monotonic() - float(state["elapsed_sec"])


def _rank0_decides(due: bool) -> bool:
    """Rank 0's verdict on every rank (a no-op without an initialised process group)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return due
    verdict = [due]
    dist.broadcast_object_list(verdict, src=0)
    return bool(verdict[0])
