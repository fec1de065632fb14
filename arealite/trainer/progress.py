"""One human-readable line per training step.

A long RL run is watched through its log, so each step prints the few numbers that say whether
it is healthy: reward, speed, staleness of the rollouts, and the behaviour KL (trainer vs server
logprobs; it must stay near zero, see docs/design.md), plus an ETA.

    step 12/200 | reward 0.4375 | loss 1.203 | 3.21 s/step | 1520 tok/s | staleness 1.50 |
    behave_kl 2.1e-05 | ETA 10m03s
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Mapping

from arealite.trainer.time_budget import TimeBudget

logger = logging.getLogger("arealite.progress")

# Which stat keys feed each column: the first key (in sorted order) matching a pattern wins.
# Patterns are tried in order, so `.../avg` beats a bare name and "task_reward" beats "reward".
COLUMN_PATTERNS: dict[str, tuple[str, ...]] = {
    "reward": (r"(^|/)task_reward(/avg)?$", r"(^|/)rewards?(/avg)?$", r"reward.*avg$"),
    "accuracy": (r"(^|/)acc(uracy)?(/avg)?$",),
    "loss": (r"(^|/)loss(/avg)?$", r"(^|/)\w*loss(/avg)?$"),
    "staleness": (r"(^|/)staleness(/avg)?$", r"staleness"),
    "behave_kl": (r"(^|/)behave_kl(/avg)?$", r"behave_kl"),
    "n_tokens": (r"(^|/)n_tokens$", r"(^|/)n_valid_tokens$"),
}


def find_stat(stats: Mapping[str, float], patterns: tuple[str, ...]) -> float | None:
    """The value of the first key matching one of `patterns` (tried in order), else None."""
    for pattern in patterns:
        for key in sorted(stats):
            if re.search(pattern, key):
                return float(stats[key])
    return None


def format_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def format_progress(
    step: int,
    total_steps: int | None,
    stats: Mapping[str, float] | None = None,
    secs_per_step: float | None = None,
    tokens_per_sec: float | None = None,
    eta_secs: float | None = None,
    **explicit: float | None,
) -> str:
    """The progress line of (1-based) `step`; `explicit` values (reward=..., staleness=...,
    behave_kl=...) override what is looked up in `stats`; missing columns are left out."""
    stats = stats or {}
    parts = [f"step {step}/{total_steps}" if total_steps else f"step {step}"]
    for col in ("reward", "accuracy", "loss"):
        v = explicit.get(col, find_stat(stats, COLUMN_PATTERNS[col]))
        if v is not None:
            parts.append(f"{col} {v:.4f}")
    if secs_per_step is not None:
        parts.append(f"{secs_per_step:.2f} s/step")
    if tokens_per_sec is not None:
        parts.append(f"{tokens_per_sec:.0f} tok/s")
    for col, fmt in (("staleness", "{:.2f}"), ("behave_kl", "{:.2e}")):
        v = explicit.get(col, find_stat(stats, COLUMN_PATTERNS[col]))
        if v is not None:
            parts.append(f"{col} " + fmt.format(v))
    if eta_secs is not None:
        parts.append(f"ETA {format_duration(eta_secs)}")
    return " | ".join(parts)


class ProgressLine:
    """Times the steps and logs `format_progress` every `print_every` steps.

    The printed s/step and tokens/s are means over the steps since the last line, so a slow step
    (an evaluation) is spread over its window instead of printed as the run's pace. The ETA uses
    an exponential moving average of the step time. Both leave out the first step: it also pays
    for start-up (the first batch, the evaluation before training, kernel warm-up), so that step
    prints its own time and no ETA. Tokens come from each step's `n_tokens` stat (or the
    `n_tokens` argument). A run with a `time_budget` (total_train_secs) ends by the clock when
    that comes first, so its ETA is the smaller of the two.
    """

    def __init__(
        self,
        total_steps: int | None,
        print_every: int = 1,
        ema: float = 0.8,
        time_budget: TimeBudget | None = None,
    ):
        self.total_steps = total_steps
        self.time_budget = time_budget
        self.print_every = max(1, print_every)
        self.ema = ema
        self.secs_per_step: float | None = None
        self._last = time.monotonic()
        self._first = True
        self._window_secs = 0.0  # the steps since the last printed line
        self._window_steps = 0
        self._window_tokens: float | None = 0.0

    def update(
        self,
        global_step: int,
        stats: Mapping[str, float],
        n_tokens: float | None = None,
        **explicit,
    ) -> str | None:
        """Call after (0-based) `global_step` finished; returns the line when it was logged."""
        now = time.monotonic()
        dt, self._last = now - self._last, now
        if n_tokens is None:
            n_tokens = find_stat(stats, COLUMN_PATTERNS["n_tokens"])
        if self._first:
            self._first = False
            secs, steps, tokens = dt, 1, n_tokens
        else:
            self._count_step(dt, n_tokens)
            secs, steps, tokens = self._window_secs, self._window_steps, self._window_tokens
        if (global_step + 1) % self.print_every:
            return None
        self._window_secs, self._window_steps, self._window_tokens = 0.0, 0, 0.0
        eta = None
        if self.total_steps and self.secs_per_step is not None:
            eta = self.secs_per_step * max(0, self.total_steps - global_step - 1)
        left = self.time_budget.remaining() if self.time_budget is not None else None
        if left is not None and self.secs_per_step is not None:
            eta = left if eta is None else min(eta, left)
        line = format_progress(
            global_step + 1,
            self.total_steps,
            stats,
            secs_per_step=secs / steps,
            tokens_per_sec=tokens / secs if tokens is not None and secs > 0 else None,
            eta_secs=eta,
            **explicit,
        )
        logger.info(line)
        return line

    def _count_step(self, dt: float, n_tokens: float | None) -> None:
        if self.secs_per_step is None:
            self.secs_per_step = dt
        else:
            self.secs_per_step = self.ema * self.secs_per_step + (1 - self.ema) * dt
        self._window_secs += dt
        self._window_steps += 1
        if self._window_tokens is not None:
            self._window_tokens = None if n_tokens is None else self._window_tokens + n_tokens
