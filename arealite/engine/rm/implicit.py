"""The LM reward heads: the causal LM itself scores a response. `implicit`:

    r(x, y) = beta * sum_{t in response} [log pi_theta(y_t | x, y_<t) - log pi_ref(y_t | x, y_<t)],

DPO's implicit reward (Rafailov et al. 2023; as an outcome RM, "implicit PRM", Yuan et al. 2024);
`likelihood`: SimPO's reference-free reward (Meng et al. 2024), the length-normalised
r = beta * mean_{t in response} log pi_theta(y_t | .). Both train with the scalar head's
Bradley-Terry loss on the same packed pairs.

Which to use as an RL reward (measured, README "Reward model"): the log-ratio is unconstrained
on text the pairs never showed (GRPO finds 8 tokens of garbage whose ratio sums above a correct
answer's); a log-likelihood is at most 0 and highest where the LM itself would answer, and the
mean (not the sum) keeps the empty answer, one unlikely EOS, below a wrong one (summed, GRPO
drifted to empty answers).

Why: a scalar head read at the last token must learn a new circuit that re-derives whether the
answer is right (one bit per pair teaches it slowly); the LM's own next-token probabilities
already carry what the backbone knows (a model that adds assigns the right sum a higher
likelihood), and the BT loss sharpens them where the pairs say so.

The reference is frozen and only ever enters as one number per sequence, its summed response
logprob, so it is computed once per row outside the engine (preference_data.with_reference_
scores) and travels with the batch: `ref_chosen` / `ref_rejected` per pair row (`ref_score` per
ordinary row), next to a token `loss_mask` marking the response tokens (answer ++ EOS).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from tensordict import TensorDict

from arealite.api.io_struct import SaveLoadMeta
from arealite.api.rm_config import LM_HEADS, RM_HEAD_FILE
from arealite.engine.packing import packed_logprobs
from arealite.engine.rm.reward_model import FSDPRewardModel
from arealite.utils import distributed as du


def sequence_sums(per_token: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Sum of a packed [T] tensor within each sequence, [n_seqs]."""
    lens = cu_seqlens.diff().long()
    seg = torch.repeat_interleave(torch.arange(len(lens), device=per_token.device), lens)
    return per_token.new_zeros(len(lens)).index_add(0, seg, per_token)


class FSDPImplicitRewardModel(FSDPRewardModel):
    """A reward model with an LM head (module docstring): `config.head` (implicit |
    likelihood), `config.beta`, `config.reference` (implicit; None = `config.path`); the LM is
    trained, no head is added."""

    def _check_config(self, config: Any) -> None:
        head = getattr(config, "head", None)
        if config.is_critic or head not in LM_HEADS:
            raise ValueError(
                f"an LM reward head (one of {LM_HEADS}, got {head!r}) is the causal LM itself: "
                "is_critic must be false"
            )
        if not config.beta > 0:
            raise ValueError(f"the {head} head needs beta > 0, got {config.beta}")

    @property
    def reference_path(self) -> str | None:
        """The frozen reference (implicit head); None for the reference-free likelihood head."""
        if self.config.head != "implicit":
            return None
        return os.path.abspath(self.config.reference or self.config.path)

    def _pack(self, mb: TensorDict) -> dict[str, Any]:
        packed = super()._pack(mb)
        if "ref_chosen" in packed:  # pair rows: sequence 2k chosen, 2k+1 rejected
            pair = (packed.pop("ref_chosen"), packed.pop("ref_rejected"))
            packed["ref_score"] = torch.stack(pair, dim=1).flatten()
        return packed

    def _check_keys(self, data: TensorDict, pairs: bool) -> None:
        keys = set(data.keys())
        need = ["loss_mask"]
        if self.reference_path:
            need += ["ref_chosen", "ref_rejected"] if pairs else ["ref_score"]
        missing = [k for k in need if k not in keys]
        error = None
        if missing:
            error = KeyError(
                f"{self.config.head}-head reward-model batch lacks {missing}: rows need the "
                "response loss_mask (and, implicit head, the reference's summed response "
                "logprobs: preference_data.with_reference_scores)"
            )
        du.raise_if_any_rank_failed(error)
        super()._check_keys(data, pairs)

    def _seq_scores(self, logits: torch.Tensor, mb: dict[str, Any]) -> torch.Tensor:
        cu = mb["cu_seqlens"]
        logp = packed_logprobs(logits.float(), mb["input_ids"], cu)
        mask = mb["loss_mask"].to(logp.dtype)
        policy = sequence_sums(logp * mask, cu)
        if self.reference_path is None:  # likelihood: the mean over the response
            return self.config.beta * policy / sequence_sums(mask, cu).clamp(min=1.0)
        return self.config.beta * (policy - mb["ref_score"].to(policy))

    def save(self, meta: SaveLoadMeta) -> None:
        super().save(meta)
        if meta.weight_format == "hf" and du.is_main():
            head = dict(head=self.config.head, beta=self.config.beta, reference=self.reference_path)
            with open(os.path.join(meta.path, RM_HEAD_FILE), "w") as f:
                json.dump(head, f, indent=1)
