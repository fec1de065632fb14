"""A trained reward model as the reward of a GRPO run: `reward: path/to/rm_checkpoint`.

The checkpoint is what `examples/rm.py` saves, of either head (arealite/api/rm_config.py):
scalar, an HF token-classification model with one label; implicit / likelihood, an HF causal
LM plus `reward_head.json` ({head, beta, reference}; implicit: naming the frozen reference).
Where it is scored, and why: in the reward worker process (`rollout.reward_workers`), on CPU,
one completion per call, like any reward of the contract (arealite/api/reward_api.py). The
worker loads the model(s) once, on its first call; the trainer process never holds them, so no
trainer memory or FSDP state is spent on them, a slow or failing score is bounded by
`rollout.reward_timeout` and counted like any reward error, and weighted sums with other
rewards work unchanged. Not batched: the contract scores one completion, and a tiny CPU model
scores one in milliseconds; a large RM belongs on a server.

Scored on `prompt_ids ++ completion_ids ++ EOS` (EOS appended when the completion was cut
before it), exactly how the model was trained (arealite/engine/rm/preference_data.py: prompt ++
answer ++ EOS): scalar, the head's output at the last token; implicit, beta * the summed
log-ratio policy / reference of the completion's tokens (EOS included); likelihood, beta * their
mean logprob. Ids are scored as they are, so the RM must share the policy's tokenizer (train it
from the same base model).
"""

from __future__ import annotations

import json
import os

from arealite.api.reward_api import Reward, RewardInput, RewardSpecError
from arealite.api.rm_config import LM_HEADS, RM_HEAD_FILE


def _read_json(path: str, spec: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise RewardSpecError(f"reward {spec!r}: cannot read {path!r} ({e})") from None


def read_head(path: str) -> dict:
    """The checkpoint's head: {"head": "scalar"} or an LM head's {head, beta, reference}."""
    head_file = os.path.join(path, RM_HEAD_FILE)
    if not os.path.isfile(head_file):
        return {"head": "scalar"}
    head = _read_json(head_file, path)
    if head.get("head") not in LM_HEADS or not float(head.get("beta", 0)) > 0:
        raise RewardSpecError(
            f"reward {path!r}: {RM_HEAD_FILE} {head} is not an LM head ({LM_HEADS}, beta > 0)"
        )
    ref = head.get("reference")
    if head["head"] == "implicit" and not (
        ref and os.path.isfile(os.path.join(ref, "config.json"))
    ):
        raise RewardSpecError(
            f"reward {path!r}: the implicit head's reference model {ref!r} ({RM_HEAD_FILE}) "
            "is not an HF model directory (moved or deleted?)"
        )
    return head


def check_reward_model_dir(path: str) -> dict:
    """The checkpoint's head (read_head), checked against its config.json: a 1-output scoring
    model (scalar) or a causal LM (implicit / likelihood)."""
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise RewardSpecError(
            f"reward {path!r}: a directory without config.json; name the HF checkpoint "
            "directory examples/rm.py saved (e.g. <run_dir>/checkpoints/final/<name>)"
        )
    config = _read_json(config_file, path)
    head = read_head(path)
    archs = config.get("architectures") or []
    if head["head"] in LM_HEADS:
        if not any(a.endswith("ForCausalLM") for a in archs):
            raise RewardSpecError(
                f"reward {path!r}: a {head['head']}-head reward model must be a causal LM "
                f"(architectures={archs})"
            )
        return head
    n_labels = len(config.get("id2label") or {}) or config.get("num_labels", 1)
    if n_labels != 1 or not any(a.endswith("ForTokenClassification") for a in archs):
        raise RewardSpecError(
            f"reward {path!r}: not a reward model (architectures={archs}, {n_labels} labels, "
            f"no {RM_HEAD_FILE}); expected a checkpoint from examples/rm.py"
        )
    return head


def _response_logprob_sum(model, ids: list[int], n_prompt: int) -> float:
    import torch

    logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    return float(logp[n_prompt - 1 :].sum())


class RewardModelScorer(Reward):
    """The reward model's score of prompt ++ completion. Picklable: only the path travels to the
    worker process, which loads the model(s) on its first call."""

    def __init__(self, model_dir: str):
        self.head = check_reward_model_dir(model_dir)
        self.model_dir = model_dir
        self.__name__ = f"reward_model({model_dir})"
        self._model = self._ref = None
        self._eos: int | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_model": None, "_ref": None}

    def _load(self) -> None:
        import torch
        from transformers import (
            AutoModelForCausalLM,
            AutoModelForTokenClassification,
            AutoTokenizer,
        )

        torch.set_num_threads(1)  # a reward worker shares the CPU with trainer and servers
        if self.head["head"] == "scalar":
            model = AutoModelForTokenClassification.from_pretrained(self.model_dir, num_labels=1)
        else:
            model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
        if self.head["head"] == "implicit":
            ref = AutoModelForCausalLM.from_pretrained(self.head["reference"], dtype=torch.float32)
            self._ref = ref.eval()
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
            if self.head["head"] == "scalar":
                return float(self._model(input_ids=torch.tensor([ids])).logits[0, -1, 0])
            n = len(sample.prompt_ids)
            policy = _response_logprob_sum(self._model, ids, n)
            if self._ref is None:  # likelihood: the mean over the response (EOS included)
                return float(self.head["beta"]) * policy / (len(ids) - n)
            return float(self.head["beta"]) * (policy - _response_logprob_sum(self._ref, ids, n))
