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

import torch
import torch.distributed as dist
from torchdata.stateful_dataloader import StatefulDataLoader
from transformers import AutoTokenizer

from arealite.agent.route import AgentRoute
from arealite.api.cli_args import GRPOConfig, load_expr_config
from arealite.api.io_struct import FinetuneSpec
from arealite.dataset import default_reward, is_vision_dataset, load_rows
from arealite.engine.lora import count_parameters, optimizer_state_bytes
from arealite.engine.ppo.actor import FSDPPPOActor
from arealite.engine.ppo.critic import FSDPPPOCritic
from arealite.inference import make_remote_engine
from arealite.reward import make_reward_pool
from arealite.rollout import WorkflowExecutor
from arealite.rollout.group_filter import InformativeGroupFilter
from arealite.trainer.evaluator import Evaluator
from arealite.trainer.learning_signal import NoLearningSignal
from arealite.trainer.recover import RecoverHandler, ResumableSampler
from arealite.trainer.saver import Saver
from arealite.trainer.stats_logger import StatsLogger
from arealite.trainer.weight_sync import WeightSync
from arealite.utils import stats_tracker
from arealite.utils.run_lock import claim_run_dir
from arealite.utils.vision import load_vlm_processor
from arealite.workflow.rlvr import RLVRWorkflow
from arealite.workflow.vision_rlvr import VisionRLVRWorkflow


