"""What every HF-model trainer shares, whatever shards it: the padding-free micro-batch loop
of `train_batch` / `eval_batch` / `forward` (model loading: hf_model.py; AdamW: optimizer.py;
packing helpers and token alignment: packing.py; batch checks: batch_validation.py; the
split every rank agrees on: micro_batches.py).

Packing. A padded batch `[B, L]` is split into micro-batches under `mb_spec.max_tokens_per_mb`
and each micro-batch is packed into one row of T real tokens (no padding), with `position_ids`
restarting at 0 per sequence. Packed sequences must never attend to each other:
- sdpa_varlen (default; varlen_attention.py) and flash_attention_2 (GPU) get the varlen kwargs
  `cu_seq_lens_q/k`, `max_length_q/k` and attend within each sequence.
- sdpa / eager get a block-diagonal causal 4-D mask `[1, 1, T, T]` (bool for sdpa, additive
  float for eager): exact but O(T^2) compute, and T^2 bytes (16 MiB at T=4096).

Loss normalisation. `loss_fn(out, mb)` returns the micro-batch's *mean* loss (normalised by
what `loss_weight_fn(mb)` counts, e.g. loss tokens). Each is scaled by
`weight(mb) / global_weight * world_size` (global = over micro-batches and ranks); FSDP averages
gradients over ranks, so the step equals one global token mean, whatever the split.
"""

from __future__ import annotations

import logging
import math
import re
import warnings
from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDict
from torch import nn

from arealite.api.cli_args import TrainEngineConfig
from arealite.api.engine_api import LossFn, LossWeightFn, TrainEngine
from arealite.engine import varlen_attention  # noqa: F401 - registers attn_impl=sdpa_varlen
from arealite.engine.batch_validation import validate_model_batch
from arealite.engine.fsdp import clip_grad_norm_, torch_dtype
from arealite.engine.micro_batches import dummy_mb, split_across_ranks
from arealite.engine.packing import (
    SharedPrompts,
    block_causal_mask,
    packed_logprobs,
    packed_position_ids,
    shared_prompt_plan,
)
from arealite.engine.tensor_parallel import local_view
from arealite.engine.vlm_inputs import vlm_forward_mb
from arealite.utils import distributed as du
from arealite.utils.data import MicroBatchList, pack_tensor_dict
from arealite.utils.vision import is_vlm_config

logger = logging.getLogger("arealite.engine")
# torch's text (a regex would read its "()" as a group): expected after a skipped first update.
LR_BEFORE_OPTIMIZER_WARNING = "Detected call of `lr_scheduler.step()` before `optimizer.step()`"


