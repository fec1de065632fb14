"""GRPO from the config sections: `GRPOTrainer` holds the models, the batches' source, weight
sync, the held-out evaluation and the services, and does each part of a step in one call, so
examples/grpo.py is the loop itself (README, "A training script, top to bottom").

Mode train: batches from the servers, weights pushed to them after every step. Mode
train_only: batches from a recording (`GRPORun.recording`), no server; only the version moves.
Mode rollout_only builds no trainer: `record_rollouts` generates, scores and records.
"""

from __future__ import annotations

import dataclasses
import json
import os

from arealite.api.weight_update import resolve_weight_update
from arealite.engine.lora import count_parameters, optimizer_state_bytes
from arealite.engine.ppo.actor import FSDPPPOActor
from arealite.engine.ppo.critic import FSDPPPOCritic
from arealite.recipes.grpo_run import GRPORun
from arealite.recipes.rollouts import Evaluation, RecordedRollouts, ServerRollouts
from arealite.trainer import timings
from arealite.trainer.evaluator import Evaluator
from arealite.trainer.learning_signal import NoLearningSignal
from arealite.trainer.recover import RecoverHandler
from arealite.trainer.saver import Saver
from arealite.trainer.stats_logger import StatsLogger
from arealite.trainer.time_budget import TimeBudget
from arealite.trainer.weight_sync import WeightSync


@dataclasses.dataclass
class PolicyModels:
    """The trained models: the policy (FSDP2), an optional frozen reference for the KL term,
    PPO's optional value model (trained here, never sent to the servers)."""

    actor: FSDPPPOActor
    ref: FSDPPPOActor | None
    critic: FSDPPPOCritic | None
    first_actor_step: int  # before it, the critic's warm-up: critic only

    @classmethod
    def build(cls, config, ft_spec) -> PolicyModels:
        actor = FSDPPPOActor(config.actor, max_response_len=config.gconfig.max_new_tokens)
        actor.initialize(ft_spec=ft_spec)
        ref = critic = None
        if config.ref is not None:
            ref = FSDPPPOActor(dataclasses.replace(config.ref, optimizer=None))
            ref.initialize(ft_spec=ft_spec)
        if config.critic is not None:
            critic = FSDPPPOCritic(config.critic)
            critic.initialize(ft_spec=ft_spec)
        warmup = config.critic.warmup_steps if critic is not None else 0
        return cls(actor, ref, critic, warmup)

    def destroy(self) -> None:
        for engine in (self.actor, self.ref, self.critic):
            if engine is not None:
                engine.destroy()


