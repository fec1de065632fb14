"""Experiment configuration: dataclasses are the single source of truth.

Every field has a default and a help text (`field(metadata={"help": ...})`); validation lives in
`__post_init__`, so an impossible config fails when it is loaded, before any process starts.
`load_expr_config(argv, GRPOConfig)` reads `--config x.yaml` and then dotted `key=value`
overrides, and names the key (and the closest valid one) when something is wrong. Choices are
`Literal[...]` types. The launch-side configs (servers, cluster, launchers) live in
`launch_config.py`, the data and service configs (datasets, saver, evaluator, recover, stats
logger) in `data_config.py`, the algorithm presets in `presets.py`; all are re-exported here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from omegaconf import MISSING

from arealite.api.config_loader import ConfigBase, ConfigError, load_expr_config, to_yaml
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
from arealite.api.lora_config import LoRAConfig
from arealite.api.presets import ACTOR_PRESETS, PresetName
from arealite.api.reward_api import reward_specs

__all__ = [
    "MISSING",
    "ACTOR_PRESETS",
    "GenerationHyperparameters",
    "MicroBatchSpec",
    "OptimizerConfig",
    "FSDPConfig",
    "TrainEngineConfig",
    "PPOActorConfig",
    "PPOCriticConfig",
    "InferenceEngineConfig",
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


Dtype = Literal["float32", "bfloat16", "float16"]
# `auto`: bf16 where the device multiplies it natively, else fp32 (arealite/utils/hardware.py).
ComputeDtype = Literal["auto", "float32", "bfloat16", "float16"]


# ----------------------------------------------------------------------------- training side


@dataclass
class MicroBatchSpec(ConfigBase):
    """How a batch is split into micro-batches (packed, padding-free)."""

    n_mbs: int = field(default=1, metadata=_help("Minimum number of micro-batches."))
    max_tokens_per_mb: Optional[int] = field(
        default=None,
        metadata=_help("Token budget of one packed micro-batch; None = no budget (n_mbs only)."),
    )

    def __post_init__(self):
        super().__post_init__()
        if self.n_mbs < 1:
            raise ConfigError(f"mb_spec.n_mbs must be >= 1, got {self.n_mbs}")
        if self.max_tokens_per_mb is not None and self.max_tokens_per_mb < 1:
            raise ConfigError(
                f"mb_spec.max_tokens_per_mb must be >= 1 or null, got {self.max_tokens_per_mb}"
            )


@dataclass
class OptimizerConfig(ConfigBase):
    """AdamW with warmup and a constant / linear / cosine schedule."""

    lr: float = field(default=1e-5, metadata=_help("Peak learning rate."))
    weight_decay: float = field(default=0.01, metadata=_help("AdamW weight decay."))
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    min_lr_ratio: float = field(
        default=0.0, metadata=_help("Final LR as a fraction of peak (linear / cosine).")
    )
    lr_scheduler_type: Literal["constant", "linear", "cosine"] = field(
        default="constant", metadata=_help("LR schedule after warmup.")
    )
    warmup_steps_proportion: float = field(
        default=0.0, metadata=_help("Fraction of total steps spent in linear warmup.")
    )
    gradient_clipping: float = field(
        default=1.0, metadata=_help("Max global grad norm; <= 0 disables clipping.")
    )

    def __post_init__(self):
        super().__post_init__()
        if self.lr < 0:
            raise ConfigError(f"optimizer.lr must be >= 0, got {self.lr}")
        if not 0 <= self.warmup_steps_proportion <= 1:
            raise ConfigError(
                f"optimizer.warmup_steps_proportion must be in [0, 1], got {self.warmup_steps_proportion}"
            )
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"optimizer.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")


@dataclass
class FSDPConfig(ConfigBase):
    """FSDP2 knobs."""

    param_dtype: ComputeDtype = field(
        default="auto",
        metadata=_help(
            "Compute dtype: auto = bf16 where native (CUDA >= 8.0, AVX512-BF16/AMX CPU), else fp32."
        ),
    )
    reduce_dtype: Dtype = field(default="float32", metadata=_help("Gradient reduction dtype."))
    offload_params: bool = field(default=False, metadata=_help("CPU-offload parameters (GPU)."))
    reshard_after_forward: bool = True


@dataclass
class TrainEngineConfig(ConfigBase):
    """A model trained by an FSDP2 engine."""

    path: str = field(default="", metadata=_help("HF model directory or hub id."))
    init_from_scratch: bool = field(
        default=False, metadata=_help("Random init from the config at `path` (no weights).")
    )
    attn_impl: Literal["sdpa_varlen", "sdpa", "eager", "flash_attention_2"] = field(
        default="sdpa_varlen",
        metadata=_help(
            "Attention for packed micro-batches: sdpa_varlen (exact, per-sequence sdpa, any "
            "device) | flash_attention_2 (GPU) | sdpa / eager (dense block-diagonal mask)."
        ),
    )
    dtype: Dtype = field(default="float32", metadata=_help("Master weight dtype."))
    gradient_checkpointing: bool = False
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    mb_spec: MicroBatchSpec = field(default_factory=MicroBatchSpec)
    optimizer: Optional[OptimizerConfig] = field(
        default_factory=OptimizerConfig, metadata=_help("null for forward-only (reference) models.")
    )
    is_critic: bool = field(default=False, metadata=_help("Add a scalar value head."))
    lora: Optional[LoRAConfig] = field(default=None, metadata=_help("Train LoRA adapters only."))
    weight_update_bucket_mb: int = field(
        default=256, metadata=_help("Bucket size for gathering / broadcasting weights.")
    )


@dataclass
class PPOActorConfig(TrainEngineConfig):
    """The policy: PPO / GRPO and their variants (see `preset`)."""

    preset: Optional[PresetName] = field(
        default=None,
        metadata=_help(
            "Apply a named algorithm's defaults (arealite/api/presets.py) before validation. "
            "Explicit fields in the YAML still win."
        ),
    )
    group_size: int = field(default=1, metadata=_help("Samples per prompt (GRPO group)."))
    ppo_n_minibatches: int = field(default=1, metadata=_help("Optimizer steps per batch."))
    temperature: float = field(default=1.0, metadata=_help("Sampling temperature (logprobs)."))
    eps_clip: float = field(default=0.2, metadata=_help("PPO clip epsilon (lower)."))
    eps_clip_higher: Optional[float] = field(
        default=None, metadata=_help("DAPO clip-higher upper epsilon; null = eps_clip.")
    )
    c_clip: Optional[float] = field(
        default=None, metadata=_help("Dual-clip constant (> 1) for negative advantages.")
    )
    importance_sampling_level: Literal["token", "sequence"] = field(
        default="token", metadata=_help("token (PPO) or sequence (GSPO).")
    )
    # Reward shaping.
    reward_scaling: float = 1.0
    reward_bias: float = 0.0
    reward_clip: float = 20.0
    overlong_reward_penalty: bool = False
    overlong_tokens: Optional[int] = None
    overlong_penalty_factor: Optional[float] = None
    mask_no_eos_with_zero: bool = field(
        default=False, metadata=_help("Zero the reward of truncated (no EOS) answers.")
    )
    # Advantage estimation.
    discount: float = 1.0
    gae_lambda: float = 1.0
    group_reward_mean_level: Literal["batch", "group", "none"] = field(
        default="group", metadata=_help("Reward baseline.")
    )
    group_reward_std_level: Literal["batch", "group", "none"] = field(
        default="group", metadata=_help("Reward std normaliser.")
    )
    leave_one_out: bool = field(default=False, metadata=_help("RLOO baseline within a group."))
    adv_norm_mean_level: Literal["batch", "none"] = field(
        default="none", metadata=_help("Token-level advantage mean norm.")
    )
    adv_norm_std_level: Literal["batch", "none"] = field(
        default="none", metadata=_help("Token-level advantage std norm.")
    )
    # KL to a reference model.
    kl_ctl: float = field(default=0.0, metadata=_help("KL penalty coefficient (needs ref)."))
    kl_estimator: Literal["k1", "k2", "k3"] = field(
        default="k1", metadata=_help("Schulman's KL estimators.")
    )
    # Off-policy correction.
    recompute_logprob: bool = field(
        default=True, metadata=_help("Recompute logprobs with the current weights before update.")
    )
    use_decoupled_loss: bool = field(
        default=False, metadata=_help("Decoupled PPO: proximal policy = recomputed logprobs.")
    )
    behav_imp_weight_cap: Optional[float] = field(
        default=None, metadata=_help("Mask tokens whose behaviour importance weight exceeds this.")
    )
    dynamic_sampling: bool = field(
        default=False,
        metadata=_help(
            "DAPO's dynamic sampling: the rollout executor drops groups whose rewards are all "
            "equal and generates others in their place (arealite/rollout/group_filter.py)."
        ),
    )
    dynamic_sampling_max_oversample: float = field(
        default=3.0,
        metadata=_help(
            "Cap: at most (this - 1) x batch groups dropped per step; past it equal-reward "
            "groups are trained on (their loss mask zeroed) and counted."
        ),
    )

    def __post_init__(self):
        super().__post_init__()
        if self.group_size < 1:
            raise ConfigError(f"actor.group_size must be >= 1, got {self.group_size}")
        if self.ppo_n_minibatches < 1:
            raise ConfigError(f"actor.ppo_n_minibatches must be >= 1, got {self.ppo_n_minibatches}")
        if self.c_clip is not None and self.c_clip <= 1:
            raise ConfigError(f"actor.c_clip must be > 1 (dual clip), got {self.c_clip}")
        if self.dynamic_sampling_max_oversample < 1:
            raise ConfigError(
                "actor.dynamic_sampling_max_oversample must be >= 1 (1 = never drop), got "
                f"{self.dynamic_sampling_max_oversample}"
            )
        if self.use_decoupled_loss and not self.recompute_logprob:
            raise ConfigError(
                "actor.use_decoupled_loss=true needs actor.recompute_logprob=true "
                "(the proximal policy is the recomputed logprob)"
            )
        if self.overlong_reward_penalty and (
            self.overlong_tokens is None or self.overlong_penalty_factor is None
        ):
            raise ConfigError(
                "actor.overlong_reward_penalty=true needs actor.overlong_tokens and "
                "actor.overlong_penalty_factor"
            )


@dataclass
class PPOCriticConfig(TrainEngineConfig):
    """The value model for PPO (GAE)."""

    is_critic: bool = True
    ppo_n_minibatches: int = 1
    value_eps_clip: float = field(default=0.2, metadata=_help("Value clipping epsilon."))
    warmup_steps: int = field(
        default=0,
        metadata=_help(
            "First RL steps in which only the critic trains (verl's critic_warmup): the actor "
            "is not updated, so the values fit the initial policy's returns before they steer "
            "it. Counts towards total_train_steps. Not the lr warmup of `optimizer`."
        ),
    )

    def __post_init__(self):
        super().__post_init__()
        if self.warmup_steps < 0:
            raise ConfigError(f"critic.warmup_steps must be >= 0, got {self.warmup_steps}")


# ----------------------------------------------------------------------------- rollout side


@dataclass
class InferenceEngineConfig(ConfigBase):
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
        metadata=_help(
            "Prompts (groups of gconfig.n_samples episodes) per training batch; null = "
            "train_dataset.batch_size (if set, it must equal it)."
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
    reward_timeout: float = field(default=15.0, metadata=_help("Seconds per reward call."))
    reward_workers: int = field(default=2, metadata=_help("Reward process-pool size."))

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
        if self.total_train_epochs < 1:
            raise ConfigError(f"total_train_epochs must be >= 1, got {self.total_train_epochs}")

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
        if not self.allocation.train_only:
            raise ConfigError(
                f"allocation_mode={self.allocation_mode!r}: SFT runs no inference servers; "
                "use a train-only mode such as 'd2p1t1'"
            )
        if not self.model.path:
            raise ConfigError("model.path is required (an HF model directory or hub id)")


@dataclass
class GRPOConfig(BaseExperimentConfig):
    allocation_mode: str = "local.d1p1t1+d1p1t1"
    async_training: bool = field(
        default=True,
        metadata=_help("true: prepare_batch (eta from rollout); false: rollout_batch."),
    )
    gconfig: GenerationHyperparameters = field(default_factory=GenerationHyperparameters)
    rollout: InferenceEngineConfig = field(default_factory=InferenceEngineConfig)
    actor: PPOActorConfig = field(default_factory=PPOActorConfig)
    ref: Optional[PPOActorConfig] = field(
        default=None, metadata=_help("Reference model for the KL term (needs actor.kl_ctl > 0).")
    )
    critic: Optional[PPOCriticConfig] = field(default=None, metadata=_help("Value model (PPO)."))
    server: ServerConfig = field(default_factory=ServerConfig)
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
                "'local.d1p1t1+d1p1t1' (embedded), 'sglang.d2p1t1+d2p1t1' or 'vllm.d1p1t1+d1p1t1'"
            )
        if not self.actor.path:
            raise ConfigError("actor.path is required (an HF model directory or hub id)")
        if self.gconfig.n_samples != self.actor.group_size:
            raise ConfigError(
                f"gconfig.n_samples ({self.gconfig.n_samples}) must equal actor.group_size "
                f"({self.actor.group_size}): advantages are normalised per group of samples"
            )
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
        self._check_consumer_batch_size()
        if self.actor.kl_ctl > 0 and self.ref is None:
            raise ConfigError("actor.kl_ctl > 0 needs a reference model: set ref.path")
        if not self.async_training and self.rollout.max_head_offpolicyness != 0:
            raise ConfigError(
                "async_training=false is synchronous RL: rollout.max_head_offpolicyness must be 0"
            )
        if not self.server.model_path:
            self.server.model_path = self.actor.path

    def _check_consumer_batch_size(self) -> None:
        """One training step consumes one batch of prompts: the rollout side counts it as
        rollout.consumer_batch_size, the data side as train_dataset.batch_size."""
        rollout, data = self.rollout, self.train_dataset.batch_size
        if rollout.consumer_batch_size is None:
            rollout.consumer_batch_size = data
        elif rollout.consumer_batch_size != data:
            raise ConfigError(
                f"rollout.consumer_batch_size={rollout.consumer_batch_size} but "
                f"train_dataset.batch_size={data}: a training step consumes one batch of prompts; "
                "set them equal, or leave rollout.consumer_batch_size unset (it follows "
                "train_dataset.batch_size)"
            )
