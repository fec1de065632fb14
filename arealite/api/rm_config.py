"""The reward-model training experiment (`examples/rm.py`): kept out of cli_args.py, which is
at its size limit; imports it, never the reverse."""

from __future__ import annotations

from dataclasses import dataclass, field

from arealite.api.cli_args import BaseExperimentConfig, TrainEngineConfig
from arealite.api.config_loader import ConfigError, help_text

BUILTIN_PREFERENCES = "arith_preferences"


@dataclass
class RMConfig(BaseExperimentConfig):
    """Bradley-Terry reward model on preference pairs. `train_dataset.path`: a jsonl of
    {prompt | messages, chosen, rejected}, or `arith_preferences` (synthetic, generated offline;
    options: size, seed, max_digits, min_offset, max_offset, test_fraction)."""

    model: TrainEngineConfig = field(
        default_factory=lambda: TrainEngineConfig(is_critic=True),
        metadata=help_text("Backbone + scalar head (is_critic is forced true)."),
    )

    def __post_init__(self):
        super().__post_init__()
        if not self.allocation.train_only:
            raise ConfigError(
                f"allocation_mode={self.allocation_mode!r}: reward-model training runs no "
                "inference servers; use a train-only mode such as 'd1p1t1'"
            )
        if not self.model.path:
            raise ConfigError("model.path is required (an HF model directory or hub id)")
        self.model.is_critic = True
        for key, ds in (
            ("train_dataset", self.train_dataset),
            ("valid_dataset", self.valid_dataset),
        ):
            if ds is not None and ds.path != BUILTIN_PREFERENCES and not ds.path.endswith(".jsonl"):
                raise ConfigError(
                    f"{key}.path={ds.path!r}: expected a .jsonl of preference rows or "
                    f"{BUILTIN_PREFERENCES!r}"
                )
