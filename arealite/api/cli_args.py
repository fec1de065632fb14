"""Experiment configuration: dataclasses are the single source of truth.

Every field has a default and a help text (`field(metadata={"help": ...})`); validation lives in
`__post_init__`, so an impossible config fails when it is loaded, before any process starts.
`load_expr_config(argv, GRPOConfig)` reads `--config x.yaml` and then dotted `key=value`
overrides, and names the key (and the closest valid one) when something is wrong. Choices are
`Literal[...]` types. The launch-side configs (servers, cluster, launchers) live in
`launch_config.py`, the training side (engines, actor, critic) in `train_config.py`, the data
and service configs (datasets, saver, evaluator, recover, stats logger) in `data_config.py`, the
algorithm presets in `presets.py`; all are re-exported here.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from omegaconf import MISSING

from arealite.api.agent_config import AgentConfig
from arealite.api.config_loader import (
    ConfigBase,
    ConfigError,
    derived_from,
    load_expr_config,
    require,
    to_yaml,
)
from arealite.api.config_loader import help_text as _help
from arealite.api.data_config import (
    DatasetConfig,
    EvaluatorConfig,
    RecoverConfig,
    SaverConfig,
    StatsLoggerConfig,
)
from arealite.api.io_struct import AllocationMode, GenerationHyperparameters
from arealite.api.launch_config import (
    ClusterConfig,
    LauncherConfig,
    NameResolveConfig,
    ServerConfig,
    SlurmConfig,
)
from arealite.api.presets import ACTOR_PRESETS
from arealite.api.reward_api import FailFast, reward_specs
from arealite.api.train_config import (
    FSDPConfig,
    MicroBatchSpec,
    OptimizerConfig,
    PPOActorConfig,
    PPOCriticConfig,
    TrainEngineConfig,
)

__all__ = [
    "MISSING",
    "AgentConfig",
    "ACTOR_PRESETS",
    "GenerationHyperparameters",
    "MicroBatchSpec",
    "OptimizerConfig",
    "FSDPConfig",
    "TrainEngineConfig",
    "PPOActorConfig",
    "PPOCriticConfig",
    "RolloutConfig",
    "ServerConfig",
    "DatasetConfig",
    "SaverConfig",
    "EvaluatorConfig",
    "RecoverConfig",
    "StatsLoggerConfig",
    "NameResolveConfig",
    "ClusterConfig",
    "LauncherConfig",
    "SlurmConfig",
    "BaseExperimentConfig",
    "SFTConfig",
    "GRPOConfig",
    "ConfigError",
    "load_expr_config",
    "to_yaml",
]


# ----------------------------------------------------------------------------- rollout side


@dataclass
class RolloutConfig(ConfigBase):
    """The rollout client and its staleness control."""

    server_addrs: list[str] = field(
        default_factory=list,
        metadata=_help("host:port of each server; empty = from AREAL_LLM_SERVER_ADDRS (launcher)."),
    )
    max_concurrent_rollouts: Optional[int] = field(
        default=None, metadata=_help("Max episodes in flight; null = consumer_batch_size.")
    )
    queue_size: Optional[int] = field(
        default=None, metadata=_help("Bound of the result queue; null = 4 x max concurrency.")
    )
    consumer_batch_size: Optional[int] = field(
        default=None,
        metadata=derived_from(
            "train_dataset.batch_size",
            "Prompts (groups of gconfig.n_samples episodes) per training batch.",
        ),
    )
    max_head_offpolicyness: int = field(
        default=0, metadata=_help("Staleness bound eta; 0 = synchronous RL.")
    )
    request_timeout: float = field(default=3600.0, metadata=_help("Seconds per HTTP request."))
    request_retries: int = field(default=3, metadata=_help("Retries of a failed request."))
    setup_timeout: float = field(default=120.0, metadata=_help("Seconds to wait for servers."))
    api_key: Optional[str] = field(default=None, metadata=_help("Bearer token for the servers."))
    pause_grace_period: float = 0.0
    pause_mode: Literal["abort", "in_place"] = field(
        default="abort",
        metadata=_help(
            "What a weight update does to in-flight generation: abort (resumed as prompt + "
            "tokens so far, a prefill each) or in_place (kept with their KV caches; the next "
            "tokens come from the new weights). docs/design.md, Weight updates."
        ),
    )
    reward_timeout: float = field(default=15.0, metadata=_help("Seconds per reward call."))
    record: Optional[str] = field(
        default=None,
        metadata=_help(
            "A directory: every trained batch's episodes are appended there (one "
            "JSONL a rank; mode=train_only reads it back). docs/guide.md, Record, "
            "replay, train-only."
        ),
    )
    reward_workers: int = field(default=2, metadata=_help("Reward process-pool size."))
    reward_fail_fast_steps: int = field(
        default=1,
        metadata=_help(
            "Stop the run at the end of the first step (of N in a row) in which "
            "every reward call failed (raised or timed out), before training on it: "
            "the reward is broken, not unlucky; 0 = never."
        ),
    )
    max_reward_error_rate: float = field(
        default=0.5,
        metadata=_help(
            "Stop the run when more than this fraction of the last "
            "reward_error_window reward calls failed; 1.0 = never."
        ),
    )
    reward_error_window: int = field(
        default=256, metadata=_help("Reward calls max_reward_error_rate is measured over.")
    )
    no_signal_steps: int = field(
        default=5,
        metadata=_help(
            "Warn once when this many consecutive steps have equal rewards in every "
            "group (zero advantages: nothing to learn); 0 = never."
        ),
    )
    dynamic_sampling: bool = field(
        default=False,
        metadata=_help(
            "DAPO's dynamic sampling: the executor drops groups whose rewards are all equal and "
            "generates others in their place (arealite/rollout/group_filter.py)."
        ),
    )
    dynamic_sampling_max_oversample: float = field(
        default=3.0,
        metadata=_help(
            "Cap: at most (this - 1) x batch groups dropped per step; past it equal-reward "
            "groups are accepted, counted, and left out of the update (loss mask zeroed)."
        ),
    )
    dynamic_sampling_skip_max_prob: float = field(
        default=0.0,
        metadata=_help(
            "Skip a prompt before generating it with probability min(this, 1 - 2^-k), k = its "
            "latest groups in a row solved (all samples at the best reward; GRESO's pre-rollout "
            "filter, all-wrong prompts kept); 0 = off. Only with dynamic_sampling, whose "
            "verdicts it learns from."
        ),
    )

    def __post_init__(self):
        super().__post_init__()
        if self.consumer_batch_size is not None and self.consumer_batch_size < 1:
            raise ConfigError(
                f"rollout.consumer_batch_size must be >= 1, got {self.consumer_batch_size}"
            )
        if self.max_head_offpolicyness < 0:
            raise ConfigError(
                f"rollout.max_head_offpolicyness must be >= 0, got {self.max_head_offpolicyness}"
            )
        if self.max_concurrent_rollouts is not None and self.max_concurrent_rollouts < 1:
            raise ConfigError(
                f"rollout.max_concurrent_rollouts must be >= 1, got {self.max_concurrent_rollouts}"
            )
        self._check_reward_knobs()
        over = self.dynamic_sampling_max_oversample
        require(over >= 1, "rollout.dynamic_sampling_max_oversample", over, ">= 1 (1 = never drop)")
        skip = self.dynamic_sampling_skip_max_prob
        require(0 <= skip < 1, "rollout.dynamic_sampling_skip_max_prob", skip, "in [0, 1)")

    def _check_reward_knobs(self) -> None:
        if self.reward_fail_fast_steps < 0 or self.no_signal_steps < 0:
            raise ConfigError(
                "rollout.reward_fail_fast_steps and rollout.no_signal_steps must be >= 0 (0 = "
                f"off), got {self.reward_fail_fast_steps} and {self.no_signal_steps}"
            )
        if not 0.0 <= self.max_reward_error_rate <= 1.0:
            raise ConfigError(
                f"rollout.max_reward_error_rate must be in [0, 1], got {self.max_reward_error_rate}"
            )
        if self.reward_error_window < 1:
            raise ConfigError(
                f"rollout.reward_error_window must be >= 1, got {self.reward_error_window}"
            )

    def reward_fail_fast(self) -> FailFast:
        """When the run's reward pools give up on a broken reward (arealite/reward/errors.py)."""
        return FailFast(
            self.reward_fail_fast_steps, self.max_reward_error_rate, self.reward_error_window
        )


