"""The rollout workflow contract: how one data item becomes trajectories.

A workflow drives an InferenceEngine through one episode; `arealite.rollout.WorkflowExecutor`
runs many of them in the background under the staleness bound.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from tensordict import TensorDict

    from arealite.api.engine_api import InferenceEngine


class RolloutWorkflow(abc.ABC):
    """One episode of interaction between a policy (through an InferenceEngine) and a task."""

    @abc.abstractmethod
    async def arun_episode(
        self, engine: InferenceEngine, data: dict[str, Any]
    ) -> TensorDict | None:
        """Run one episode on `data` and return its trajectories as a padded TensorDict
        `[n, L]` (input_ids, attention_mask, loss_mask, logprobs, versions, rewards, ...),
        or None to reject the episode (its slot is freed and it is counted as rejected)."""


class RolloutError(RuntimeError):
    """A workflow (or its `should_accept`) raised on one data item.

    Carries the item so the caller can log or skip it; the original exception is `__cause__`.
    """

    def __init__(self, data: Any, workflow: Any, cause: BaseException):
        text = repr(data)
        text = text if len(text) <= 300 else text[:300] + "...}"
        super().__init__(
            f"{type(workflow).__name__}.arun_episode failed on data item {text}: "
            f"{type(cause).__name__}: {cause}"
        )
        self.data = data
        self.workflow = workflow
        self.__cause__ = cause


class GroupFilter(Protocol):
    """`WorkflowExecutor.prepare_batch`'s `group_filter`: which data items start (e.g. not a
    prompt its recent groups all solved) and which finished groups go to the trainer."""

    def should_start(self, data: Any) -> bool:
        """False: skip `data` (no episode; the executor pulls another item in its place)."""

    def should_accept(self, data: Any, group: TensorDict) -> bool:
        """Whether the finished group of `data` goes to the trainer."""