class BaseHFEngine(TrainEngine):
    """The micro-batch loop over an HF model; subclasses build `self.model` (sharded or not),
    `self.optimizer` and `self.lr_scheduler` in `initialize`."""

    def __init__(self, config: TrainEngineConfig):
        self.config = config
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        self.device = torch.device("cpu")
        self._version = 0

    # -- small API ---------------------------------------------------------------------------

    def train(self, mode: bool = True) -> BaseHFEngine:
        if self.model is not None:
            self.model.train(mode)
        return self

    def step_lr_scheduler(self) -> None:
        """One step of the schedule per training step, also after a skipped update (no loss
        tokens), so the schedule follows the step count; torch warns when that skipped update
        was the first, which here is expected."""
        if self.lr_scheduler is not None:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", re.escape(LR_BEFORE_OPTIMIZER_WARNING))
                self.lr_scheduler.step()

    def set_version(self, version: int) -> None:
        self._version = int(version)

    def get_version(self) -> int:
        return self._version

    @property
    def eos_token_ids(self) -> list[int]:
        """EOS ids of the model (config and generation config), e.g. to detect truncation."""
        ids: list[int] = []
        for cfg in (self.model.config, getattr(self.model, "generation_config", None)):
            e = getattr(cfg, "eos_token_id", None)
            ids.extend(e if isinstance(e, list) else [] if e is None else [e])
        return sorted(set(ids))

    def _require_model(self) -> None:
        if self.model is None:
            raise RuntimeError(f"{type(self).__name__} is not initialized: call initialize()")

    # -- micro-batches -----------------------------------------------------------------------

    def _pack(self, mb: TensorDict) -> dict[str, Any]:
        packed = pack_tensor_dict(mb)
        packed["position_ids"] = packed_position_ids(packed["cu_seqlens"])
        return {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in packed.items()}

    def _replica_batch(self, input_: TensorDict) -> tuple[TensorDict, slice]:
        """(the batch this rank's replica computes, its own rows): tensor_parallel.py."""
        return input_, slice(None)

    def _model_output(self, out: torch.Tensor) -> torch.Tensor:
        return out  # tensor parallelism: the logits as a vocabulary-sharded DTensor

    def prepare_mbs(
        self, input_: TensorDict, required: tuple[str, ...] = ()
    ) -> tuple[list[dict[str, Any]], MicroBatchList | None, slice] | None:
        """Validate, split `_replica_batch(input_)` (the slice: this rank's rows) under the token
        budget and pack. All ranks get as many micro-batches (dummies pad, at the end); None if
        all are empty. A malformed batch on any rank raises on every rank (none hangs)."""
        error = None
        try:
            validate_model_batch(self.model.config, input_, required)
        except (KeyError, TypeError, ValueError) as e:
            error = e
        du.raise_if_any_rank_failed(error)
        input_, own = self._replica_batch(input_)
        split = split_across_ranks(input_, self.config.mb_spec)
        if split is None:
            return None
        mbl, n_mbs = split
        mbs = [self._pack(mb) for mb in mbl.mbs] if mbl else []
        mbs += [dummy_mb(self.device) for _ in range(n_mbs - len(mbs))]
        return mbs, mbl, own

    def _model_inputs(self, mb: dict[str, Any]) -> dict[str, Any]:
        cu = mb["cu_seqlens"]
        kw: dict[str, Any] = dict(
            input_ids=mb["input_ids"][None], position_ids=mb["position_ids"][None], use_cache=False
        )
        impl = self.config.attn_impl
        if impl in ("flash_attention_2", varlen_attention.NAME):
            kw.update(
                cu_seq_lens_q=cu,
                cu_seq_lens_k=cu,
                max_length_q=mb["max_seqlen"],
                max_length_k=mb["max_seqlen"],
            )
        else:
            dtype = torch_dtype(self.config.fsdp.param_dtype) if impl == "eager" else None
            kw["attention_mask"] = block_causal_mask(cu, dtype)
        return kw

    def forward_mb(self, mb: dict[str, Any]) -> torch.Tensor:
        """Logits [T, V] of one packed micro-batch (values [T], float32, for a critic; not yet
        shifted to token alignment)."""
        if is_vlm_config(self.model.config):
            return vlm_forward_mb(self.model, mb, self._model_inputs, self.config.attn_impl)
        shared = None
        if self.config.share_prompts and self.config.attn_impl == varlen_attention.NAME:
            shared = shared_prompts_of(mb)  # sdpa_varlen reads a prompt through an index
        if shared is None:
            out = self.model(**self._model_inputs(mb)).logits[0]
        else:  # each shared prompt computed once, the results expanded to the packed layout
            out = self.model(**self._model_inputs(kept_tokens(mb, shared))).logits[0]
            out = out.index_select(0, shared.expand)  # (faster backward than out[expand])
        return out.squeeze(-1).float() if self.config.is_critic else self._model_output(out)

    # -- TrainEngine -------------------------------------------------------------------------

    def train_batch(
        self, input_: TensorDict, loss_fn: LossFn, loss_weight_fn: LossWeightFn
    ) -> dict[str, float]:
        """One optimizer step over the (per-rank) batch. `loss_fn(out, mb)` and
        `loss_weight_fn(mb)` receive the packed micro-batch: a dict of [T] token entries plus
        `cu_seqlens`, `position_ids` and per-sequence entries. Empty global batches or a zero
        total weight skip the step with a warning."""
        self._require_model()
        if self.optimizer is None:
            raise RuntimeError(
                "this engine has no optimizer (config.optimizer is null): forward only"
            )
        prepared = self.prepare_mbs(input_)
        if prepared is None:
            return self._skipped("the batch is empty on every rank")
        mbs = prepared[0]
        weights = [0.0 if mb.get("dummy") else float(loss_weight_fn(mb)) for mb in mbs]
        total = du.all_reduce_sum([sum(weights)])[0]
        if total <= 0:
            return self._skipped("the total loss weight is 0 (e.g. no loss tokens)")
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum, scale = 0.0, du.world_size() / total
        for mb, w in zip(mbs, weights):
            out = self.forward_mb(mb)
            if mb.get("dummy"):
                loss = local_view(out).float().sum() * 0.0
            else:
                loss = loss_fn(out, mb)
                loss_sum += float(loss.detach()) * w
                loss = loss * (w * scale)
            loss.backward()
        grad_norm = clip_grad_norm_(
            list(self.model.parameters()), self.config.optimizer.gradient_clipping
        )
        ok = math.isfinite(grad_norm)
        if ok:
            self.optimizer.step()
        else:
            logger.warning("non-finite grad norm %s: optimizer step skipped", grad_norm)
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum, n_tokens, n_seqs = du.all_reduce_sum(
            [loss_sum, float(input_["attention_mask"].sum()), float(input_.batch_size[0])]
        )
        return dict(
            loss=loss_sum / total,
            grad_norm=grad_norm,
            lr=self.optimizer.param_groups[0]["lr"],
            update_successful=float(ok),
            loss_weight=total,
            n_tokens=n_tokens,
            n_seqs=n_seqs,
            n_mbs=float(len(mbs)),
        )

    def _skipped(self, why: str) -> dict[str, float]:
        logger.warning("train_batch skipped: %s", why)
        lr = self.optimizer.param_groups[0]["lr"] if self.optimizer else 0.0
        return dict(loss=0.0, grad_norm=0.0, lr=lr, update_successful=0.0, n_tokens=0.0, n_seqs=0.0)

    @torch.no_grad()
    def eval_batch(
        self, input_: TensorDict, loss_fn: LossFn, loss_weight_fn: LossWeightFn
    ) -> torch.Tensor | None:
        """The global weighted loss (same normalisation as `train_batch`); None if empty."""
        self._require_model()
        prepared = self.prepare_mbs(input_)
        if prepared is None:
            return None
        loss_sum, weight = 0.0, 0.0
        for mb in prepared[0]:
            out = self.forward_mb(mb)
            if not mb.get("dummy"):
                w = float(loss_weight_fn(mb))
                loss_sum += float(loss_fn(out, mb)) * w
                weight += w
        loss_sum, weight = du.all_reduce_sum([loss_sum, weight])
        return None if weight <= 0 else torch.tensor(loss_sum / weight)

    @torch.no_grad()
    def forward(
        self,
        input_: TensorDict,
        output_seqlens: list[int] | None = None,
        post_hook: Callable[[torch.Tensor, dict[str, Any]], Any] | None = None,
        aggregate_fn: Callable[[list[Any]], Any] = torch.cat,
    ) -> Any | None:
        """Forward-only over the batch, results in the original order.

        `post_hook(out, mb)` maps a micro-batch's logits [T, V] to per-token results [T, ...]
        (default: the logits). Without `output_seqlens`, each sequence's result is padded to
        `[1, L, ...]` so the default `torch.cat` gives `[B, L, ...]` aligned with `input_ids`;
        with `output_seqlens` (one length per sequence) results are split by those lengths and
        `aggregate_fn` receives the list of per-sequence tensors.
        """
        self._require_model()
        prepared = self.prepare_mbs(input_)
        if prepared is None:
            return None
        mbs, mbl, own = prepared  # (output_seqlens: scalar heads only, never tensor parallel)
        per_seq: list[torch.Tensor] = []
        for j, mb in enumerate(mbs):
            out = self.forward_mb(mb)
            if mb.get("dummy"):
                continue
            res = post_hook(out, mb) if post_hook else out
            if output_seqlens is None:
                lens = mb["cu_seqlens"].diff().tolist()
            else:
                lens = [output_seqlens[i] for i in mbl.group_indices[j]]
            per_seq.extend(torch.split(res, lens))
        per_seq = [per_seq[i] for i in mbl.backward_indices][own]
        if output_seqlens is None:
            L = input_["attention_mask"].shape[1]
            per_seq = [_pad_to(x, L)[None] for x in per_seq]
        return aggregate_fn(per_seq)

    def compute_logprobs(
        self, input_: TensorDict, temperature: float = 1.0, with_entropy: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
        """Per-token logprobs [B, L] (float32, 0 at position 0 and on padding) of the batch at
        `temperature`; with `with_entropy`, also the entropies [B, L]."""

        def hook(logits, mb):
            out = packed_logprobs(
                logits, mb["input_ids"], mb["cu_seqlens"], temperature, with_entropy
            )
            return torch.stack(out, -1) if with_entropy else out

        res = self.forward(input_, post_hook=hook)
        if res is None or not with_entropy:
            return None if res is None else res.cpu()
        return res[..., 0].cpu(), res[..., 1].cpu()


def shared_prompts_of(mb: dict[str, Any]) -> SharedPrompts | None:
    """The plan for computing once each prompt that several sequences of `mb` share."""
    if "loss_mask" not in mb or mb.get("dummy"):
        return None
    return shared_prompt_plan(mb["input_ids"], mb["loss_mask"], mb["cu_seqlens"])


def kept_tokens(mb: dict[str, Any], shared: SharedPrompts) -> dict[str, Any]:
    """The micro-batch's model inputs restricted to the kept tokens; the attention plan rides
    on `cu_seqlens`, which every attention layer receives."""
    cu = mb["cu_seqlens"].clone()
    lengths = tuple(cu.diff().tolist())
    cu._arealite_plan = varlen_attention.shared_prompt_gather_plan(lengths, shared, cu.device)
    return dict(
        input_ids=mb["input_ids"][shared.kept],
        position_ids=mb["position_ids"][shared.kept],
        cu_seqlens=cu,
        max_seqlen=mb["max_seqlen"],
    )


def _pad_to(x: torch.Tensor, length: int) -> torch.Tensor:
    if x.shape[0] == length:
        return x
    return torch.cat([x, x.new_zeros(length - x.shape[0], *x.shape[1:])])