# ----------------------------------------------------------------------------- experiments


@dataclass
class BaseExperimentConfig(ConfigBase):
    experiment_name: str = field(default=MISSING, metadata=_help("Experiment name (required)."))
    trial_name: str = field(default=MISSING, metadata=_help("Trial name (required)."))
    allocation_mode: str = field(default="d1p1t1", metadata=_help("See AllocationMode."))
    seed: int = 1
    total_train_epochs: int = 1
    total_train_steps: Optional[int] = field(
        default=None, metadata=_help("Stop after this many steps (null = all epochs).")
    )
    total_train_secs: Optional[float] = field(
        default=None,
        metadata=_help(
            "Also stop after the step during which this many seconds of training passed (wall "
            "clock from this launch's first step); that step evaluates, the final export follows "
            "(null = no limit). The LR schedule still spans the steps."
        ),
    )
    tokenizer_path: str = field(default="", metadata=_help("Defaults to the model path."))
    train_dataset: DatasetConfig = field(default_factory=DatasetConfig)
    valid_dataset: Optional[DatasetConfig] = None
    saver: SaverConfig = field(default_factory=SaverConfig)
    evaluator: EvaluatorConfig = field(default_factory=EvaluatorConfig)
    recover: RecoverConfig = field(default_factory=RecoverConfig)
    stats_logger: StatsLoggerConfig = field(default_factory=StatsLoggerConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)

    def __post_init__(self):
        super().__post_init__()
        try:
            self._allocation = AllocationMode.from_str(self.allocation_mode)
        except ValueError as e:
            raise ConfigError(f"allocation_mode: {e}") from None
        self._set_tensor_parallel()
        if self.total_train_epochs < 1:
            raise ConfigError(f"total_train_epochs must be >= 1, got {self.total_train_epochs}")
        if self.total_train_secs is not None and not self.total_train_secs > 0:
            raise ConfigError(
                f"total_train_secs must be > 0 (or null), got {self.total_train_secs}"
            )

    def _set_tensor_parallel(self) -> None:
        """Every trained model gets the trainer part's t; a tensor group (t consecutive
        ranks) must sit on one node, so a multi-node trainer needs t | n_gpus_per_node."""
        tp = self._allocation.train.tensor_parallel_size
        for f in dataclasses.fields(self):
            engine = getattr(self, f.name)
            if isinstance(engine, TrainEngineConfig):
                engine.tensor_parallel_size = tp
        gpn = self.cluster.n_gpus_per_node
        if tp > 1 and gpn and self._allocation.train_world_size > gpn and gpn % tp:
            raise ConfigError(
                f"allocation_mode={self.allocation_mode!r}: a tensor group of t{tp} must sit on "
                f"one node, but cluster.n_gpus_per_node={gpn} splits the trainer's ranks "
                "across nodes mid-group: choose a t that divides n_gpus_per_node"
            )

    @property
    def allocation(self) -> AllocationMode:
        return self._allocation

    @property
    def run_dir(self) -> str:
        """Where every file of this trial goes: logs, checkpoints, metrics."""
        return os.path.join(self.cluster.fileroot, self.experiment_name, self.trial_name)


