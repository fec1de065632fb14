"""Training-side configs: micro-batching, optimizer, FSDP, the engines, the PPO actor and critic.

Re-exported by `cli_args.py`, the one import users need.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from arealite.api.config_loader import ConfigBase, ConfigError, derived_from, require
from arealite.api.config_loader import help_text as _help
from arealite.api.lora_config import LoRAConfig
from arealite.api.presets import PresetName

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
    share_prompts: bool = field(
        default=True,
        metadata=_help(
            "Compute a prompt that several sequences of a micro-batch share (a GRPO group's) "
            "once: exact, ~2x fewer tokens when responses are as short as prompts "
            "(sdpa_varlen, text models)."
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
    tensor_parallel_size: int = field(
        default=1,
        metadata=derived_from(
            "allocation_mode",
            "Ranks per tensor group (the trainer part's t): the model's heads, MLP and "
            "vocabulary are sharded over them (engine/tensor_parallel.py).",
        ),
    )


@dataclass
class PPOActorConfig(TrainEngineConfig):
    """The policy: PPO / GRPO and their variants (see `preset`)."""

    preset: Optional[PresetName] = field(
        default=None,
        metadata=_help("A named algorithm's defaults (api/presets.py); explicit keys still win."),
    )
    group_size: int = field(
        default=1, metadata=derived_from("gconfig.n_samples", "Samples per prompt (GRPO group).")
    )
    ppo_n_minibatches: int = field(default=1, metadata=_help("Optimizer steps per batch."))
    temperature: float = field(
        default=1.0,
        metadata=derived_from(
            "gconfig.temperature", "Temperature of the log-probabilities (the sampler's)."
        ),
    )
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
        metadata=derived_from(
            "rollout.dynamic_sampling",
            "Zero the loss mask of equal-reward groups (those dynamic sampling accepted past "
            "its cap).",
        ),
    )

    def __post_init__(self):
        super().__post_init__()
        require(self.group_size >= 1, "actor.group_size", self.group_size, ">= 1")
        n = self.ppo_n_minibatches
        require(n >= 1, "actor.ppo_n_minibatches", n, ">= 1")
        c = self.c_clip
        require(c is None or c > 1, "actor.c_clip", c, "> 1 (dual clip)")
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
        require(self.warmup_steps >= 0, "critic.warmup_steps", self.warmup_steps, ">= 0")
