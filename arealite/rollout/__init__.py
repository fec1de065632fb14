"""Rollout: the WorkflowExecutor that runs episodes in the background, and the staleness rule.

May import `arealite.api` and `arealite.utils` (never `engine`: it drives any InferenceEngine).
"""

from arealite.rollout.episodes import RolloutStat
from arealite.rollout.executor import WorkflowExecutor
from arealite.rollout.staleness import StalenessController

__all__ = ["RolloutStat", "StalenessController", "WorkflowExecutor"]
