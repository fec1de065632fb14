"""RemoteSGLangEngine: the InferenceEngine over SGLang's native HTTP API.

Works unchanged against a real SGLang server and against the embedded server
(`python -m arealite.server`), which speaks the same subset (docs/design.md, wire protocol).
All shared machinery (routing, retries, fail-over, interruptible generation, the weight-update
choreography) lives in `RemoteInferenceEngine`; this file only says how SGLang spells each call.

Usage:
    engine = RemoteSGLangEngine(RolloutConfig(consumer_batch_size=8))
    engine.initialize(["127.0.0.1:30000"])            # or rollout.server_addrs / env
    resp = await engine.agenerate(ModelRequest(input_ids=ids, gconfig=gconfig))
    executor = WorkflowExecutor(config, engine)       # arealite.rollout: episodes, staleness
    engine.update_weights(WeightUpdateMeta.from_disk(path, version=1)).result()
    engine.destroy()
"""

from __future__ import annotations

from typing import Any

from arealite.api.io_struct import ModelRequest, ParamSpec, WeightUpdateMeta
from arealite.inference.remote_base import GenerateChunk, RemoteInferenceEngine
from arealite.inference.server_http import ServerError, parse_version, token_versions
from arealite.lifecycle.run_lock import fencing_token

_FINISH_TYPES = ("stop", "length", "abort")


class RemoteSGLangEngine(RemoteInferenceEngine):
    """Client of one or more SGLang (or embedded arealite) servers."""

    health_path = "/health"
    batch_generate = True

    def build_generate_payload(
        self, req: ModelRequest, input_ids: list[int], max_new_tokens: int, min_new_tokens: int
    ) -> tuple[str, dict[str, Any]]:
        params = req.gconfig.to_sampling_params()
        params["max_new_tokens"] = max_new_tokens
        params["min_new_tokens"] = min_new_tokens
        payload: dict[str, Any] = {
            "rid": req.rid,
            "input_ids": input_ids,
            "sampling_params": params,
            "return_logprob": True,
        }
        if req.image_data:
            payload["image_data"] = req.image_data
        return "/generate", payload

    def build_batch_payload(
        self, calls: list[tuple[ModelRequest, list[int], int, int]]
    ) -> tuple[str, dict[str, Any]]:
        """SGLang's batch form: a list of prompts with a list of rids, sampling params (each
        request keeps its own seed and budget) and image lists; answered with a list."""
        items = [self.build_generate_payload(*call)[1] for call in calls]
        payload: dict[str, Any] = {
            key: [item[key] for item in items] for key in ("rid", "input_ids", "sampling_params")
        }
        payload["return_logprob"] = True
        if any("image_data" in item for item in items):
            payload["image_data"] = [item.get("image_data", []) for item in items]
        return "/generate", payload

    def parse_generate_response(self, body: Any) -> GenerateChunk:
        if not isinstance(body, dict) or not isinstance(body.get("meta_info"), dict):
            raise ValueError(f"/generate answer without meta_info: {str(body)[:300]}")
        meta = body["meta_info"]
        finish = meta.get("finish_reason") or {}
        kind = finish.get("type") if isinstance(finish, dict) else str(finish)
        if kind not in _FINISH_TYPES:
            raise ValueError(f"/generate answer with unknown finish_reason {finish!r}")
        entries = meta.get("output_token_logprobs") or []
        logprobs = [float(e[0]) for e in entries]
        tokens = body.get("output_ids")
        tokens = [int(e[1]) for e in entries] if tokens is None else [int(t) for t in tokens]
        if len(tokens) != len(logprobs):
            raise ValueError(
                f"/generate answer has {len(tokens)} output_ids but {len(logprobs)} logprobs"
            )
        version = parse_version(meta.get("weight_version"))
        # Spans where the weights changed under the request (the embedded server's in-place
        # pause); a server without them labels every token with the answer's version.
        versions = token_versions(meta.get("weight_versions"), len(tokens))
        return GenerateChunk(tokens, logprobs, kind, version, versions)

    # SGLang (after v0.5.5) declares request models for both: a POST without a JSON body is a
    # 400. mode "abort": in-flight requests come back aborted (and are resubmitted after);
    # "in_place" (pause_mode in_place): they stay, KV caches kept, and go on after the update.
    async def pause_server(self, addr: str) -> None:
        body = {"mode": self.config.pause_mode}
        await self.pool.call(addr, "POST", "/pause_generation", body)

    async def continue_server(self, addr: str) -> None:
        await self.pool.call(addr, "POST", "/continue_generation", {})

    async def update_server_from_disk(self, addr: str, meta: WeightUpdateMeta) -> None:
        payload = {"model_path": meta.path, "weight_version": str(meta.version)}
        token = fencing_token()  # the run's owner: servers refuse updates from an older one
        if token is not None:
            payload["fencing_token"] = token
        body = await self.pool.call(addr, "POST", "/update_weights_from_disk", payload)
        _check_success(addr, "/update_weights_from_disk", body)

    # ---- NCCL path (GPU; SGLang's update_weights_from_distributed API) --------------------

    async def server_tp_size(self, addr: str) -> int:
        """The server's tensor-parallel size: its number of ranks in the weight-update group.
        Never guessed: a wrong group size hangs every member of the group."""
        try:
            info = await self.pool.call(addr, "GET", "/get_server_info")
        except ServerError as e:
            raise RuntimeError(
                f"server {addr}: GET /get_server_info failed ({e}); the distributed weight "
                "update needs each server's tp_size to size its group (use weight_update: disk "
                "for servers without the endpoint)"
            ) from e
        tp = info.get("tp_size") if isinstance(info, dict) else None
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise RuntimeError(
                f"server {addr}: /get_server_info has no valid tp_size ({str(info)[:200]}); "
                "cannot size the weight-update group"
            )
        return tp

    async def init_weights_group(
        self, addr: str, meta: WeightUpdateMeta, rank_offset: int, world_size: int
    ) -> None:
        payload = {
            "master_address": meta.nccl_master_address,
            "master_port": meta.nccl_master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": meta.nccl_group_name,
            "backend": meta.nccl_backend,
        }
        body = await self.pool.call(addr, "POST", "/init_weights_update_group", payload)
        _check_success(addr, "/init_weights_update_group", body)

    async def update_server_from_distributed(
        self,
        addr: str,
        meta: WeightUpdateMeta,
        bucket: list[ParamSpec],
        last: bool,
    ) -> None:
        payload = {
            "names": [p.name for p in bucket],
            "shapes": [p.shape for p in bucket],
            "dtypes": [p.dtype for p in bucket],
            "group_name": meta.nccl_group_name,
            "flush_cache": last,
        }
        if last:
            payload["weight_version"] = str(meta.version)
        body = await self.pool.call(addr, "POST", "/update_weights_from_distributed", payload)
        _check_success(addr, "/update_weights_from_distributed", body)

    async def update_server_from_tensor(
        self, addr: str, meta: WeightUpdateMeta, payload: str, last: bool
    ) -> None:
        """One bucket of tensor handles (SGLang's /update_weights_from_tensor: one payload per
        TP rank; the servers this runs with share the trainer's GPU, TP 1)."""
        body = {"serialized_named_tensors": [payload], "flush_cache": last}
        if last:
            body["weight_version"] = str(meta.version)
        out = await self.pool.call(addr, "POST", "/update_weights_from_tensor", body)
        _check_success(addr, "/update_weights_from_tensor", out)


def _check_success(addr: str, path: str, body: Any) -> None:
    if isinstance(body, dict) and body.get("success") is False:
        raise ServerError(addr, path, 200, str(body.get("message") or body))
