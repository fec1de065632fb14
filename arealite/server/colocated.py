"""Colocated generation: each trainer rank generates with its own copy of the policy, in its
own process, through the embedded server's continuous-batching scheduler (TRL's and verl's
one-device layout; `allocation_mode: colocated+d1p1t1`).

Why: on one device (a laptop CPU, one GPU) a server process costs every request an HTTP and
JSON round trip and competes with the trainer for the same cores. Here a batch's rollouts are
batched forward passes on the trainer's own cores and a weight update is an in-memory copy.
The executor, the staleness bound and the workflows are unchanged: this is one more
InferenceEngine, fed the same requests the embedded server would parse from JSON.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future
from typing import ClassVar

import torch

from arealite.api.cli_args import RolloutConfig
from arealite.api.engine_api import InferenceEngine
from arealite.api.io_struct import ModelRequest, ModelResponse, PartialResponse, WeightUpdateMeta
from arealite.server.model_runner import ModelRunner, Sequence
from arealite.server.protocol import BadRequest, parse_generate_request
from arealite.server.scheduler import Scheduler
from arealite.server.vlm_runner import create_runner

logger = logging.getLogger("arealite.colocated")


class ColocatedGenerator:
    """The policy copy and the scheduler thread that decodes with it, one per process and
    device: the training rollouts and the held-out evaluation share it, so both always see the
    weights of the last update."""

    _shared: ClassVar[dict[tuple[str, str], ColocatedGenerator]] = {}

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, key: tuple[str, str]):
        self.runner, self.scheduler, self.key = runner, scheduler, key
        self.users = 0

    @classmethod
    def shared(
        cls, model_path: str, dtype: str, device: torch.device, seed: int, max_batch_size: int
    ) -> ColocatedGenerator:
        """This process's generator for `model_path` on `device` (built on first use)."""
        key = (model_path, str(device))
        gen = cls._shared.get(key)
        if gen is None:
            runner = create_runner(model_path, dtype=dtype, device=str(device), seed=seed)
            scheduler = Scheduler(runner, max_batch_size=max_batch_size)
            scheduler.start()
            logger.info("colocated generation: %s on %s as %s", model_path, device, runner.dtype)
            gen = cls._shared[key] = cls(runner, scheduler, key)
        gen.users += 1
        return gen

    def release(self) -> None:
        """One user fewer; the last one stops the scheduler thread."""
        self.users -= 1
        if self.users == 0:
            self.scheduler.shutdown()
            self._shared.pop(self.key, None)

    def load(self, buckets: Iterable[dict[str, torch.Tensor]], version: int) -> None:
        """Copy the trainer's full weights in and tag them `version`. The buckets are taken here
        (on the caller's thread: gathering them may be a collective), the copy runs on the
        scheduler thread between steps, once no request is running or the running ones are
        frozen by an in-place pause (their next tokens are then tagged `version`)."""
        named = [item for bucket in buckets for item in bucket.items()]

        def job() -> str:
            message = self.runner.load_named_tensors(named)
            self.scheduler.set_weight_version(version)
            return message

        self.scheduler.run_exclusive(job).result()


