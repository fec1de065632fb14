"""The two engine contracts: a trainer (`TrainEngine`) and a generator (`InferenceEngine`).

Algorithms (PPO actor, SFT) are written against these, so the same training script runs with
FSDP on a laptop CPU or a GPU cluster, and with SGLang, vLLM or the embedded server for rollouts.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

from arealite.api.io_struct import (
    FinetuneSpec,
    ModelRequest,
    ModelResponse,
    SaveLoadMeta,
    WeightUpdateMeta,
)

if TYPE_CHECKING:
    from tensordict import TensorDict

# A loss over one packed micro-batch (a dict of [T] token entries plus `cu_seqlens`,
# `position_ids` and per-sequence entries): `loss_fn(model_output, mb)`, weighted by
# `loss_weight_fn(mb)` (e.g. its number of loss tokens).
LossFn = Callable[[torch.Tensor, dict[str, Any]], torch.Tensor]
LossWeightFn = Callable[[dict[str, Any]], float]


class TrainEngine(abc.ABC):
    """A model being trained, possibly sharded over ranks.

    Batches are padded TensorDicts `[B, L]` with at least `input_ids` and `attention_mask`;
    implementations pack them padding-free and split them into micro-batches themselves.
    Losses are token-weighted: `loss_weight_fn(mb)` gives each micro-batch's weight (e.g. its
    number of loss tokens), and the engine normalises by the global total across micro-batches
    and ranks, so the result does not depend on how the batch was split.
    """

    @abc.abstractmethod
    def initialize(self, addr: str | None, ft_spec: FinetuneSpec | None) -> None:
        """Build the model, optimizer and LR schedule (whose length comes from `ft_spec`).

        `addr` is the process-group rendezvous address, None to use the torchrun environment.
        """

    @abc.abstractmethod
    def destroy(self) -> None:
        """Release the model, optimizer and process groups."""

    def train(self, mode: bool = True) -> TrainEngine:
        """Switch train/eval mode (dropout etc.); returns self."""
        return self

    def eval(self) -> TrainEngine:
        return self.train(False)

    @abc.abstractmethod
    def train_batch(
        self, input_: TensorDict, loss_fn: LossFn, loss_weight_fn: LossWeightFn
    ) -> dict[str, float]:
        """One optimizer step on `input_`: forward, `loss_fn(logits, mb)` per micro-batch,
        backward, gradient clipping, step. Returns stats (grad_norm, lr, ...)."""

    @abc.abstractmethod
    def eval_batch(
        self, input_: TensorDict, loss_fn: LossFn, loss_weight_fn: LossWeightFn
    ) -> torch.Tensor | None:
        """The token-weighted loss of `input_` without updating weights."""

    @abc.abstractmethod
    def forward(
        self,
        input_: TensorDict,
        output_seqlens: list[int] | None = None,
        post_hook: Callable[[torch.Tensor, TensorDict], Any] | None = None,
        aggregate_fn: Callable[[list[Any]], Any] = torch.cat,
    ) -> Any | None:
        """Inference forward over the batch; `post_hook(logits, mb)` maps each micro-batch's
        logits (e.g. to per-token logprobs) and `aggregate_fn` joins the results, in the
        original order of `input_`."""

    @abc.abstractmethod
    def step_lr_scheduler(self) -> None:
        """Advance the LR schedule by one step (called once per training step)."""

    @abc.abstractmethod
    def upload_weights(self, meta: WeightUpdateMeta) -> None:
        """Publish the current weights for inference servers (disk: write HF safetensors
        atomically; nccl: broadcast to the servers' process group in buckets)."""

    @abc.abstractmethod
    def save(self, meta: SaveLoadMeta) -> None:
        """Save HF weights (export / weight sync) or a DCP checkpoint (recovery)."""

    @abc.abstractmethod
    def load(self, meta: SaveLoadMeta) -> None:
        """Inverse of `save`."""

    @abc.abstractmethod
    def set_version(self, version: int) -> None:
        """Set the weight version (number of completed policy updates)."""

    @abc.abstractmethod
    def get_version(self) -> int:
        """The current weight version."""


class InferenceEngine(abc.ABC):
    """A client of one or more inference servers: generation, weight updates, versions.

    `agenerate` is one token-in/token-out call. Running whole episodes in the background under
    the staleness bound is the job of `arealite.rollout.WorkflowExecutor`, built on an engine.
    """

    @abc.abstractmethod
    def initialize(self, addr: str | list[str] | None = None) -> None:
        """Connect to the servers (addresses from the argument, config or environment)."""

    @abc.abstractmethod
    def destroy(self) -> None:
        """Cancel requests in flight and close connections."""

    @abc.abstractmethod
    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """Generate for one request. Interrupted generations (weight updates) are resumed
        transparently; every output token records the weight version that produced it."""

    async def agenerate_group(self, reqs: list[ModelRequest]) -> list[ModelResponse]:
        """Generate for several requests (a GRPO group), answers in order. Engines that can
        send them as one call (SGLang's batch form) override this; here, concurrent calls."""
        return list(await asyncio.gather(*(self.agenerate(r) for r in reqs)))

    @abc.abstractmethod
    def update_weights(self, meta: WeightUpdateMeta) -> Future:
        """Ask every server to load new weights; the future resolves when all have.
        Generation is paused meanwhile and resumes by itself."""

    @abc.abstractmethod
    def pause_generation(self) -> None:
        """Abort in-flight generation on every server and hold new requests (for callers that
        swap weights themselves); aborted requests resume after `continue_generation`."""

    @abc.abstractmethod
    def continue_generation(self) -> None:
        """Let generation run again after `pause_generation`."""

    @abc.abstractmethod
    def set_version(self, version: int) -> None:
        """Set the policy version (number of completed policy updates)."""

    @abc.abstractmethod
    def get_version(self) -> int:
        """The current policy version."""

    def server_load(self) -> dict[str, float] | None:
        """The servers' cumulative batching counters, summed: decode_steps, batch_rows (rows
        over those steps), busy_seconds (time in steps), servers; None where the server does
        not report them (SGLang, vLLM). Deltas between two calls give the batch occupancy."""
        return None
