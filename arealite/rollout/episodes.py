"""An episode (one data item through a workflow), how one runs, and the rollout's counters.

What may start and what became of each episode is kept by `Admission` (admission.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tensordict import TensorDict

from arealite.api.workflow_api import RolloutError, RolloutWorkflow
from arealite.rollout.replay import Cursor

if TYPE_CHECKING:
    from arealite.api.engine_api import InferenceEngine


@dataclass
class RolloutStat:
    """Episode counters since the start of training (restored on recovery)."""

    submitted: int = 0  # handed to submit()
    running: int = 0  # started and not finished
    accepted: int = 0  # finished and accepted (consumed or not)
    rejected: int = 0  # finished as None or refused by should_accept
    failed: int = 0  # raised an exception
    surplus: int = 0  # accepted past the staleness bound (over-provisioning), dropped


class BatchCall:
    """The episodes of one `rollout_batch` call: results come back to it, in input order."""

    def __init__(self, n: int):
        self.results: list[TensorDict | None] = [None] * n
        self.done = 0
        self.error: RolloutError | None = None


@dataclass
class Episode:
    data: Any
    workflow: RolloutWorkflow
    should_accept: Callable[[TensorDict], bool] | None
    batch_call: BatchCall | None = None  # a rollout_batch call's: kept in its input order
    index: int = 0  # its place in that call
    cursor: Cursor | None = None  # where prepare_batch pulled it from
    start_version: int = 0  # policy version when it started (its staleness counts from here)


async def run_episode(ep: Episode, engine: InferenceEngine) -> TensorDict | None:
    """The episode, then its acceptance test; any exception is the episode's failure."""
    result = await ep.workflow.arun_episode(engine, ep.data)
    if result is not None and not isinstance(result, TensorDict):
        raise TypeError(
            f"arun_episode must return a TensorDict or None, got {type(result).__name__}"
        )
    if result is not None and ep.should_accept is not None and not ep.should_accept(result):
        return None
    return result