class GRPOTrainer:
    """One GRPO run's engines and services, built from the config sections of `run.config`."""

    def __init__(self, run: GRPORun):
        config, ft_spec = run.config, run.ft_spec
        self.run, self.config = run, config
        self.models = PolicyModels.build(config, ft_spec)
        self.actor = self.models.actor
        # The batches' source: the servers with their weight sync and evaluation, or a recording.
        self.weights = self.evaluation = None
        if run.recording is not None:
            self.rollouts = RecordedRollouts(run.recording)
        else:
            self.rollouts = ServerRollouts(run)
            weight_dir = os.path.join(config.run_dir, "weight_sync")
            update = resolve_weight_update(config)
            self.weights = WeightSync(update, self.actor, self.rollouts.executor, weight_dir)
            self.evaluation = Evaluation.build(run)
        self.total_steps = ft_spec.total_train_steps
        if self.rollouts.n_steps is not None:
            self.total_steps = min(self.total_steps, self.rollouts.n_steps)
        evaluation = self.evaluation
        self.evaluators = [evaluation.executor.engine] if evaluation is not None else []
        self.trained_log = os.path.join(config.run_dir, "rollouts", f"trained_rank{run.rank}.jsonl")
        # Services: checkpoints, evaluation, crash recovery, metrics (TensorBoard + JSONL + PNG).
        self.saver = Saver(config.saver, ft_spec, config.run_dir)
        self.evaluator = Evaluator(config.evaluator, ft_spec)
        states = {
            "model": self.actor,
            "dataloader": run.train_loader,
            "saver": self.saver,
            "evaluator": self.evaluator,
            **self.rollouts.states(),
        }
        if self.models.critic is not None:
            states["critic"] = self.models.critic
        self.recover = RecoverHandler(config.recover, ft_spec, config.run_dir, states)
        self.no_signal = NoLearningSignal(config.rollout.no_signal_steps, config.actor.group_size)
        self.logger: StatsLogger | None = None
        self.accuracy_before: float | None = None
        self.time_budget = TimeBudget(config.total_train_secs)

    def resume(self) -> int:
        """The first step to train: that of the last recover checkpoint, else 0 (then the
        held-out accuracy before training is measured). A resumed run's servers are given the
        restored weights, tagged with their version."""
        start = self.recover.load()
        if start > 0:
            self._push_weights(start)
        config = self.config
        self.logger = StatsLogger(
            config.stats_logger,
            config.run_dir,
            self.run.ft_spec,
            start_step=start,
            total_steps=self.total_steps,
            exp_config=config,
            time_budget=self.time_budget,
        )
        if self.evaluation is not None and start == 0:
            self.accuracy_before = self.evaluation.accuracy()
        self.time_budget.start()  # total_train_secs counts training, not loading
        return start

    def is_last(self, global_step: int) -> bool:
        """Whether `global_step` ends the run: the last of total_steps, or the one during which
        total_train_secs ran out (it then evaluates, the loop stops after it, and total_steps
        becomes the steps trained, which name the final export)."""
        if self.time_budget.spent(global_step):
            self.total_steps = global_step + 1
        return global_step == self.total_steps - 1

    def rollout(self, global_step: int):
        """The step's batch: async (staleness-bounded, overlaps training), sync (eta = 0) or
        recorded. Which items it trains on is logged (and recorded with rollout.record)."""
        with timings.record_timing("rollout"):
            batch, rows = self.rollouts.next_batch(global_step)
        log_trained_items(self.trained_log, global_step, rows)
        if self.run.recorder is not None:
            self.run.recorder.write(global_step, batch, rows)
        self.no_signal.observe(global_step, batch["rewards"])  # warns: equal rewards everywhere
        return batch

    def train_step(self, batch, global_step: int) -> dict:
        """Reference logprobs, values, advantages and the PPO update(s) of one step. The
        proximal policy of the decoupled loss needs no call: ppo_update takes it from its
        own forward (or recomputes it)."""
        actor, critic, ref = self.actor, self.models.critic, self.models.ref
        if ref is not None:
            with timings.record_timing("compute_logp"):
                batch["ref_logp"] = ref.compute_logp(batch)
        with timings.record_timing("train_step"):
            if critic is not None:  # values before the update feed GAE and anchor the clip
                batch["values"] = critic.compute_values(batch)
            adv_stats = actor.compute_advantages(batch)
            stats = {}
            if global_step >= self.models.first_actor_step:
                stats = actor.ppo_update(batch)
                actor.step_lr_scheduler()
            if critic is not None:
                stats.update({f"ppo_critic/{k}": v for k, v in critic.ppo_update(batch).items()})
                critic.step_lr_scheduler()
        stats.update({f"ppo_actor/{k}": v for k, v in adv_stats.items()})
        if global_step == self.models.first_actor_step:  # the optimizer: weights or adapters
            trainable, total = count_parameters(actor.model)
            stats["actor/trainable_params"] = trainable
            stats["actor/total_params"] = total
            stats["actor/optimizer_state_bytes"] = optimizer_state_bytes(actor.optimizer)
        return stats

    def publish_weights(self, version: int) -> None:
        """The servers load the actor's weights tagged `version` (new episodes wait meanwhile;
        evaluation clients then refuse a server with older ones)."""
        with timings.record_timing("update_weights"):
            self._push_weights(version)

    def _push_weights(self, version: int) -> None:
        if self.weights is None:  # no server (train_only): staleness counts from the version
            self.actor.set_version(version)
        else:
            self.weights.push(version, self.evaluators)

    def save(self, global_step: int) -> None:
        """The HF export, when due."""
        epoch, step = divmod(global_step, self.run.ft_spec.steps_per_epoch)
        self.saver.save(self.actor, epoch, step, global_step, tokenizer=self.run.tokenizer)

    def evaluate(self, global_step: int) -> dict:
        """eval/accuracy when due (always at the last step); the accuracy before training at 0."""
        if self.evaluation is None:
            return {}
        epoch, step = divmod(global_step, self.run.ft_spec.steps_per_epoch)
        last = self.is_last(global_step)

        def accuracy() -> float:  # timeperf/eval: what evaluation costs the run's wall clock
            with timings.record_timing("eval"):
                return self.evaluation.accuracy()

        acc = self.evaluator.evaluate(accuracy, epoch, step, global_step, last)
        stats = {} if acc is None else {"eval/accuracy": acc}
        if self.accuracy_before is not None and global_step == 0:
            stats["eval/accuracy_before_training"] = self.accuracy_before
        return stats

    def log(self, global_step: int, stats: dict) -> None:
        """The step's metrics: `stats`, the timings and the rollouts' counters."""
        stats.update(timings.export())
        stats.update(self.rollouts.stats())
        self.logger.commit(
            *divmod(global_step, self.run.ft_spec.steps_per_epoch), global_step, stats
        )

    def finish(self) -> None:
        """Export the final policy, close the metrics (the summary and curves.png sit next to
        metrics.jsonl), stop the clients and engines."""
        self.saver.save(
            self.actor,
            0,
            0,
            self.total_steps,
            tokenizer=self.run.tokenizer,
            name="final",
            force=True,
        )
        summary = self.logger.close()
        if summary and self.evaluation is not None:
            last = summary["last"]
            before, after = last.get("eval/accuracy_before_training"), last.get("eval/accuracy")
            print(f"held-out accuracy: {before} before GRPO -> {after} after", flush=True)
        for source in (self.rollouts, self.evaluation):
            if source is not None:
                source.destroy()
        if self.run.recorder is not None:
            self.run.recorder.close()
        self.models.destroy()


