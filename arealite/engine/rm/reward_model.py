"""A reward model: the critic's backbone + 1-output head, scored at each sequence's LAST token.

Pairs stay together. A preference pair travels as ONE padded row, `chosen ++ rejected`, with
`chosen_len` per row; the token-budget split therefore never separates a pair, and `_pack`
cuts each row back into two sequences (own cu_seqlens, positions restarting at 0), so chosen
and rejected never attend to each other. Packed sequence 2k is a chosen answer, 2k+1 its
rejected twin.

Bradley-Terry: P(chosen > rejected) = sigmoid(r_c - r_r); the loss is the mean over pairs of
-log sigmoid(r_c - r_r). Stats: pair accuracy (r_c > r_r), mean margin r_c - r_r.

Two heads read a packed micro-batch into one score per sequence (`_seq_scores`): the scalar
head here, and the implicit head (implicit.py: the causal LM's own log-ratio to a reference).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from tensordict import TensorDict

from arealite.api.cli_args import TrainEngineConfig
from arealite.engine.fsdp_engine import FSDPEngine
from arealite.engine.packing import packed_position_ids
from arealite.utils import distributed as du


def split_pairs(cu_seqlens: torch.Tensor, chosen_len: torch.Tensor) -> torch.Tensor:
    """cu_seqlens of packed `chosen ++ rejected` rows -> cu_seqlens of the 2P sequences."""
    starts, ends = cu_seqlens[:-1], cu_seqlens[1:]
    cut = starts + chosen_len.to(cu_seqlens)
    inner = torch.stack([cut, ends], dim=1).flatten()
    return torch.cat([cu_seqlens[:1], inner]).to(torch.int32)


def last_token_scores(values: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The head's output at each packed sequence's last token, [n_seqs]."""
    return values[cu_seqlens[1:].long() - 1]


def pair_stats(scores: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sums over pairs (scores interleaved chosen, rejected): loss, correct, margin, n."""
    margin = scores[0::2] - scores[1::2]
    return dict(
        loss=-F.logsigmoid(margin).sum(),
        correct=(margin > 0).float().sum(),
        margin=margin.sum(),
        n=torch.tensor(float(margin.numel())),
    )


class FSDPRewardModel(FSDPEngine):
    """`train_rm(pairs)` / `evaluate_rm(pairs)` on pair batches (see module docstring);
    `score(batch)` gives one reward per ordinary (prompt + completion) row."""

    def __init__(self, config: TrainEngineConfig):
        if config.tensor_parallel_size > 1:  # forward(output_seqlens=...) reads own rows only
            raise ValueError("a reward model trains without tensor parallelism: allocation_mode=dN")
        self._check_config(config)
        super().__init__(config)

    def _check_config(self, config: TrainEngineConfig) -> None:
        if not config.is_critic:
            raise ValueError("a scalar-head reward model needs is_critic=true")

    def _seq_scores(self, out: torch.Tensor, mb: dict[str, Any]) -> torch.Tensor:
        """One score per packed sequence, [n_seqs] (the scalar head: its last-token value)."""
        return last_token_scores(out, mb["cu_seqlens"])

    def _pack(self, mb: TensorDict) -> dict[str, Any]:
        packed = super()._pack(mb)
        if "chosen_len" not in packed:
            return packed
        chosen_len = packed.pop("chosen_len")
        rows = packed["cu_seqlens"].diff()
        if bool(((chosen_len < 1) | (chosen_len >= rows.to(chosen_len))).any()):
            raise ValueError("chosen_len must leave at least one token to each of the pair")
        cu = split_pairs(packed["cu_seqlens"], chosen_len)
        packed.update(cu_seqlens=cu, max_seqlen=int(cu.diff().max()))
        packed["position_ids"] = packed_position_ids(cu)
        return packed

    def _check_keys(self, data: TensorDict, pairs: bool) -> None:
        """Raised on every rank if any rank's batch lacks a key this head reads."""
        error = None
        if pairs and "chosen_len" not in data.keys():
            error = KeyError(
                "reward-model batch has no 'chosen_len' (rows are chosen ++ rejected pairs)"
            )
        du.raise_if_any_rank_failed(error)

    def _check_pairs(self, data: TensorDict) -> None:
        self._check_keys(data, pairs=True)

    def train_rm(self, data: TensorDict) -> dict[str, float]:
        """One optimizer step of the pairwise loss over the (per-rank) pair batch."""
        self._check_pairs(data)
        acc = {"correct": 0.0, "margin": 0.0}

        def loss_fn(values: torch.Tensor, mb: dict[str, Any]) -> torch.Tensor:
            st = pair_stats(self._seq_scores(values, mb))
            acc["correct"] += float(st["correct"])
            acc["margin"] += float(st["margin"].detach())
            return st["loss"] / st["n"]

        self.train()
        stats = self.train_batch(data, loss_fn, lambda mb: (len(mb["cu_seqlens"]) - 1) / 2)
        correct, margin, n = du.all_reduce_sum(
            [acc["correct"], acc["margin"], float(data.batch_size[0])]
        )
        stats.update(accuracy=correct / max(n, 1.0), margin=margin / max(n, 1.0))
        return stats

    @torch.no_grad()
    def evaluate_rm(self, data: TensorDict) -> dict[str, float]:
        """Global pair loss, accuracy, margin and mean chosen / rejected rewards."""
        self._check_pairs(data)
        self.eval()
        scores = self.forward(
            data,
            output_seqlens=[2] * data.batch_size[0],
            post_hook=self._seq_scores,
        )
        scores = torch.zeros(0) if scores is None else scores.float().cpu()
        st = pair_stats(scores)
        sums = du.all_reduce_sum(
            [float(st[k]) for k in ("loss", "correct", "margin", "n")]
            + [float(scores[0::2].sum()), float(scores[1::2].sum())]
        )
        n = max(sums[3], 1.0)
        return dict(
            loss=sums[0] / n,
            accuracy=sums[1] / n,
            margin=sums[2] / n,
            n_pairs=sums[3],
            chosen_reward=sums[4] / n,
            rejected_reward=sums[5] / n,
        )

    @torch.no_grad()
    def score(self, data: TensorDict) -> torch.Tensor | None:
        """One reward per row (the scalar head: its value at the row's last real token), [B]."""
        self._check_keys(data, pairs=False)
        self.eval()
        out = self.forward(
            data,
            output_seqlens=[1] * data.batch_size[0],
            post_hook=self._seq_scores,
        )
        return None if out is None else out.float().cpu()
