"""What every GRPO mode needs before any engine is built, resolved once from the config.

`GRPORun.build` claims the run directory, loads the tokenizer (and processor), picks the episode
factory (RLVRWorkflow, VisionRLVRWorkflow for rows with images, an agent's route for
`agent.command`), and builds this rank's train loader. `mode` is read here: `train_only` opens
the recording (a missing one fails before any engine), `rollout.record` opens the recorder.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import torch
from torchdata.stateful_dataloader import StatefulDataLoader
from transformers import AutoTokenizer

from arealite.agent.route import AgentRoute
from arealite.api.cli_args import GRPOConfig
from arealite.api.io_struct import FinetuneSpec
from arealite.inference import make_remote_engine
from arealite.lifecycle.run_lock import claim_run_dir
from arealite.reward import make_reward_pool
from arealite.rollout.record import EpisodeRecorder, RecordedBatches
from arealite.server.colocated import ColocatedEngine, ColocatedGenerator
from arealite.tasks import default_reward, is_vision_dataset, load_rows
from arealite.trainer.supervised import rank_loader
from arealite.utils import distributed as du
from arealite.utils.vision import load_vlm_processor
from arealite.workflow.rlvr import RLVRWorkflow
from arealite.workflow.vision_rlvr import VisionRLVRWorkflow


@dataclasses.dataclass
class GRPORun:
    """This rank's run: its data, tokenizer and episode factory, and where batches are recorded
    or replayed from. `workflow_cls(reward_fn, gconfig, processor or tokenizer, ...,
    reward_pool=...)` makes the episodes."""

    config: GRPOConfig
    world: int
    rank: int
    tokenizer: Any
    processor: Any
    workflow_cls: Callable
    train_loader: StatefulDataLoader
    ft_spec: FinetuneSpec
    recording: RecordedBatches | None  # mode train_only: the batches to train on
    recorder: EpisodeRecorder | None  # rollout.record (modes train, rollout_only)

    @classmethod
    def build(cls, config: GRPOConfig, workflow_cls=None, load_processor=None) -> GRPORun:
        """`load_processor(path)` loads the processor the datasets and workflows use."""
        world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
        recording = None
        if config.mode == "train_only":  # a missing recording fails before any engine is built
            recording = RecordedBatches(config.rollout.record, rank, world)
        claim_run_dir(config.run_dir, rank)  # one owner per run
        tokenizer = AutoTokenizer.from_pretrained(config.tokenizer_path or config.actor.path)
        workflow_cls, processor = resolve_workflow(config, tokenizer, workflow_cls, load_processor)
        torch.manual_seed(config.seed)
        # Each trainer rank rolls out and trains on its own shard.
        loader = dataloader(
            config.train_dataset, rank, world, tokenizer, seed=config.seed, processor=processor
        )
        n_rows, batch_size = len(loader.dataset) * world, config.train_dataset.batch_size
        ft_spec = FinetuneSpec(
            config.total_train_epochs, n_rows, batch_size, config.total_train_steps
        )
        recorder = None
        if config.rollout.record and recording is None:
            recorder = EpisodeRecorder(config.rollout.record, rank, tokenizer.decode)
        return cls(
            config,
            world,
            rank,
            tokenizer,
            processor,
            workflow_cls,
            loader,
            ft_spec,
            recording,
            recorder,
        )

    def rollout_engine(self, rollout_cfg):
        """The rollout client, initialized: HTTP to the inference servers, or (allocation_mode
        colocated+...) this rank's in-process generator, which training and evaluation share."""
        config = self.config
        if not config.allocation.colocated:
            engine = make_remote_engine(config.allocation.gen_backend, rollout_cfg)
        else:
            server = config.server
            generator = ColocatedGenerator.shared(
                server.model_path or config.actor.path,
                server.dtype,
                du.current_device(),
                config.seed + self.rank,
                server.max_batch_size,
            )
            engine = ColocatedEngine(rollout_cfg, generator)
        engine.initialize()
        return engine


def dataloader(cfg, rank, world, tokenizer, split=None, shuffle=None, seed=0, processor=None):
    """This rank's share of a dataset, in rows (the workflow tokenizes)."""
    cfg = cfg if split is None else dataclasses.replace(cfg, split=split)
    ds = load_rows(cfg, rank, world, "rl", tokenizer, processor)
    return rank_loader(cfg, ds, world, seed, collate=lambda rows: rows, shuffle=shuffle)


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
