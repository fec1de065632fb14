"""Rollout workflows: how one data item becomes one or more trajectories."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any

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
