"""A trained reward model as the reward of a GRPO run: `reward: path/to/rm_checkpoint`.

The checkpoint is what `examples/rm.py` saves (an HF token-classification model with one
label, plus its tokenizer). Where it is scored, and why: in the reward worker process
(`rollout.reward_workers`), on CPU, one completion per call, like any reward of the contract
(arealite/api/reward_api.py). The worker loads the model once, on its first call; the trainer
process never holds it, so no trainer memory or FSDP state is spent on it, a slow or failing
score is bounded by `rollout.reward_timeout` and counted like any reward error, and
weighted sums with other rewards work unchanged. Not batched: the contract scores one
completion, and a tiny CPU model scores one in milliseconds; a large RM belongs on a server.

The score is the head's output at the last token of `prompt_ids ++ completion_ids ++ EOS`
(EOS appended when the completion was cut before it), exactly how the model was trained
(arealite/engine/rm/preference_data.py: prompt ++ answer ++ EOS). Ids are scored as they are,
so the RM must share the policy's tokenizer (train it from the same base model).
"""

from __future__ import annotations

import json
import os

from arealite.api.reward_api import Reward, RewardInput, RewardSpecError


def check_reward_model_dir(path: str) -> dict:
    """The checkpoint's config.json, checked to be a 1-output scoring model."""
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise RewardSpecError(
            f"reward {path!r}: a directory without config.json; name the HF checkpoint "
            "directory examples/rm.py saved (e.g. <run_dir>/checkpoints/final/<name>)"
        )
    with open(config_file) as f:
        config = json.load(f)
    n_labels = len(config.get("id2label") or {}) or config.get("num_labels", 1)
    archs = config.get("architectures") or []
    if n_labels != 1 or not any(a.endswith("ForTokenClassification") for a in archs):
        raise RewardSpecError(
            f"reward {path!r}: not a reward model (architectures={archs}, {n_labels} labels); "
            "expected a 1-label token-classification checkpoint from examples/rm.py"
        )
    return config


class RewardModelScorer(Reward):
    """The reward model's score of prompt ++ completion. Picklable: only the path travels to the worker process, which loads the model on its first call."""

    def __init__(self, model_dir: str):
        check_reward_model_dir(model_dir)
        self.model_dir = model_dir
        self.__name__ = f"reward_model({model_dir})"
        self._model = None
        self._eos: int | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_model": None}

    def _load(self) -> None:
        import torch
        from transformers import AutoModelForTokenClassification, AutoTokenizer

        torch.set_num_threads(1)  # a reward worker shares the CPU with trainer and servers
        model = AutoModelForTokenClassification.from_pretrained(self.model_dir, num_labels=1)
        self._model = model.float().eval()
        try:
            self._eos = AutoTokenizer.from_pretrained(self.model_dir).eos_token_id
        except (OSError, ValueError):
            self._eos = model.config.eos_token_id

    def score(self, sample: RewardInput) -> float:
        import torch

        if self._model is None:
            self._load()
        completion = list(sample.completion_ids)
        ids = list(sample.prompt_ids) + completion
        if self._eos is not None and completion[-1:] != [self._eos]:  # cut before its EOS
            ids.append(self._eos)
        vocab = self._model.config.vocab_size
        if max(ids) >= vocab:
            raise ValueError(
                f"token id {max(ids)} >= the reward model's vocabulary ({vocab}): the RM "
                "must share the policy's tokenizer"
            )
        with torch.no_grad():
            logits = self._model(input_ids=torch.tensor([ids])).logits
        return float(logits[0, -1, 0])
