"""`total_train_secs`: a run that ends by the wall clock instead of a step count.

A Slurm job has a time limit, a benchmark compares arms at equal wall clock, a laptop user has
the afternoon: each wants the run to end on its own, on a step boundary, with that step's
held-out evaluation, the final export and the summary, as if it were the last of
`total_train_steps`. Killing it instead loses the final export and leaves the progress line's ETA
counting the steps it will never train. The LR schedule still spans `total_train_steps` (the
budget is not known in steps beforehand), so a decaying schedule stops part-way.

The clock starts at the first step of this launch (after model loading and the evaluation before
training); a resumed run gets its budget again. Every rank takes rank 0's decision, so no rank
leaves the loop while another enters a collective of the next step.
"""

from __future__ import annotations

import time

import torch.distributed as dist


class TimeBudget:
    """Whether a step is the last one by the clock; `remaining()` feeds the ETA."""

    def __init__(self, secs: float | None):
        self.secs = secs
        self._start: float | None = None
        self._decided: tuple[int, bool] | None = None  # (step, last?): asked again, same answer

    def start(self) -> None:
        self._start = time.monotonic()

    def remaining(self) -> float | None:
        """Seconds left (>= 0), or None without a budget or before `start`."""
        if self.secs is None or self._start is None:
            return None
        return max(0.0, self._start + self.secs - time.monotonic())

    def spent(self, global_step: int) -> bool:
        """Whether the budget has run out by step `global_step`'s services (its evaluation and
        export): decided once per step, by rank 0 for every rank."""
        if self.secs is None:
            return False
        if self._decided is not None and self._decided[0] == global_step:
            return self._decided[1]
        if self._start is None:
            self.start()
        spent = [self.remaining() == 0.0]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(spent, src=0)
        self._decided = (global_step, bool(spent[0]))
        return self._decided[1]
