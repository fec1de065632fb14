"""LoRA adapters for a trained model (`actor.lora`), through `peft` (extra `lora`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from arealite.api.config_loader import ConfigBase, ConfigError, help_text


@dataclass
class LoRAConfig(ConfigBase):
    """Only the adapters train; weight sync and HF export send merged weights."""

    rank: int = field(default=8, metadata=help_text("Adapter rank r (>= 1)."))
    alpha: float = field(default=16.0, metadata=help_text("Scale: updates are alpha / r * BA."))
    dropout: float = field(default=0.0, metadata=help_text("Dropout on the adapter input."))
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        metadata=help_text("Module names (suffixes) that get adapters, e.g. [q_proj, v_proj]."),
    )

    def __post_init__(self):
        super().__post_init__()
        if self.rank < 1:
            raise ConfigError(f"lora.rank must be >= 1, got {self.rank}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"lora.dropout must be in [0, 1), got {self.dropout}")
        if not self.target_modules:
            raise ConfigError("lora.target_modules is empty: name the modules to adapt")