@dataclass
class SFTConfig(BaseExperimentConfig):
    model: TrainEngineConfig = field(default_factory=TrainEngineConfig)

    def __post_init__(self):
        super().__post_init__()
        check_trainer_only(self, "SFT", "d2p1t1")


def check_trainer_only(config, what: str, example_mode: str) -> None:
    """A run of `config.model` with no inference servers (SFT, reward-model training): a
    train-only allocation and a model path."""
    if not config.allocation.train_only:
        raise ConfigError(
            f"allocation_mode={config.allocation_mode!r}: {what} runs no inference servers; "
            f"use a train-only mode such as {example_mode!r}"
        )
    sampling = config.evaluator
    if sampling.temperature != 0 or sampling.n_samples != 1:
        raise ConfigError(
            f"evaluator.temperature={sampling.temperature}, n_samples={sampling.n_samples}: "
            f"they sample held-out answers in RL; {what} evaluates its loss - remove them"
        )
    if not config.model.path:
        raise ConfigError("model.path is required (an HF model directory or hub id)")


GRPO_MODES = ("train", "rollout_only", "train_only")


@dataclass
class GRPOConfig(BaseExperimentConfig):
    allocation_mode: str = "local.d1p1t1+d1p1t1"
    gconfig: GenerationHyperparameters = field(default_factory=GenerationHyperparameters)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor: PPOActorConfig = field(default_factory=PPOActorConfig)
    ref: Optional[PPOActorConfig] = field(
        default=None, metadata=_help("Reference model for the KL term (needs actor.kl_ctl > 0).")
    )
    critic: Optional[PPOCriticConfig] = field(default=None, metadata=_help("Value model (PPO)."))
    server: ServerConfig = field(default_factory=ServerConfig)
    weight_update: Literal["auto", "disk", "distributed", "tensor"] = field(
        default="auto",
        metadata=_help(
            "How new weights reach the servers after each step: auto (tensor where the servers "
            "share the trainer's GPU, distributed where they are on other GPUs of the node, else "
            "disk; logged with the reason: arealite/api/weight_update.py) | disk (an HF "
            "checkpoint in <run_dir>/weight_sync that the servers reload; any backend, LoRA too) | "
            "distributed (trainer rank 0 broadcasts to every server rank: NCCL on GPU, gloo on "
            "CPU; SGLang or the embedded server, full weights only) | tensor (servers on the "
            "trainer's GPU, cluster.share_gpus, open CUDA IPC handles of its weights: no copy "
            "through disk; SGLang or the embedded server, TP 1, full weights only)."
        ),
    )
    reward: Any = field(
        default=None,
        metadata=_help(
            "Reward function(s): a built-in name (math_verify, arith, clevr_count), "
            "'my_pkg.rewards:score', 'path/to/file.py:score', or a list of them; null = the "
            "built-in task's own. Contract: arealite/api/reward_api.py."
        ),
    )
    reward_weights: Optional[list[float]] = field(
        default=None, metadata=_help("Weights of a list of rewards (weighted sum); null = all 1.")
    )
    agent: AgentConfig = field(
        default_factory=AgentConfig,
        metadata=_help("An agent program trained through the AgentProxy (docs/agents.md)."),
    )
    mode: str = field(
        default="train",
        metadata=_help(
            "train | rollout_only (generate, score and record to rollout.record; no trainer) | "
            "train_only (train on the recording in rollout.record; no inference server)."
        ),
    )
    eval_reward: Optional[str] = field(
        default=None,
        metadata=_help(
            "Reward of the held-out evaluation (eval/accuracy); null = the training reward. "
            "Name the exact verifier (e.g. arith) when training on a learned reward model, so "
            "eval/accuracy is the true accuracy, not the score being optimised."
        ),
    )

    def __post_init__(self):
        super().__post_init__()
        for reward, weights in ((self.reward, self.reward_weights), (self.eval_reward, None)):
            if reward is not None or weights is not None:
                try:
                    reward_specs(reward, weights)
                except ValueError as e:
                    raise ConfigError(str(e)) from None
        if self.allocation.train_only:
            raise ConfigError(
                f"allocation_mode={self.allocation_mode!r}: GRPO needs inference servers, e.g. "
                "'local.d1p1t1+d1p1t1' (embedded), 'sglang.d2p1t1+d2p1t1' or 'vllm.d1p1t1+d1p1t1', "
                "or generation in the trainer ranks: 'colocated+d1p1t1'"
            )
        if not self.actor.path:
            raise ConfigError("actor.path is required (an HF model directory or hub id)")
        if self.mode not in GRPO_MODES:
            raise ConfigError(f"mode={self.mode!r}: expected one of {', '.join(GRPO_MODES)}")
        if self.mode != "train" and not self.rollout.record:
            raise ConfigError(
                f"mode={self.mode} needs rollout.record=<dir> (the recording "
                f"it {'writes' if self.mode == 'rollout_only' else 'reads'})"
            )
        # One key per fact: the derived keys follow the user's (config_loader.derived_from).
        self.actor.group_size = self.gconfig.n_samples  # advantages: per group of samples
        # Groups dynamic sampling accepted past its cap: left out of the update.
        self.actor.dynamic_sampling = self.rollout.dynamic_sampling
        # Log-probabilities at the temperature the samples were drawn at, or every importance
        # ratio is off (greedy sampling: the model's own distribution).
        for policy in (self.actor, self.ref):
            if policy is not None:
                policy.temperature = self.gconfig.temperature or 1.0
        self.rollout.consumer_batch_size = self.train_dataset.batch_size  # prompts per step
        if self.actor.preset == "ppo" and self.critic is None:
            raise ConfigError("actor.preset=ppo needs a value model: set critic.path")
        if self.critic is not None and self.actor.group_reward_mean_level == "group":
            raise ConfigError(
                f"critic is set but actor.preset={self.actor.preset!r} uses a group-mean "
                "baseline, not values: drop critic or use preset ppo"
            )
        steps = self.total_train_steps
        if self.critic is not None and steps is not None and self.critic.warmup_steps >= steps:
            raise ConfigError(
                f"critic.warmup_steps={self.critic.warmup_steps} >= total_train_steps={steps}: "
                "the actor would never train"
            )
        if self.actor.kl_ctl > 0 and self.ref is None:
            raise ConfigError("actor.kl_ctl > 0 needs a reference model: set ref.path")
        if not self.server.model_path:
            self.server.model_path = self.actor.path
