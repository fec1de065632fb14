"""What a RewardPool does with failing reward calls: log each kind of failure once (then only its
count, at 10, 100, 1000, ...), and stop the run when the reward is plainly broken.

Why stop: a reward that raises scores 0, and a run on all-zero rewards trains on nothing for
hours while looking healthy.
Two rules, both from `rollout.*` (RolloutConfig):
- a step in which every reward call failed (`steps` such steps in a row; default 1): checked by
  the trainer when a step's batch is complete (`end_step`), before it trains on it. Per step,
  not per N calls, so a reward that always raises stops in the first step whatever the batch
  size (a rule of "the first N calls" would let a batch smaller than N train on zeros);
- more than `max_error_rate` of the last `window` calls failed (a reward that broke mid-run,
  or fails on most rows), checked at each failed call.
A reward that fails on a few odd rows (a bug on one row in eight) keeps running, counted in
`rollout/errors`.
"""

from __future__ import annotations

import logging
import threading
import traceback
from collections import Counter, deque

from arealite.api.reward_api import FailFast

logger = logging.getLogger("arealite.reward")


class RewardFailFastError(RuntimeError):
    """The reward failed too often: the message has the spec, the counts by kind and the first
    traceback. Raised from the reward call, so the episode fails and the run stops."""


def _is_log_point(n: int) -> bool:
    """1, 10, 100, 1000, ...: a kind's count is logged there, not at every call."""
    while n % 10 == 0:
        n //= 10
    return n == 1


class RewardErrors:
    """Outcomes of one reward's calls: logs failures once per kind with a count, and raises
    RewardFailFastError (then on every later failure) once `policy` says the reward is broken.
    Calls are counted on the rollout thread and `end_step` runs on the trainer's: a lock keeps
    a step's counts consistent."""

    def __init__(self, name: str, policy: FailFast | None = None):
        self.name = name
        self.policy = policy
        self.calls = 0
        self.kinds: Counter[str] = Counter()
        self.first_traceback: str | None = None
        self.tripped: str | None = None
        self._recent: deque[bool] = deque(maxlen=policy.window if policy else 1)
        self._lock = threading.Lock()
        self._step_calls = self._step_failed = 0  # since the last end_step
        self._failed_steps = 0  # steps in a row in which every call failed

    def ok(self) -> None:
        with self._lock:
            self.calls += 1
            self._step_calls += 1
            self._recent.append(False)

    def failed(self, kind: str, error: BaseException | None = None) -> None:
        """Count a failure of `kind` ("TypeError", "timeout", ...); raise if the run must stop."""
        with self._lock:
            self.calls += 1
            self._step_calls += 1
            self._step_failed += 1
            self._recent.append(True)
            self.kinds[kind] += 1
        if self.first_traceback is None and error is not None:
            self.first_traceback = "".join(traceback.format_exception(error)).rstrip()
        n = self.kinds[kind]
        if n == 1:
            detail = f"{type(error).__name__}: {error}" if error is not None else kind
            logger.warning(
                "reward %s failed (%s); it scores 0. Repeats of this kind of failure "
                "are logged by count only",
                self.name,
                detail,
            )
        elif _is_log_point(n):
            logger.warning(
                "reward %s: %s %d times so far (%d calls)", self.name, kind, n, self.calls
            )
        self._check()

    def end_step(self, what: str = "step") -> None:
        """The trainer's step boundary: its batch is complete (`what`: "step", or "evaluation"
        for a held-out pass). Raise if every reward call since the previous boundary failed (in
        `policy.steps` such steps in a row); a step without calls (its episodes were scored
        earlier) changes nothing."""
        with self._lock:
            calls, failed = self._step_calls, self._step_failed
            self._step_calls = self._step_failed = 0
        p = self.policy
        if p is None or not p.steps or calls == 0:
            return
        self._failed_steps = self._failed_steps + 1 if failed == calls else 0
        if self.tripped is None and self._failed_steps >= p.steps:
            in_row = f" ({p.steps} steps in a row)" if p.steps > 1 else ""
            article = "an" if what[0] in "aeiou" else "a"
            self.tripped = f"all {calls} of its calls in {article} {what} failed{in_row}"
        if self.tripped is not None:
            raise RewardFailFastError(self.describe())

    def _check(self) -> None:
        p = self.policy
        if self.tripped is None and p is not None:
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
        with self._lock:
            counts, calls = self.kinds.most_common(), self.calls
        kinds = ", ".join(f"{k} x{n}" for k, n in counts)
        return (
            f"reward {self.name} is broken: {self.tripped} ({sum(n for _, n in counts)} failed "
            f"of {calls} calls: {kinds}); the run stops rather than train on zero "
            "rewards (rollout.reward_fail_fast_steps, rollout.max_reward_error_rate and "
            "rollout.reward_error_window set when). First traceback:\n"
            f"{self.first_traceback or '(none: timeouts only)'}"
        )
