"""What a RewardPool does with failing reward calls: log each kind of failure once (then only its
count, at 10, 100, 1000, ...), and stop the run when the reward is plainly broken.

Why stop: a reward that raises scores 0, and a run on all-zero rewards trains on nothing for
hours while looking healthy (issue 23: 208 calls raised TypeError, 12 steps trained on zeros).
Two rules, both from `rollout.*` (InferenceEngineConfig): the first `first_calls` calls all
failed, or more than `max_error_rate` of the last `window` calls failed. A reward that fails on
a few odd rows (a bug on one row in eight) keeps running, counted in `rollout/errors`.
"""

from __future__ import annotations

import logging
import traceback
from collections import Counter, deque
from dataclasses import dataclass

logger = logging.getLogger("arealite.reward")


class RewardFailFastError(RuntimeError):
    """The reward failed too often: the message has the spec, the counts by kind and the first
    traceback. Raised from the reward call, so the episode fails and the run stops."""


@dataclass(frozen=True)
class FailFast:
    """When a RewardPool gives up on its reward (see the module docstring)."""

    first_calls: int = 64  # the first N calls all failed: stop (0 = off)
    max_error_rate: float = 0.5  # more than this fraction of the last `window` failed: stop
    window: int = 256

    def __post_init__(self):
        if self.first_calls < 0 or self.window < 1 or not 0.0 <= self.max_error_rate <= 1.0:
            raise ValueError(
                f"FailFast needs first_calls >= 0, window >= 1, 0 <= max_error_rate <= 1; "
                f"got {self}"
            )


def _is_log_point(n: int) -> bool:
    """1, 10, 100, 1000, ...: a kind's count is logged there, not at every call."""
    while n % 10 == 0:
        n //= 10
    return n == 1


class RewardErrors:
    """Outcomes of one reward's calls: logs failures once per kind with a count, and raises
    RewardFailFastError (then on every later failure) once `policy` says the reward is broken."""

    def __init__(self, name: str, policy: FailFast | None = None):
        self.name = name
        self.policy = policy
        self.calls = 0
        self.kinds: Counter[str] = Counter()
        self.first_traceback: str | None = None
        self.tripped: str | None = None
        self._recent: deque[bool] = deque(maxlen=policy.window if policy else 1)

    def ok(self) -> None:
        self.calls += 1
        self._recent.append(False)

    def failed(self, kind: str, error: BaseException | None = None) -> None:
        """Count a failure of `kind` ("TypeError", "timeout", ...); raise if the run must stop."""
        self.calls += 1
        self._recent.append(True)
        self.kinds[kind] += 1
        if self.first_traceback is None and error is not None:
            self.first_traceback = "".join(traceback.format_exception(error)).rstrip()
        n = self.kinds[kind]
        if n == 1:
            detail = f"{type(error).__name__}: {error}" if error is not None else kind
            logger.warning("reward %s failed (%s); it scores 0. Repeats of this kind of failure "
                           "are logged by count only", self.name, detail)  # fmt: skip
        elif _is_log_point(n):
            logger.warning("reward %s: %s %d times so far (%d calls)", self.name, kind, n,
                           self.calls)  # fmt: skip
        self._check()

    def _check(self) -> None:
        p = self.policy
        if self.tripped is None and p is not None:
            n_failed = sum(self.kinds.values())
            if p.first_calls and self.calls == n_failed == p.first_calls:
                self.tripped = f"its first {p.first_calls} calls all failed"
            recent = sum(self._recent)
            full = len(self._recent) == p.window
            if self.tripped is None and full and recent > p.max_error_rate * p.window:
                self.tripped = (
                    f"{recent} of its last {p.window} calls failed (over "
                    f"rollout.max_reward_error_rate={p.max_error_rate})"
                )
        if self.tripped is not None:
            raise RewardFailFastError(self.describe())

    def describe(self) -> str:
        kinds = ", ".join(f"{k} x{n}" for k, n in self.kinds.most_common())
        return (
            f"reward {self.name} is broken: {self.tripped} ({sum(self.kinds.values())} failed "
            f"of {self.calls} calls: {kinds}); the run stops rather than train on zero "
            "rewards (rollout.reward_fail_fast_calls, rollout.max_reward_error_rate and "
            "rollout.reward_error_window set when). First traceback:\n"
            f"{self.first_traceback or '(none: timeouts only)'}"
        )
