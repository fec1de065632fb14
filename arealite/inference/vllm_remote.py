"""RemoteVLLMEngine: the InferenceEngine over a vLLM server.

Speaks vLLM's token-in / token-out endpoint `POST /inference/v1/generate` (needs
`--enable-scale-out`) and its RL control endpoints `/pause`, `/resume`, `/collective_rpc`,
`/reset_prefix_cache`, `/update_weight_version` (need `VLLM_SERVER_DEV_MODE=1`): exactly the
server `arealite.launcher.servers.server_command("vllm", ...)` starts. Routing, retries,
fail-over and interruptible generation (an aborted request is resubmitted as prompt + tokens so
far with the remaining budget once the pause lifts) live in `RemoteInferenceEngine`; this file only says how vLLM spells each call.

Logprobs: the server must run with `--logprobs-mode processed_logprobs`, so each sampled token's
logprob is log_softmax(logits / T) - what the trainer recomputes (greedy: log_softmax(logits)).
vLLM renormalises that distribution over the top-k / top-p survivors, which a trainer computing
the full softmax does not reproduce; keep top_k=-1, top_p=1 (the defaults) for RL.

Weight versions come from the server: each answer carries `weight_versions` spans over its
output tokens, so a request that straddles an update is tagged token by token.

Weight updates from disk: a reload that fails inside vLLM leaves the model's parameters on the
meta device and the next decoding step kills the engine. So the directory is checked here
(config.json + *.safetensors) before the server sees it, the reload happens while generation is
paused, and if vLLM still fails the previous good weights are reloaded before generation resumes.
The check assumes the client and the servers share the filesystem, as disk updates do anyway.

Usage:
    engine = RemoteVLLMEngine(RolloutConfig(consumer_batch_size=8))
    engine.initialize(["127.0.0.1:8000"])              # or rollout.server_addrs / env
    resp = await engine.agenerate(ModelRequest(input_ids=ids, gconfig=gconfig))
    engine.update_weights(WeightUpdateMeta.from_disk(hf_dir, version=1)).result()
    engine.destroy()
"""

from __future__ import annotations

import glob
import os
import uuid
from concurrent.futures import Future
from typing import Any

from arealite.api.cli_args import RolloutConfig
from arealite.api.io_struct import ModelRequest, WeightUpdateMeta
from arealite.inference.remote_base import GenerateChunk, RemoteInferenceEngine
from arealite.inference.server_http import ServerError, token_versions

GENERATE_PATH = "/inference/v1/generate"
_FINISH_TYPES = ("stop", "length", "abort")


def check_weights_dir(path: str | None) -> str:
    """The absolute path of an HF weights directory vLLM can reload, or ValueError naming what
    is missing (a failed reload would break the server, so never send it a bad path)."""
    if not path:
        raise ValueError("weight update from disk needs a path (WeightUpdateMeta.path)")
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"weight update from disk: {path} is not a directory")
    missing = [
        what
        for what, ok in (
            ("config.json", os.path.isfile(os.path.join(path, "config.json"))),
            ("*.safetensors", bool(glob.glob(os.path.join(path, "*.safetensors")))),
        )
        if not ok
    ]
    if missing:
        raise ValueError(
            f"weight update from disk: {path} has no {' and no '.join(missing)} "
            "(vLLM reloads HF safetensors checkpoints: save_pretrained(..., safe_serialization=True))"
        )
    return path


