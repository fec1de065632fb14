"""What a run reads and writes besides its models: the datasets, checkpoints (HF export and
recover), evaluation and metrics logging.

Part of the experiment config (`cli_args.BaseExperimentConfig.train_dataset`, `.saver`,
`.recover`, ...), kept apart so `cli_args` stays about the algorithm; `cli_args` re-exports
every class here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from arealite.api.config_loader import ConfigBase, ConfigError
from arealite.api.config_loader import help_text as _help


@dataclass
class DatasetConfig(ConfigBase):
    """Where the rows come from (see README "Bring your own task")."""

    path: str = field(
        default="",
        metadata=_help(
            "A built-in task (arith, gsm8k, clevr_count_70k, synthetic_counting), a local "
            ".jsonl/.json/.parquet/.csv file, a save_to_disk folder, or a hub id."
        ),
    )
    name: Optional[str] = field(default=None, metadata=_help("Hub dataset config name."))
    split: str = "train"
    data_files: Any = field(
        default=None, metadata=_help("Hub / folder data_files (a path, list or split dict).")
    )
    columns: dict[str, str] = field(
        default_factory=dict,
        metadata=_help(
            "Canonical name -> the data's own column, e.g. {prompt: question, answer: solution}. "
            "Canonical: messages | prompt, answer, images, completion (SFT)."
        ),
    )
    prompt_template: Optional[str] = field(
        default=None,
        metadata=_help("Turns `prompt` into the user message, e.g. '{prompt}\\nAnswer:'."),
    )
    options: dict[str, Any] = field(
        default_factory=dict,
        metadata=_help(
            "Settings of a built-in task, e.g. arith: {size, seed, max_digits, n_operands}."
        ),
    )
    batch_size: int = field(default=8, metadata=_help("Prompts per step (global)."))
    shuffle: bool = True
    drop_last: bool = True
    max_length: Optional[int] = field(
        default=None, metadata=_help("Rows longer than this (tokens) are dropped or fail.")
    )
    too_long: Literal["drop", "fail"] = field(
        default="drop", metadata=_help("Rows over max_length: dropped (counted, logged) or fail.")
    )

    def __post_init__(self):
        super().__post_init__()
        if self.batch_size < 1:
            raise ConfigError(f"dataset.batch_size must be >= 1, got {self.batch_size}")


@dataclass
class _FreqConfig(ConfigBase):
    freq_epochs: Optional[int] = field(default=None, metadata=_help("Every N epochs."))
    freq_steps: Optional[int] = field(default=None, metadata=_help("Every N steps."))
    freq_secs: Optional[int] = field(default=None, metadata=_help("Every N seconds."))


@dataclass
class SaverConfig(_FreqConfig):
    """HF checkpoints for export."""


@dataclass
class EvaluatorConfig(_FreqConfig):
    """Held-out evaluation (RL): the mean reward of `n_samples` answers per held-out prompt.

    Greedy by default. Where a greedy answer saturates before the sampled policy does (a task
    whose every step the model knows but still slips at its sampling temperature), evaluate the
    policy as it samples: `temperature: 1.0, n_samples: 4` (avg@4)."""

    temperature: float = field(
        default=0.0,
        metadata=_help("0: greedy; > 0: sampled at this temperature (gconfig's top-k/p)."),
    )
    n_samples: int = field(
        default=1, metadata=_help("Answers per held-out prompt (> 1 only when sampling).")
    )

    def __post_init__(self):
        super().__post_init__()
        if self.temperature < 0:
            raise ConfigError(f"evaluator.temperature must be >= 0, got {self.temperature}")
        if self.n_samples < 1:
            raise ConfigError(f"evaluator.n_samples must be >= 1, got {self.n_samples}")
        if self.n_samples > 1 and self.temperature == 0:
            raise ConfigError(
                f"evaluator.n_samples={self.n_samples} with temperature 0: greedy answers are "
                "identical; set evaluator.temperature > 0 or n_samples 1"
            )


@dataclass
class RecoverConfig(_FreqConfig):
    """Recover checkpoints (resume after a crash)."""

    mode: Literal["disabled", "auto", "resume"] = field(
        default="disabled",
        metadata=_help("auto: resume if a checkpoint exists; resume: require one."),
    )
    retries: int = field(default=3, metadata=_help("Launcher retries of a failed run."))


@dataclass
class StatsLoggerConfig(ConfigBase):
    """TensorBoard + metrics JSONL always; wandb / swanlab when enabled."""

    wandb_mode: Literal["disabled", "online", "offline"] = "disabled"
    wandb_project: Optional[str] = None
    swanlab_mode: Literal["disabled", "cloud", "local"] = "disabled"
    print_every: int = field(default=1, metadata=_help("Progress line every N steps."))