def dataloader(cfg, rank, world, tokenizer, split=None, shuffle=None, seed=0, processor=None):
    """This rank's share of a dataset, in rows (the workflow tokenizes)."""
    ds = load_rows(cfg if split is None else dataclasses.replace(cfg, split=split), rank, world,
                   "rl", tokenizer, processor)  # fmt: skip
    order = ResumableSampler(len(ds), cfg.shuffle if shuffle is None else shuffle, seed)
    return StatefulDataLoader(
        ds, batch_size=max(1, cfg.batch_size // world), collate_fn=lambda rows: rows,
        sampler=order, drop_last=cfg.drop_last,
    )  # fmt: skip


def make_accuracy_fn(config, rank, world, tokenizer, workflow_cls, processor=None):
    """Greedy held-out accuracy (mean reward) on a separate client, so evaluation never counts
    against the training rollouts' staleness budget."""
    if config.valid_dataset is None:
        return None
    valid = dataloader(config.valid_dataset, rank, world, tokenizer, shuffle=False,
                       processor=processor)  # fmt: skip
    rows = [row for batch in valid for row in batch]
    eval_cfg = dataclasses.replace(
        config.rollout, consumer_batch_size=max(1, len(rows)), max_head_offpolicyness=10**6,
        max_concurrent_rollouts=max(1, len(rows)), queue_size=None,
    )  # fmt: skip
    engine = make_remote_engine(config.allocation.gen_backend, eval_cfg)
    engine.initialize()
    executor = WorkflowExecutor(eval_cfg, engine)
    executor.initialize(train_data_parallel_size=world)
    gconfig = config.gconfig.new(n_samples=1, greedy=True, temperature=0.0)
    reward = (config.eval_reward, None) if config.eval_reward else reward_of(config)
    pool = reward_pool_of(*reward, workers=1, timeout=config.rollout.reward_timeout,
                          fail_fast=config.rollout.reward_fail_fast())  # fmt: skip
    workflow = workflow_cls(None, gconfig, processor or tokenizer, reward_pool=pool)

    def accuracy() -> float:
        batch = executor.rollout_batch(rows, workflow)
        correct = torch.tensor([float(batch["rewards"].sum()), float(len(rows))])
        if world > 1:
            dist.all_reduce(correct)
        return (correct[0] / correct[1].clamp(min=1)).item()

    return accuracy, executor


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


def main(argv: list[str], workflow_cls=None, load_processor=None, **_old_kwargs) -> None:
    """`workflow_cls(reward_fn, gconfig, processor or tokenizer, ..., reward_pool=...)` makes the
    episodes (default: RLVRWorkflow, VisionRLVRWorkflow for rows with images);
    `load_processor(path)` loads the processor the datasets and workflows use."""
    config = load_expr_config(argv, GRPOConfig)
    claim_run_dir(config.run_dir, int(os.environ.get("RANK", 0)))  # one owner per run
    actor = FSDPPPOActor(config.actor, max_response_len=config.gconfig.max_new_tokens)
    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer_path or config.actor.path)
    processor_path = config.tokenizer_path or config.actor.path
    if workflow_cls is None and is_vision_dataset(config.train_dataset.path, processor_path):
        workflow_cls, load_processor = VisionRLVRWorkflow, load_processor or load_vlm_processor
    workflow_cls = workflow_cls or RLVRWorkflow
    if config.agent.command:  # agent.command: an AgentProxy + the agent's processes serve episodes
        workflow_cls = AgentRoute(config.agent, tokenizer)
    processor = load_processor(processor_path) if load_processor else None
    torch.manual_seed(config.seed)

    # Data: each trainer rank rolls out and trains on its own shard.
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    train_loader = dataloader(config.train_dataset, rank, world, tokenizer, seed=config.seed,
                              processor=processor)  # fmt: skip
    ft_spec = FinetuneSpec(config.total_train_epochs, len(train_loader.dataset) * world,
                           config.train_dataset.batch_size)  # fmt: skip
    total_steps = min(ft_spec.total_train_steps, config.total_train_steps or 10**12)

    # Engines: the policy (FSDP2), an optional frozen reference, the rollout client.
    actor.initialize(None, ft_spec)
    ref = None
    if config.ref is not None:
        ref = FSDPPPOActor(dataclasses.replace(config.ref, optimizer=None))
        ref.initialize(None, ft_spec)
    critic = None  # PPO's value model: trained here, never sent to the servers
    if config.critic is not None:
        critic = FSDPPPOCritic(config.critic)
        critic.initialize(None, ft_spec)
    rollout = make_remote_engine(config.allocation.gen_backend, config.rollout)
    rollout.initialize()
    executor = WorkflowExecutor(config.rollout, rollout)  # episodes in the background
    executor.initialize(train_data_parallel_size=world)
    reward_pool = reward_pool_of(*reward_of(config), workers=config.rollout.reward_workers,
                                 timeout=config.rollout.reward_timeout,
                                 fail_fast=config.rollout.reward_fail_fast())  # fmt: skip
    workflow = workflow_cls(
        None, config.gconfig, processor or tokenizer, reward_pool=reward_pool,
        dump_dir=os.path.join(config.run_dir, "rollouts") if rank == 0 else None,
    )  # fmt: skip
    group_filter = None  # DAPO's dynamic sampling: equal-reward groups replaced, not trained
    if config.actor.dynamic_sampling:
        group_filter = InformativeGroupFilter(config.train_dataset.batch_size // world,
                                              config.actor.dynamic_sampling_max_oversample)  # fmt: skip
    evaluation = make_accuracy_fn(config, rank, world, tokenizer, workflow_cls, processor)
    # Weight sync (config.weight_update: disk | distributed), both sides in the right order.
    weights = WeightSync(config.weight_update, actor, executor,
                         os.path.join(config.run_dir, "weight_sync"))  # fmt: skip
    evaluators = [evaluation[1].engine] if evaluation is not None else []
    trained_log = os.path.join(config.run_dir, "rollouts", f"trained_rank{rank}.jsonl")

    # Services: checkpoints, evaluation, crash recovery, metrics (TensorBoard + JSONL + PNG).
    saver = Saver(config.saver, ft_spec, config.run_dir)
    evaluator = Evaluator(config.evaluator, ft_spec)
    states = {
        "model": actor, "dataloader": train_loader, "rollout": executor, "saver": saver,
        "evaluator": evaluator, "workflow": workflow,  # its reward counters continue
    }  # fmt: skip
    if critic is not None:
        states["critic"] = critic
    recover = RecoverHandler(config.recover, ft_spec, config.run_dir, states)
    start = recover.load()
    if start > 0:  # resumed: servers must serve the restored weights, tagged with their version
        weights.push(start, evaluators)
    logger = StatsLogger(config.stats_logger, config.run_dir, ft_spec, start_step=start,
                         total_steps=total_steps, exp_config=config)  # fmt: skip
    accuracy_before = evaluation[0]() if evaluation is not None and start == 0 else None

    data_iter = iter(train_loader)
    first_actor_step = config.critic.warmup_steps if critic is not None else 0
    no_signal = NoLearningSignal(config.rollout.no_signal_steps, config.actor.group_size)
    for global_step in range(start, total_steps):
        epoch, step = divmod(global_step, ft_spec.steps_per_epoch)
        # 1. Rollout: async (staleness-bounded, overlaps training) or sync (eta = 0).
        with stats_tracker.record_timing("rollout"):
            if config.rollout.max_head_offpolicyness > 0 or group_filter is not None:
                batch = executor.prepare_batch(train_loader, workflow, group_filter)
            else:
                try:
                    rows = next(data_iter)
                except StopIteration:
                    data_iter = iter(train_loader)
                    rows = next(data_iter)
                batch = executor.rollout_batch(rows, workflow)
        log_trained_items(trained_log, global_step, executor.last_batch_data)
        no_signal.observe(global_step, batch["rewards"])  # warns once: equal rewards in every group

        # 2. Reference logprobs for the KL term. The proximal policy of the decoupled loss
        #    needs no call: ppo_update takes it from its own forward (or recomputes it).
        if ref is not None:
            with stats_tracker.record_timing("compute_logp"):
                batch["ref_logp"] = ref.compute_logp(batch)

        # 3. Advantages and the PPO update.
        with stats_tracker.record_timing("train_step"):
            if critic is not None:  # values before the update feed GAE and anchor the clip
                batch["values"] = critic.compute_values(batch)
            adv_stats = actor.compute_advantages(batch)
            stats = {}
            if global_step >= first_actor_step:  # else the critic's warm-up: critic only
                stats = actor.ppo_update(batch)
                actor.step_lr_scheduler()
            if critic is not None:
                stats.update({f"ppo_critic/{k}": v for k, v in critic.ppo_update(batch).items()})
                critic.step_lr_scheduler()

        # 4. Weight sync: new episodes wait, the servers load the new weights; evaluation
        #    clients then refuse a server with older ones.
        with stats_tracker.record_timing("update_weights"):
            weights.push(global_step + 1, evaluators)

        # 5. Services.
        saver.save(actor, epoch, step, global_step, tokenizer=tokenizer)
        if evaluation is not None:
            last = global_step == total_steps - 1
            acc = evaluator.evaluate(evaluation[0], epoch, step, global_step, force=last)
            if acc is not None:
                stats["eval/accuracy"] = acc
            if accuracy_before is not None and global_step == 0:
                stats["eval/accuracy_before_training"] = accuracy_before
        stats.update({f"ppo_actor/{k}": v for k, v in adv_stats.items()})
        if global_step == first_actor_step:  # what the optimizer holds: weights or adapters
            trainable, total = count_parameters(actor.model)
            stats.update({"actor/trainable_params": trainable, "actor/total_params": total,
                          "actor/optimizer_state_bytes": optimizer_state_bytes(actor.optimizer)})  # fmt: skip
        stats.update(stats_tracker.export())
        if group_filter is not None:
            stats.update(group_filter.take_stats())
        stats.update({f"rollout/{k}": v for k, v in workflow.reward_stats.items()})
        if hasattr(reward_pool, "component_stats"):  # a weighted sum: each reward's mean
            stats.update(reward_pool.component_stats())
        logger.commit(epoch, step, global_step, stats)
        # Last: a checkpoint for step s+1 implies step s is logged (resuming never leaves a gap).
        recover.dump(global_step + 1)

    # Export the final policy; the summary (and curves.png) sit next to metrics.jsonl.
    saver.save(actor, 0, 0, total_steps, tokenizer=tokenizer, name="final", force=True)
    summary = logger.close()
    if summary and evaluation is not None:
        accuracy_before = summary["last"].get("eval/accuracy_before_training")
        print(f"held-out accuracy: {accuracy_before} before GRPO -> "
              f"{summary['last'].get('eval/accuracy')} after", flush=True)  # fmt: skip
    for ex in [executor] + ([evaluation[1]] if evaluation is not None else []):
        ex.destroy()
        ex.engine.destroy()
    actor.destroy()
    for engine in (ref, critic):
        if engine is not None:
            engine.destroy()


if __name__ == "__main__":
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    main(sys.argv[1:])