class RemoteVLLMEngine(RemoteInferenceEngine):
    """Client of one or more vLLM servers (`vllm.entrypoints.openai.api_server`)."""

    health_path = "/health"

    def __init__(self, config: RolloutConfig):
        super().__init__(config)
        self._good_weights: dict[str, str] = {}  # addr -> last weights dir it loaded

    # ---- generation --------------------------------------------------------------------------

    def build_generate_payload(
        self, req: ModelRequest, input_ids: list[int], max_new_tokens: int, min_new_tokens: int
    ) -> tuple[str, dict[str, Any]]:
        if req.image_data:
            raise ValueError(
                f"ModelRequest {req.rid}: RemoteVLLMEngine sends token ids only and does not "
                "support image_data; use RemoteSGLangEngine for vision-language models"
            )
        g = req.gconfig
        greedy = g.greedy or g.temperature == 0
        params = {
            "max_tokens": max_new_tokens,
            "min_tokens": min_new_tokens,
            "temperature": 0.0 if greedy else g.temperature,
            "top_p": 1.0 if greedy else g.top_p,
            "top_k": -1 if greedy else g.top_k,
            "stop_token_ids": list(g.stop_token_ids),
            "ignore_eos": g.ignore_eos,
            "logprobs": 0,  # the sampled token's logprob only
            "n": 1,
            "detokenize": False,  # token ids out; text would only cost server CPU
        }
        if g.seed is not None and not greedy:
            params["seed"] = g.seed
        # A fresh id per call: a resubmission must not collide with the aborted call it follows.
        rid = f"{req.rid}-{uuid.uuid4().hex[:8]}"
        return GENERATE_PATH, {"request_id": rid, "token_ids": input_ids, "sampling_params": params}

    def parse_generate_response(self, body: Any) -> GenerateChunk:
        choices = body.get("choices") if isinstance(body, dict) else None
        if not choices or not isinstance(choices[0], dict):
            raise ValueError(f"{GENERATE_PATH} answer without choices: {str(body)[:300]}")
        c = choices[0]
        finish = c.get("finish_reason")
        if finish not in _FINISH_TYPES:
            raise ValueError(f"{GENERATE_PATH} answer with unknown finish_reason {finish!r}")
        tokens = [int(t) for t in c.get("token_ids") or []]
        content = (c.get("logprobs") or {}).get("content") or []
        logprobs = [float(e["logprob"]) for e in content]
        if len(tokens) != len(logprobs):
            raise ValueError(
                f"{GENERATE_PATH} answer has {len(tokens)} token_ids but {len(logprobs)} "
                "logprobs (is the server a vLLM with the token-in/token-out endpoint?)"
            )
        versions = token_versions(c.get("weight_versions"), len(tokens))
        return GenerateChunk(tokens, logprobs, finish, None, versions)

    # ---- pause / resume ----------------------------------------------------------------------

    async def pause_server(self, addr: str) -> None:
        # mode=abort: in-flight requests return at once with what they have (finish "abort");
        # mode=keep (pause_mode in_place): they stay frozen, KV caches kept, until /resume.
        # Requests arriving while paused are queued by vLLM until /resume.
        mode = "keep" if self.config.pause_mode == "in_place" else "abort"
        await self.pool.call(addr, "POST", f"/pause?mode={mode}")

    async def continue_server(self, addr: str) -> None:
        await self.pool.call(addr, "POST", "/resume")

    # ---- weight update from disk -------------------------------------------------------------

    def update_weights(self, meta: WeightUpdateMeta) -> Future:
        """As the base class, but a bad weights directory fails at once, before any server is
        paused (in-flight requests are not aborted for nothing)."""
        if meta.type == "disk":
            try:
                check_weights_dir(meta.path)
            except ValueError as e:
                failed: Future = Future()
                failed.set_exception(e)
                return failed
        return super().update_weights(meta)

    async def update_server_from_disk(self, addr: str, meta: WeightUpdateMeta) -> None:
        """Called while `addr` is paused: reload, drop KV computed by the old weights, tag the
        version. On failure, reload the previous good weights and raise with vLLM's reason."""
        path = check_weights_dir(meta.path)
        try:
            await self._reload_weights(addr, path)
        except ServerError as e:
            await self._restore_weights(addr, path, e)  # always raises
        # reload_weights keeps the prefix cache: prompts sharing a prefix would reuse old KV.
        await self.pool.call(addr, "POST", "/reset_prefix_cache")
        payload = {"new_version": str(meta.version)}  # vLLM wants a string
        await self.pool.call(addr, "POST", "/update_weight_version", payload)
        self._good_weights[addr] = path

    async def _reload_weights(self, addr: str, path: str) -> None:
        # No retries: a failed reload is deterministic, and retrying repeats the damage.
        payload = {"method": "reload_weights", "kwargs": {"weights_path": path}}
        await self.http.call(addr, "POST", "/collective_rpc", payload)

    async def _restore_weights(self, addr: str, bad_path: str, error: ServerError) -> None:
        reason = f"vLLM at {addr} failed to reload weights from {bad_path}: {error.message}"
        which = "previous" if addr in self._good_weights else "launch"
        try:
            previous = self._good_weights.get(addr) or await self._launch_weights(addr)
            await self._reload_weights(addr, previous)
            await self.pool.call(addr, "POST", "/reset_prefix_cache")
        except Exception as e:
            # Its parameters are gone: the next decoding step would kill its engine.
            self.pool.mark_failed(addr, f"{reason}; restoring the previous weights failed: {e}")
            raise RuntimeError(
                f"{reason}; restoring the previous weights failed too ({e}); "
                "the server left the rotation"
            ) from error
        raise RuntimeError(f"{reason}; restored the {which} weights from {previous}") from error

    async def _launch_weights(self, addr: str) -> str:
        """The model directory the server was started with (/v1/models keeps the launch path):
        what it holds unless another client updated it, which this client cannot see."""
        body = await self.pool.call(addr, "GET", "/v1/models")
        model = (body.get("data") or [{}])[0] if isinstance(body, dict) else {}
        path = model.get("root") or model.get("id")
        if not path or not os.path.isdir(path):
            raise ValueError(f"launch model {path!r} from /v1/models is not a local directory")
        return path
