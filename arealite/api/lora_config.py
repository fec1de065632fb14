"""LoRA adapters for a trained model (`actor.lora`), through `peft` (extra `lora`)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from arealite.api.config_loader import ConfigBase, ConfigError, help_text
from arealite.utils.vision import is_vlm_config


@dataclass
class LoRAConfig(ConfigBase):
    """Only the adapters train; weight sync sends merged weights; checkpoints hold the PEFT
    adapter (and the merged model unless `save_merged` is false)."""

    rank: int = field(default=8, metadata=help_text("Adapter rank r (>= 1)."))
    alpha: float = field(default=16.0, metadata=help_text("Scale: updates are alpha / r * BA."))
    dropout: float = field(default=0.0, metadata=help_text("Dropout on the adapter input."))
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        metadata=help_text(
            "Module names (suffixes) that get adapters, e.g. [q_proj, v_proj]; each must match "
            "a module of the model."
        ),
    )
    save_merged: bool = field(
        default=True,
        metadata=help_text(
            "HF checkpoints (saver, final) also hold the merged model (from_pretrained-loadable) "
            "beside the PEFT adapter in <checkpoint>/adapter; false: the adapter only."
        ),
    )

    def __post_init__(self):
        super().__post_init__()
        if self.rank < 1:
            raise ConfigError(f"lora.rank must be >= 1, got {self.rank}")
        if self.alpha <= 0:
            raise ConfigError(f"lora.alpha must be > 0, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"lora.dropout must be in [0, 1), got {self.dropout}")
        if not self.target_modules:
            raise ConfigError("lora.target_modules is empty: name the modules to adapt")


def targets_matching_nothing(cfg: LoRAConfig, module_names: Iterable[str]) -> list[str]:
    """Entries of `cfg.target_modules` that match no module (peft's rule: the full name, or
    its suffix after a dot)."""
    names = list(module_names)
    return [t for t in cfg.target_modules if not any(n == t or n.endswith("." + t) for n in names)]


def check_lora_targets(cfg: LoRAConfig, model_dir: str, key: str = "actor") -> None:
    """Fail naming the key and the model's linear layers when a target matches nothing. Builds
    the model from its config.json on the meta device: no weights are read (about a second)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    hf_config = AutoConfig.from_pretrained(model_dir)
    cls = AutoModelForImageTextToText if is_vlm_config(hf_config) else AutoModelForCausalLM
    with torch.device("meta"):
        model = cls.from_config(hf_config)
    raise_unmatched_targets(cfg, model, key)


def raise_unmatched_targets(cfg: LoRAConfig, model, key: str = "actor") -> None:
    """ConfigError naming the unmatched entries of `<key>.lora.target_modules` and the
    model's linear layers (the names that would match)."""
    from torch import nn

    unmatched = targets_matching_nothing(cfg, (n for n, _ in model.named_modules()))
    if unmatched:
        linear = sorted(
            {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)}
        )
        raise ConfigError(
            f"{key}.lora.target_modules: {unmatched} match no module of the model; its linear "
            f"layers are {linear}"
        )


def check_lora_models(config) -> None:
    """Preflight for a run config: every engine with `lora:` (actor, critic, model) targets
    modules its model has. Call after model paths resolve to local directories."""
    for key in ("actor", "critic", "model"):
        engine = getattr(config, key, None)
        lora = getattr(engine, "lora", None)
        if lora is not None and getattr(engine, "path", ""):
            check_lora_targets(lora, engine.path, key)
