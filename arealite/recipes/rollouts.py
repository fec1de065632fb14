"""Where each GRPO step's batch comes from: the inference servers (`ServerRollouts`), or a
recording (`RecordedRollouts`, mode train_only); and the held-out `Evaluation`.

Both sources answer `next_batch(step) -> (batch, the dataset rows of its episodes)`, `states()`
(what recovery saves of them), `stats()` (their per-step metrics) and `destroy()`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import torch
import torch.distributed as dist

from arealite.recipes.grpo_run import GRPORun, dataloader, reward_of, reward_pool_of
from arealite.reward.errors import RewardFailFastError
from arealite.rollout import WorkflowExecutor
from arealite.rollout.group_filter import InformativeGroupFilter
from arealite.rollout.record import RecordedBatches
from arealite.rollout.server_load import ServerLoadMeter
from arealite.utils.distributed import all_gather_int

REWARD_IN_POOL = None  # a workflow's `reward_fn`: the reward runs in its `reward_pool` instead
UNBOUNDED = 10**6  # a staleness bound no run reaches


class ServerRollouts:
    """Each step's batch from the inference servers: episodes run in the background
    (staleness-bounded, overlapping training) or, at eta = 0, synchronously. `bounded=False`
    (mode rollout_only: the policy never changes) lifts the staleness bound."""

    def __init__(self, run: GRPORun, bounded: bool = True):
        config, world, rank = run.config, run.world, run.rank
        rollout_cfg = config.rollout
        if not bounded:
            rollout_cfg = dataclasses.replace(rollout_cfg, max_head_offpolicyness=UNBOUNDED)
        self.sync = rollout_cfg.max_head_offpolicyness == 0 and not rollout_cfg.dynamic_sampling
        self.executor = WorkflowExecutor(rollout_cfg, run.rollout_engine(rollout_cfg))
        self.executor.initialize(train_data_parallel_size=world)
        self.reward_pool = reward_pool_of(
            *reward_of(config),
            workers=rollout_cfg.reward_workers,
            timeout=rollout_cfg.reward_timeout,
            fail_fast=rollout_cfg.reward_fail_fast(),
        )
        dump_dir = os.path.join(config.run_dir, "rollouts") if rank == 0 else None
        self.workflow = run.workflow_cls(
            REWARD_IN_POOL,
            config.gconfig,
            run.processor or run.tokenizer,
            reward_pool=self.reward_pool,
            dump_dir=dump_dir,
        )
        self.group_filter = None  # DAPO's dynamic sampling: equal-reward groups resampled
        if rollout_cfg.dynamic_sampling:
            self.group_filter = InformativeGroupFilter(
                config.train_dataset.batch_size // world,
                rollout_cfg.dynamic_sampling_max_oversample,
                skip_max_prob=rollout_cfg.dynamic_sampling_skip_max_prob,
                seed=config.seed + rank,
            )
        self.load_meter = ServerLoadMeter(self.executor.engine)
        # The iterator starts at the first batch: after recover.load() restored the loader's
        # position (an iterator made earlier would start the epoch again).
        self.loader, self.data_iter = run.train_loader, None
        self.n_steps = None  # as many steps as the run asks for

    def next_batch(self, step: int):
        """(batch, the dataset rows of its episodes). A step in which every reward call failed
        raises RewardFailFastError here, before it is trained on (arealite/reward/errors.py)."""
        batch, rows = self._rollout()
        if self.reward_pool is not None:
            try:
                self.reward_pool.end_step()
            except RewardFailFastError:  # cancel the episodes in flight first: at exit their
                self.executor.destroy()  # calls would fail on the closed pool, burying this
                raise
        return batch, rows

    def _rollout(self):
        if not self.sync:
            return self.executor.prepare_batch(
                self.loader, self.workflow, group_filter=self.group_filter, return_data=True
            )
        if self.data_iter is None:
            self.data_iter = iter(self.loader)
        rows = next(self.data_iter, None)
        if rows is None:  # epoch end
            self.data_iter = iter(self.loader)
            rows = next(self.data_iter)
        return self.executor.rollout_batch(rows, self.workflow, return_data=True)

    def states(self) -> dict:
        return {"rollout": self.executor, "workflow": self.workflow}  # reward counters continue

    def stats(self) -> dict:
        stats = self.group_filter.take_stats() if self.group_filter is not None else {}
        stats.update({f"rollout/{k}": v for k, v in self.workflow.reward_stats.items()})
        # Accepted past the staleness bound while over-provisioning for refusals, so dropped.
        stats["rollout/surplus_total"] = self.executor.stats()["surplus"]
        stats.update(self.load_meter.step_stats())
        if hasattr(self.reward_pool, "component_stats"):  # a weighted sum: each reward's mean
            stats.update(self.reward_pool.component_stats())
        return stats

    def destroy(self) -> None:
        self.executor.destroy()
        self.executor.engine.destroy()


class RecordedRollouts:
    """mode train_only: each step's batch as a recording holds it (no server)."""

    def __init__(self, recording: RecordedBatches):
        self.recording = recording
        # The run stops at the recording's end: the steps every rank holds (ranks recorded by a
        # run ended by the clock or cut short may differ by a step; none may train alone).
        self.n_steps = min(all_gather_int(recording.n_steps))

    def next_batch(self, step: int):
        rows = [{"query_id": q} for q in self.recording.query_ids(step)]
        return self.recording.batch(step), rows

    def states(self) -> dict:
        return {}

    def stats(self) -> dict:
        return {}

    def destroy(self) -> None:
        pass


