"""GRPO for any task: asynchronous rollouts, decoupled PPO, FSDP2. The task is the config's
`train_dataset` / `valid_dataset` (a built-in task or your own file) and `reward:` (a built-in
name or your own function); see README "Bring your own task".

    python -m arealite.launcher.local examples/grpo.py --config examples/configs/gsm8k_grpo.yaml \
        experiment_name=gsm8k trial_name=run1 actor.path=Qwen/Qwen2.5-1.5B-Instruct

Rows with images (a vision task, or a model folder with an image processor) run
VisionRLVRWorkflow with the model's processor.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
from torchdata.stateful_dataloader import StatefulDataLoader
from transformers import AutoTokenizer

from arealite.agent.route import AgentRoute
from arealite.api.cli_args import GRPOConfig, load_expr_config
from arealite.api.io_struct import FinetuneSpec
from arealite.api.weight_update import resolve_weight_update
from arealite.engine.lora import count_parameters, optimizer_state_bytes
from arealite.engine.ppo.actor import FSDPPPOActor
from arealite.engine.ppo.critic import FSDPPPOCritic
from arealite.inference import make_remote_engine
from arealite.reward import make_reward_pool
from arealite.rollout import WorkflowExecutor
from arealite.rollout.group_filter import InformativeGroupFilter
from arealite.rollout.record import EpisodeRecorder, RecordedBatches, check_recording
from arealite.rollout.server_load import ServerLoadMeter
from arealite.server.colocated import ColocatedEngine, ColocatedGenerator
from arealite.tasks import default_reward, is_vision_dataset, load_rows
from arealite.trainer.evaluator import Evaluator
from arealite.trainer.learning_signal import NoLearningSignal
from arealite.trainer.recover import RecoverHandler, ResumableSampler
from arealite.trainer.saver import Saver
from arealite.trainer.stats_logger import StatsLogger
from arealite.trainer.weight_sync import WeightSync
from arealite.utils import distributed as du
from arealite.utils import stats_tracker
from arealite.utils.reward_errors import RewardFailFastError
from arealite.utils.run_lock import claim_run_dir
from arealite.utils.vision import load_vlm_processor
from arealite.workflow.rlvr import RLVRWorkflow
from arealite.workflow.vision_rlvr import VisionRLVRWorkflow

REWARD_IN_POOL = None  # a workflow's `reward_fn`: the reward runs in its `reward_pool` instead


def dataloader(cfg, rank, world, tokenizer, split=None, shuffle=None, seed=0, processor=None):
    """This rank's share of a dataset, in rows (the workflow tokenizes)."""
    ds = load_rows(cfg if split is None else dataclasses.replace(cfg, split=split), rank, world,
                   "rl", tokenizer, processor)  # fmt: skip
    order = ResumableSampler(len(ds), cfg.shuffle if shuffle is None else shuffle, seed)
    return StatefulDataLoader(
        ds, batch_size=max(1, cfg.batch_size // world), collate_fn=lambda rows: rows,
        sampler=order, drop_last=cfg.drop_last,
    )  # fmt: skip


@dataclasses.dataclass
class Evaluation:
    """Greedy held-out accuracy (mean reward) on a separate client, so evaluation never counts
    against the training rollouts' staleness budget."""

    accuracy: Callable[[], float]
    executor: WorkflowExecutor

    def destroy(self) -> None:
        self.executor.destroy()
        self.executor.engine.destroy()


def make_rollout_engine(config, rollout_cfg, rank: int):
    """The rollout client: HTTP to the inference servers, or (allocation_mode colocated+...)
    this rank's in-process generator, which training and evaluation share."""
    if not config.allocation.colocated:
        return make_remote_engine(config.allocation.gen_backend, rollout_cfg)
    server = config.server
    generator = ColocatedGenerator.shared(server.model_path or config.actor.path, server.dtype,
                                          du.current_device(), config.seed + rank,
                                          server.max_batch_size)  # fmt: skip
    return ColocatedEngine(rollout_cfg, generator)


def make_evaluation(config, rank, world, tokenizer, workflow_cls, processor=None):
    """The run's Evaluation, or None without a valid_dataset."""
    if config.valid_dataset is None:
        return None
    valid = dataloader(config.valid_dataset, rank, world, tokenizer, shuffle=False,
                       processor=processor)  # fmt: skip
    rows = [row for batch in valid for row in batch]
    eval_cfg = dataclasses.replace(
        config.rollout, consumer_batch_size=max(1, len(rows)), max_head_offpolicyness=10**6,
        max_concurrent_rollouts=max(1, len(rows)), queue_size=None,
    )  # fmt: skip
    engine = make_rollout_engine(config, eval_cfg, rank)
    engine.initialize()
    executor = WorkflowExecutor(eval_cfg, engine)
    executor.initialize(train_data_parallel_size=world)
    gconfig = config.gconfig.new(n_samples=1, greedy=True, temperature=0.0)
    reward = (config.eval_reward, None) if config.eval_reward else reward_of(config)
    pool = reward_pool_of(*reward, workers=1, timeout=config.rollout.reward_timeout,
                          fail_fast=config.rollout.reward_fail_fast())  # fmt: skip
    workflow = workflow_cls(REWARD_IN_POOL, gconfig, processor or tokenizer, reward_pool=pool)

    def accuracy() -> float:
        batch = executor.rollout_batch(rows, workflow)
        if pool is not None:  # an evaluation in which every reward call failed stops the run
            pool.end_step("evaluation")
        correct = torch.tensor([float(batch["rewards"].sum()), float(len(rows))])
        if world > 1:
            dist.all_reduce(correct)
        return (correct[0] / correct[1].clamp(min=1)).item()

    return Evaluation(accuracy, executor)


def log_trained_items(path: str, step: int, rows: list) -> None:
    """Which data items step `step` trained on (a resumed run appends its steps again)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps({"step": step, "query_ids": [r.get("query_id") for r in rows]}) + "\n")


def reward_of(config) -> tuple:
    """(reward, reward_weights) of the config, or the built-in task's own reward."""
    reward = config.reward or default_reward(config.train_dataset.path)
    if reward is None and config.agent.command:  # the agent answers its own rewards
        return None, None
    if reward is None:
        raise ValueError(
            f"train_dataset.path={config.train_dataset.path!r} is your own data: set `reward:` "
            "(e.g. reward: my_rewards.py:score; see arealite/api/reward_api.py)"
        )
    return reward, config.reward_weights


def reward_pool_of(reward, weights, workers: int, timeout: float, fail_fast=None):
    """The reward's process pool; None when there is no reward (an agent that rewards itself)."""
    if reward is None:
        return None
    return make_reward_pool(reward, weights, workers, timeout, fail_fast)


def resolve_workflow(config, tokenizer, workflow_cls, load_processor):
    """(episode factory, processor): the caller's, VisionRLVRWorkflow for rows with images,
    RLVRWorkflow otherwise; `agent.command` routes episodes through an AgentProxy."""
    processor_path = config.tokenizer_path or config.actor.path
    if workflow_cls is None and is_vision_dataset(config.train_dataset.path, processor_path):
        workflow_cls, load_processor = VisionRLVRWorkflow, load_processor or load_vlm_processor
    workflow_cls = workflow_cls or RLVRWorkflow
    if config.agent.command:  # agent.command: an AgentProxy + the agent's processes serve episodes
        workflow_cls = AgentRoute(config.agent, tokenizer)
    return workflow_cls, load_processor(processor_path) if load_processor else None


class ServerRollouts:
    """Each step's batch from the inference servers: episodes run in the background
    (staleness-bounded, overlapping training) or, at eta = 0, synchronously."""

    n_steps = 10**12  # as many steps as the run asks for

    def __init__(self, config, world, rank, tokenizer, workflow_cls, processor, loader):
        rollout_cfg = config.rollout
        if config.mode == "rollout_only":  # the policy never changes: no staleness bound
            rollout_cfg = dataclasses.replace(rollout_cfg, max_head_offpolicyness=10**6)
        self.sync = rollout_cfg.max_head_offpolicyness == 0 and not config.actor.dynamic_sampling
        engine = make_rollout_engine(config, rollout_cfg, rank)
        engine.initialize()
        self.executor = WorkflowExecutor(rollout_cfg, engine)
        self.executor.initialize(train_data_parallel_size=world)
        self.reward_pool = reward_pool_of(*reward_of(config), workers=rollout_cfg.reward_workers,
                                          timeout=rollout_cfg.reward_timeout,
                                          fail_fast=rollout_cfg.reward_fail_fast())  # fmt: skip
        self.workflow = workflow_cls(
            REWARD_IN_POOL, config.gconfig, processor or tokenizer, reward_pool=self.reward_pool,
            dump_dir=os.path.join(config.run_dir, "rollouts") if rank == 0 else None,
        )  # fmt: skip
        self.group_filter = None  # DAPO's dynamic sampling: equal-reward groups resampled
        if config.actor.dynamic_sampling:
            self.group_filter = InformativeGroupFilter(
                config.train_dataset.batch_size // world,
                config.actor.dynamic_sampling_max_oversample,
                skip_max_prob=config.actor.dynamic_sampling_skip_max_prob,
                seed=config.seed + rank,
            )
        self.load_meter = ServerLoadMeter(engine)
        # The iterator starts at the first batch: after recover.load() restored the loader's
        # position (an iterator made earlier would start the epoch again).
        self.loader, self.data_iter = loader, None

    def next_batch(self, step: int):
        """(batch, the dataset rows of its episodes). A step in which every reward call failed
        raises RewardFailFastError here, before it is trained on (reward_errors.py)."""
        batch = self._rollout()
        if self.reward_pool is not None:
            try:
                self.reward_pool.end_step()
            except RewardFailFastError:  # cancel the episodes in flight first: at exit their
                self.executor.destroy()  # calls would fail on the closed pool, burying this
                raise
        return batch, self.executor.last_batch_data

    def _rollout(self):
        if not self.sync:
            return self.executor.prepare_batch(self.loader, self.workflow, self.group_filter)
        if self.data_iter is None:
            self.data_iter = iter(self.loader)
        rows = next(self.data_iter, None)
        if rows is None:  # epoch end
            self.data_iter = iter(self.loader)
            rows = next(self.data_iter)
        return self.executor.rollout_batch(rows, self.workflow)

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

    def __init__(self, record_dir: str, world: int, rank: int):
        self.recording = RecordedBatches(record_dir, rank, world)
        self.n_steps = self.recording.n_steps  # the run stops at the recording's end

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
class Trainers:
    """The trained models: the policy (FSDP2), an optional frozen reference for the KL term,
    PPO's optional value model (trained here, never sent to the servers)."""

    actor: FSDPPPOActor
    ref: FSDPPPOActor | None
    critic: FSDPPPOCritic | None
    first_actor_step: int  # before it, the critic's warm-up: critic only

    @classmethod
    def build(cls, config, ft_spec):
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

    def train(self, batch, global_step: int) -> dict:
        """Reference logprobs, values, advantages and the PPO update(s) of one step. The
        proximal policy of the decoupled loss needs no call: ppo_update takes it from its
        own forward (or recomputes it)."""
        actor, critic = self.actor, self.critic
        if self.ref is not None:
            with stats_tracker.record_timing("compute_logp"):
                batch["ref_logp"] = self.ref.compute_logp(batch)
        with stats_tracker.record_timing("train_step"):
            if critic is not None:  # values before the update feed GAE and anchor the clip
                batch["values"] = critic.compute_values(batch)
            adv_stats = actor.compute_advantages(batch)
            stats = {}
            if global_step >= self.first_actor_step:
                stats = actor.ppo_update(batch)
                actor.step_lr_scheduler()
            if critic is not None:
                stats.update({f"ppo_critic/{k}": v for k, v in critic.ppo_update(batch).items()})
                critic.step_lr_scheduler()
        stats.update({f"ppo_actor/{k}": v for k, v in adv_stats.items()})
        if global_step == self.first_actor_step:  # what the optimizer holds: weights or adapters
            trainable, total = count_parameters(actor.model)
            stats.update({"actor/trainable_params": trainable, "actor/total_params": total,
                          "actor/optimizer_state_bytes": optimizer_state_bytes(actor.optimizer)})  # fmt: skip
        return stats

    def destroy(self) -> None:
        for engine in (self.actor, self.ref, self.critic):
            if engine is not None:
                engine.destroy()


def publish_weights(weights: WeightSync | None, actor, version: int, evaluators) -> None:
    """The servers load the actor's weights tagged `version` (new episodes wait meanwhile;
    evaluation clients then refuse a server with older ones). Without servers (train_only)
    only the version moves: staleness is measured against it."""
    if weights is None:
        actor.set_version(version)
    else:
        weights.push(version, evaluators)


def evaluation_stats(evaluation, evaluator, global_step, total_steps, accuracy_before) -> dict:
    """eval/accuracy when due (always at the last step); the accuracy before training at 0."""
    if evaluation is None:
        return {}
    epoch, step = divmod(global_step, evaluator.ft_spec.steps_per_epoch)
    last = global_step == total_steps - 1
    acc = evaluator.evaluate(evaluation.accuracy, epoch, step, global_step, force=last)
    stats = {} if acc is None else {"eval/accuracy": acc}
    if accuracy_before is not None and global_step == 0:
        stats["eval/accuracy_before_training"] = accuracy_before
    return stats


def record_rollouts(config, rollouts, recorder, ft_spec, total_steps: int) -> None:
    """mode rollout_only: generate, score and record `total_steps` batches; no trainer."""
    logger = StatsLogger(config.stats_logger, config.run_dir, ft_spec, total_steps=total_steps,
                         exp_config=config)  # fmt: skip
    for global_step in range(total_steps):
        with stats_tracker.record_timing("rollout"):
            batch, rows = rollouts.next_batch(global_step)
        stats = {"rollout/episodes_recorded": recorder.write(global_step, batch, rows)}
        stats.update(stats_tracker.export())
        stats.update(rollouts.stats())
        logger.commit(*divmod(global_step, ft_spec.steps_per_epoch), global_step, stats)
    logger.close()
    recorder.close()
    rollouts.destroy()


def batch_sources(config, world, rank, tokenizer, workflow_cls, processor, loader, actor):
    """(rollouts, weights, evaluation): the servers, their weight sync and the held-out
    evaluation (mode train), or the recording alone (train_only: no server)."""
    if config.mode == "train_only":
        return RecordedRollouts(config.rollout.record, world, rank), None, None
    rollouts = ServerRollouts(config, world, rank, tokenizer, workflow_cls, processor, loader)
    weights = WeightSync(resolve_weight_update(config), actor, rollouts.executor,
                         os.path.join(config.run_dir, "weight_sync"))  # fmt: skip
    evaluation = make_evaluation(config, rank, world, tokenizer, workflow_cls, processor)
    return rollouts, weights, evaluation


def finish(saver, logger, trainers, total_steps, tokenizer, evaluation, rollouts, recorder):
    """Export the final policy, close the metrics (the summary and curves.png sit next to
    metrics.jsonl), stop the clients and engines."""
    saver.save(trainers.actor, 0, 0, total_steps, tokenizer=tokenizer, name="final", force=True)
    summary = logger.close()
    if summary and evaluation is not None:
        print(f"held-out accuracy: {summary['last'].get('eval/accuracy_before_training')} "
              f"before GRPO -> {summary['last'].get('eval/accuracy')} after", flush=True)  # fmt: skip
    for source in (rollouts, evaluation):
        if source is not None:
            source.destroy()
    if recorder is not None:
        recorder.close()
    trainers.destroy()


def make_recorder(config, rank, tokenizer) -> EpisodeRecorder | None:
    """Records the trained batches when rollout.record is set (train_only reads it instead)."""
    if not config.rollout.record or config.mode == "train_only":
        return None
    return EpisodeRecorder(config.rollout.record, rank, tokenizer.decode)


def main(argv: list[str], workflow_cls=None, load_processor=None) -> None:
    """`workflow_cls(reward_fn, gconfig, processor or tokenizer, ..., reward_pool=...)` makes the
    episodes (default: RLVRWorkflow, VisionRLVRWorkflow for rows with images);
    `load_processor(path)` loads the processor the datasets and workflows use."""
    config = load_expr_config(argv, GRPOConfig)
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    if config.mode == "train_only":  # a missing recording fails before any engine is built
        check_recording(config.rollout.record, world)
    claim_run_dir(config.run_dir, rank)  # one owner per run
    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer_path or config.actor.path)
    workflow_cls, processor = resolve_workflow(config, tokenizer, workflow_cls, load_processor)
    torch.manual_seed(config.seed)

    # Data: each trainer rank rolls out and trains on its own shard.
    train_loader = dataloader(config.train_dataset, rank, world, tokenizer, seed=config.seed,
                              processor=processor)  # fmt: skip
    ft_spec = FinetuneSpec(config.total_train_epochs, len(train_loader.dataset) * world,
                           config.train_dataset.batch_size, config.total_train_steps)  # fmt: skip
    total_steps = ft_spec.total_train_steps
    recorder = make_recorder(config, rank, tokenizer)
    if config.mode == "rollout_only":
        rollouts = ServerRollouts(config, world, rank, tokenizer, workflow_cls, processor,
                                  train_loader)  # fmt: skip
        return record_rollouts(config, rollouts, recorder, ft_spec, total_steps)

    # Engines, the batches' source (servers, or a recording), weight sync, evaluation.
    trainers = Trainers.build(config, ft_spec)
    actor = trainers.actor
    rollouts, weights, evaluation = batch_sources(config, world, rank, tokenizer, workflow_cls,
                                                  processor, train_loader, actor)  # fmt: skip
    total_steps = min(total_steps, rollouts.n_steps)
    evaluators = [evaluation.executor.engine] if evaluation is not None else []
    trained_log = os.path.join(config.run_dir, "rollouts", f"trained_rank{rank}.jsonl")

    # Services: checkpoints, evaluation, crash recovery, metrics (TensorBoard + JSONL + PNG).
    saver = Saver(config.saver, ft_spec, config.run_dir)
    evaluator = Evaluator(config.evaluator, ft_spec)
    states = {"model": actor, "dataloader": train_loader, "saver": saver,
              "evaluator": evaluator, **rollouts.states()}  # fmt: skip
    if trainers.critic is not None:
        states["critic"] = trainers.critic
    recover = RecoverHandler(config.recover, ft_spec, config.run_dir, states)
    start = recover.load()
    if start > 0:  # resumed: servers must serve the restored weights, tagged with their version
        publish_weights(weights, actor, start, evaluators)
    logger = StatsLogger(config.stats_logger, config.run_dir, ft_spec, start_step=start,
                         total_steps=total_steps, exp_config=config)  # fmt: skip
    accuracy_before = evaluation.accuracy() if evaluation is not None and start == 0 else None

    no_signal = NoLearningSignal(config.rollout.no_signal_steps, config.actor.group_size)
    for global_step in range(start, total_steps):
        # 1. Rollout: async (staleness-bounded, overlaps training), sync (eta = 0) or recorded.
        with stats_tracker.record_timing("rollout"):
            batch, rows = rollouts.next_batch(global_step)
        log_trained_items(trained_log, global_step, rows)
        if recorder is not None:
            recorder.write(global_step, batch, rows)
        no_signal.observe(global_step, batch["rewards"])  # warns once: equal rewards in every group
        # 2. Reference logprobs, values, advantages, the PPO update.
        stats = trainers.train(batch, global_step)
        # 3. Weight sync: the servers load the new weights (written once: publish_weights).
        with stats_tracker.record_timing("update_weights"):
            publish_weights(weights, actor, global_step + 1, evaluators)
        # 4. Services.
        epoch, step = divmod(global_step, ft_spec.steps_per_epoch)
        saver.save(actor, epoch, step, global_step, tokenizer=tokenizer)
        stats.update(evaluation_stats(evaluation, evaluator, global_step, total_steps,
                                      accuracy_before))  # fmt: skip
        stats.update(stats_tracker.export())
        stats.update(rollouts.stats())
        logger.commit(epoch, step, global_step, stats)
        # Last: a checkpoint for step s+1 implies step s is logged (resuming never leaves a gap).
        recover.dump(global_step + 1)

    finish(saver, logger, trainers, total_steps, tokenizer, evaluation, rollouts, recorder)


if __name__ == "__main__":
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    main(sys.argv[1:])
