"""Wall-clock seconds of each phase of a training step, as `timeperf/<phase>` metrics.

Every other per-step statistic is computed where its data lives and returned as a dict (the PPO
update's in engine/ppo/update_stats.py, the rollout's counters in the executor); only the phases'
durations are gathered here, because they are measured around calls in the trainer's loop.

    with timings.record_timing("train_step"):
        stats = actor.ppo_update(batch)
    stats.update(timings.export())  # {"timeperf/train_step": 0.41}
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator

_seconds: dict[str, list[float]] = defaultdict(list)


@contextlib.contextmanager
def record_timing(phase: str) -> Iterator[None]:
    """Time the block as `timeperf/<phase>` (a phase timed twice in a step reports the mean)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        _seconds[phase].append(time.perf_counter() - start)


def export() -> dict[str, float]:
    """This process's phase times since the last export, then forgets them."""
    out = {f"timeperf/{phase}": sum(s) / len(s) for phase, s in _seconds.items()}
    _seconds.clear()
    return out