class ColocatedEngine(InferenceEngine):
    """An InferenceEngine on this process's ColocatedGenerator. `in_process`: WeightSync
    loads the actor's weights with `load_weights` on every rank instead of pushing to servers."""

    in_process = True

    def __init__(self, config: RolloutConfig, generator: ColocatedGenerator):
        self.config, self.generator = config, generator
        self._version = 0
        self._allowed = threading.Event()  # cleared between pause and continue
        self._allowed.set()
        self._released = False

    def initialize(self, addr: str | list[str] | None = None) -> None:
        """Nothing to connect to: the generator is already running."""

    def destroy(self) -> None:
        if not self._released:
            self._released = True
            self.generator.release()

    def set_version(self, version: int) -> None:
        self._version = version

    def get_version(self) -> int:
        return self._version

    def expect_weight_version(self, version: int) -> None:
        """Nothing to check: no server can restart behind this client's back."""

    @property
    def weight_version(self) -> int:
        return self.generator.scheduler.weight_version

    def server_load(self) -> dict[str, float]:
        """The in-process scheduler's batching counters (the InferenceEngine contract)."""
        snap = self.generator.scheduler.metrics.snapshot()
        keys = ("decode_steps", "batch_rows", "busy_seconds")
        return {k: float(snap[k]) for k in keys} | {"servers": 1}

    # ---- generation ---------------------------------------------------------------------
    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        return (await self.agenerate_group([req]))[0]

    async def agenerate_group(self, reqs: list[ModelRequest]) -> list[ModelResponse]:
        """The requests decoded together (a GRPO group is admitted in one step, its shared
        prompt prefilled once); a pause aborts them and they resume as prompt + tokens so far,
        or (`pause_mode: in_place`) freezes them until the weights are loaded."""
        start = time.perf_counter()
        progress = [PartialResponse(r) for r in reqs]
        while todo := [p for p in progress if not p.done]:
            while not self._allowed.is_set():
                await asyncio.sleep(0.01)
            seqs = [self._sequence(p) for p in todo]
            futures = self.generator.scheduler.submit_many(seqs)
            try:
                await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
            except asyncio.CancelledError:  # the episode was cancelled: free the batch slots
                for seq in seqs:
                    self.generator.scheduler.abort_sequence(seq)
                raise
            for p, seq in zip(todo, seqs):
                finish = (seq.finish_reason or {}).get("type", "abort")
                p.extend(seq.output_ids, seq.output_logprobs, seq.token_versions(), finish, start)
        return [p.response(start) for p in progress]

    def _sequence(self, p: PartialResponse) -> Sequence:
        """The embedded server's request for what `p` has left to generate, checked as the
        server checks a JSON body (so a bad request fails the same way, naming its rid)."""
        req, runner = p.req, self.generator.runner
        if req.gconfig.n_samples != 1:
            raise ValueError(
                f"ModelRequest {req.rid}: agenerate produces one sample, got gconfig.n_samples="
                f"{req.gconfig.n_samples}; call it n times with gconfig.new(n_samples=1)"
            )
        params = req.gconfig.to_sampling_params()
        params["max_new_tokens"] = req.gconfig.max_new_tokens - len(p.tokens)
        params["min_new_tokens"] = max(0, req.gconfig.min_new_tokens - len(p.tokens))
        body = {
            "rid": req.rid,
            "input_ids": list(req.input_ids) + p.tokens,
            "sampling_params": params,
            "return_logprob": True,
            "image_data": req.image_data or [],
        }
        try:
            parsed = parse_generate_request(
                body,
                vocab_size=runner.vocab_size,
                max_positions=runner.max_positions,
                accepts_images=runner.accepts_images,
            )
        except BadRequest as e:
            raise ValueError(f"ModelRequest {req.rid}: {e}") from None
        return runner.new_sequence(parsed)

    # ---- weights and pausing ------------------------------------------------------------
    def load_weights(self, buckets: Iterable[dict[str, torch.Tensor]], version: int) -> None:
        """The trainer's weights, in memory (see ColocatedGenerator.load): loaded once the
        running rows finish (new ones wait), or with `pause_mode: in_place` at once, the
        running rows frozen meanwhile and going on under the new weights."""
        scheduler = self.generator.scheduler
        if self.config.pause_mode != "in_place" or scheduler.paused:  # a pause stays the caller's
            self.generator.load(buckets, version)
            return
        scheduler.pause(in_place=True).result()
        try:
            self.generator.load(buckets, version)
        finally:
            scheduler.resume()

    def update_weights(self, meta: WeightUpdateMeta) -> Future:
        """An HF checkpoint from disk (`meta.type == "disk"`); the in-memory path is
        `load_weights`."""
        if meta.type != "disk":
            raise ValueError(
                f"colocated generation loads weights in memory (load_weights) or from disk, "
                f"not by {meta.type!r}"
            )
        gen = self.generator

        def job() -> str:
            message = gen.runner.load_weights_from_disk(meta.path)
            gen.scheduler.set_weight_version(meta.version)
            return message

        return gen.scheduler.run_exclusive(job)

    def pause_generation(self) -> None:
        """Abort what is decoding (it resumes at continue_generation), or freeze it with
        `pause_mode: in_place`, and hold new requests."""
        self._allowed.clear()
        in_place = self.config.pause_mode == "in_place"
        self.generator.scheduler.pause(in_place=in_place).result()

    def continue_generation(self) -> None:
        self.generator.scheduler.resume()
        self._allowed.set()
