"""The reward-model training experiment (`examples/rm.py`): kept out of cli_args.py, which is
at its size limit; imports it, never the reverse."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from arealite.api.cli_args import BaseExperimentConfig, TrainEngineConfig, check_trainer_only
from arealite.api.config_loader import ConfigError, help_text

BUILTIN_PREFERENCES = "arith_preferences"
PAIR_FIELDS = ("chosen", "rejected")
# Options of the built-in `arith_preferences` data (dataset `options:`) and their defaults:
# n_operands terms of max_digits digits; wrong answers off by min_offset..max_offset;
# sampled_negatives_from: a model dir whose own wrong samples (sampled_negatives_n per prompt,
# labelled by the exact verifier) replace the synthetic rejected answers of a
# sampled_negatives_fraction of the rows.
ARITH_PREFERENCE_OPTIONS: dict[str, Any] = dict(
    size=4096,
    seed=0,
    max_digits=1,
    n_operands=2,
    test_fraction=0.2,
    min_offset=10,
    max_offset=30,
    sampled_negatives_from=None,
    sampled_negatives_n=4,
    sampled_negatives_fraction=1.0,
)


class PreferenceFormatError(ValueError):
    """A preference row lacks a field (the message names the file, row and field)."""


def read_preference_rows(path: str) -> list[dict[str, Any]]:
    """Rows of a jsonl file, each checked for a prompt (or messages), chosen and rejected. Here
    (not in the engine) because the launcher's preflight checks the file before anything starts."""
    rows = []
    with open(path) as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise PreferenceFormatError(f"{path}: row {i} is not valid JSON ({e})") from None
            if not isinstance(row, dict):
                raise PreferenceFormatError(f"{path}: row {i} is not a JSON object")
            check_preference_row(row, i, path)
            rows.append(row)
    if not rows:
        raise PreferenceFormatError(f"{path}: no preference rows")
    return rows


def check_preference_row(row: dict, index: int, source: str) -> None:
    if row.get("messages") is None and row.get("prompt") is None:
        raise PreferenceFormatError(f"{source}: row {index} has neither 'prompt' nor 'messages'")
    for key in PAIR_FIELDS:
        if not isinstance(row.get(key), str):
            raise PreferenceFormatError(
                f"{source}: row {index} is missing field {key!r} (a string; its fields: "
                f"{sorted(row)})"
            )


def is_preference_data(path: str) -> bool:
    """The built-in preference task, or a jsonl whose first row has `chosen` and `rejected`:
    how the launcher tells a reward-model run from an SFT run (both are train-only)."""
    if path == BUILTIN_PREFERENCES:
        return True
    if not path.endswith(".jsonl"):
        return False
    try:
        with open(path) as f:
            first = next((line for line in f if line.strip()), "")
        row = json.loads(first)
    except (OSError, json.JSONDecodeError):
        return False
    return isinstance(row, dict) and all(k in row for k in PAIR_FIELDS)


# Written next to the HF weights of an LM-head checkpoint (implicit / likelihood: {head, beta,
# reference}): how a scorer (arealite/reward/reward_model.py) tells it from a scalar-head one.
RM_HEAD_FILE = "reward_head.json"
LM_HEADS = ("implicit", "likelihood")


@dataclass
class RMEngineConfig(TrainEngineConfig):
    """The reward model's backbone and head (see arealite/engine/rm/)."""

    head: Literal["scalar", "implicit", "likelihood"] = field(
        default="scalar",
        metadata=help_text(
            "scalar: a 1-output head read at the last token (is_critic). implicit: the causal "
            "LM itself, r(x, y) = beta * sum over the response of log pi(y_t|.) - log ref(y_t|.) "
            "(DPO's implicit reward; unbounded on text the pairs never showed). likelihood: "
            "reference-free, r = beta * mean log pi(y_t|.) over the response (SimPO's reward; "
            "at most 0, highest where the LM itself would answer). Both LM heads train with the same "
            "Bradley-Terry loss."
        ),
    )
    beta: float = field(default=0.1, metadata=help_text("LM heads: the reward scale (> 0)."))
    reference: Optional[str] = field(
        default=None,
        metadata=help_text(
            "implicit head: the frozen reference model directory; null = model.path (the "
            "initial weights, as in DPO)."
        ),
    )

    def check_head(self, key: str = "model") -> None:
        """Head-specific fields: errors name the key."""
        if self.head in LM_HEADS and not self.beta > 0:
            raise ConfigError(f"{key}.beta={self.beta!r}: the {self.head} head needs beta > 0")
        if self.head != "implicit" and self.reference is not None:
            raise ConfigError(
                f"{key}.reference={self.reference!r} is only read by {key}.head=implicit "
                f"(the {self.head} head has no reference model)"
            )


@dataclass
class RMConfig(BaseExperimentConfig):
    """Bradley-Terry reward model on preference pairs. `train_dataset.path`: a jsonl of
    {prompt | messages, chosen, rejected}, or `arith_preferences` (synthetic, generated offline;
    options: ARITH_PREFERENCE_OPTIONS)."""

    model: RMEngineConfig = field(
        default_factory=lambda: RMEngineConfig(is_critic=True),
        metadata=help_text("Backbone + head (is_critic is set from model.head)."),
    )

    def __post_init__(self):
        super().__post_init__()
        check_trainer_only(self, "reward-model training", "d1p1t1")
        self.model.check_head()
        self.model.is_critic = self.model.head == "scalar"
        for key, ds in (
            ("train_dataset", self.train_dataset),
            ("valid_dataset", self.valid_dataset),
        ):
            if ds is not None and ds.path != BUILTIN_PREFERENCES and not ds.path.endswith(".jsonl"):
                raise ConfigError(
                    f"{key}.path={ds.path!r}: expected a .jsonl of preference rows or "
                    f"{BUILTIN_PREFERENCES!r}"
                )
            if ds is not None and ds.path == BUILTIN_PREFERENCES:
                unknown = sorted(set(ds.options or {}) - set(ARITH_PREFERENCE_OPTIONS))
                if unknown:
                    raise ConfigError(
                        f"{key}.options: unknown {BUILTIN_PREFERENCES} option(s) {unknown}; "
                        f"allowed: {sorted(ARITH_PREFERENCE_OPTIONS)}"
                    )