@dataclasses.dataclass
class Evaluation:
    """Held-out accuracy (mean reward; greedy, or sampled as `evaluator` says) on a separate
    client, so evaluation never counts against the training rollouts' staleness budget."""

    accuracy: Callable[[], float]
    executor: WorkflowExecutor

    @classmethod
    def build(cls, run: GRPORun) -> Evaluation | None:
        """The run's Evaluation, or None without a valid_dataset."""
        config, world = run.config, run.world
        if config.valid_dataset is None:
            return None
        valid = dataloader(
            config.valid_dataset,
            run.rank,
            world,
            run.tokenizer,
            shuffle=False,
            processor=run.processor,
        )
        rows = [row for batch in valid for row in batch]
        eval_cfg = dataclasses.replace(
            config.rollout,
            consumer_batch_size=max(1, len(rows)),
            max_head_offpolicyness=UNBOUNDED,
            max_concurrent_rollouts=max(1, len(rows)),
            queue_size=None,
        )
        executor = WorkflowExecutor(eval_cfg, run.rollout_engine(eval_cfg))
        executor.initialize(train_data_parallel_size=world)
        sampling = config.evaluator
        gconfig = config.gconfig.new(
            n_samples=sampling.n_samples,
            greedy=sampling.temperature == 0,
            temperature=sampling.temperature,
        )
        reward = (config.eval_reward, None) if config.eval_reward else reward_of(config)
        pool = reward_pool_of(
            *reward,
            workers=1,
            timeout=config.rollout.reward_timeout,
            fail_fast=config.rollout.reward_fail_fast(),
        )
        workflow = run.workflow_cls(
            REWARD_IN_POOL, gconfig, run.processor or run.tokenizer, reward_pool=pool
        )

        def accuracy() -> float:
            batch = executor.rollout_batch(rows, workflow)
            if pool is not None:  # an evaluation in which every reward call failed stops the run
                pool.end_step("evaluation")
            rewards = batch["rewards"]
            # float64: 228 of 400 is 0.57, not float32's 0.5699999928 (a level missed by a tie)
            correct = torch.tensor(
                [float(rewards.sum()), float(rewards.numel())], dtype=torch.float64
            )
            if world > 1:
                dist.all_reduce(correct)
            return (correct[0] / correct[1].clamp(min=1)).item()

        return cls(accuracy, executor)

    def destroy(self) -> None:
        self.executor.destroy()
        self.executor.engine.destroy()