def log_trained_items(path: str, step: int, rows: list) -> None:
    """Which data items step `step` trained on (a resumed run appends its steps again)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps({"step": step, "query_ids": [r.get("query_id") for r in rows]}) + "\n")


def record_rollouts(run: GRPORun) -> None:
    """mode rollout_only: generate, score and record the run's batches; no trainer (the policy
    never changes, so the staleness bound is lifted). It ends after total_train_steps, or with
    the step during which total_train_secs ran out, as a training run does."""
    config, ft_spec = run.config, run.ft_spec
    rollouts = ServerRollouts(run, bounded=False)
    total_steps = ft_spec.total_train_steps
    time_budget = TimeBudget(config.total_train_secs)
    logger = StatsLogger(
        config.stats_logger,
        config.run_dir,
        ft_spec,
        total_steps=total_steps,
        exp_config=config,
        time_budget=time_budget,
    )
    time_budget.start()
    for global_step in range(total_steps):
        with timings.record_timing("rollout"):
            batch, rows = rollouts.next_batch(global_step)
        stats = {"rollout/episodes_recorded": run.recorder.write(global_step, batch, rows)}
        stats.update(timings.export())
        stats.update(rollouts.stats())
        logger.commit(*divmod(global_step, ft_spec.steps_per_epoch), global_step, stats)
        if time_budget.spent(global_step):
            break
    logger.close()
    run.recorder.close()
    rollouts.destroy()
