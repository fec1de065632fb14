"""aiohttp front end speaking the SGLang-native subset (docs/design.md, "Inference server wire protocol").

Handlers validate, enqueue into the Scheduler and await its futures; the model never runs on the
event loop. Every error is a JSON body with an "error" field naming the problem.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import time
from dataclasses import dataclass, field

from aiohttp import web

from arealite.server.model_runner import ModelRunner, Sequence
from arealite.server.openai_api import OpenAIChatAPI
from arealite.server.protocol import (
    BadRequest,
    decode_json_body,
    parse_generate_body,
    parse_weight_version,
)
from arealite.server.scheduler import Scheduler
from arealite.server.sglang_schema import parse_body
from arealite.server.weight_guard import (
    VersionGate,
    WeightRefused,
    parse_fencing_token,
    resolve_weight_dir,
)
from arealite.server.weight_sync import (
    Unsupported,
    WeightGroups,
    load_tensor_payload,
    parse_group_spec,
    parse_tensor_specs,
)
from arealite.utils.tensor_handles import RefusedPayload

logger = logging.getLogger("arealite.server")

PUBLIC_PATHS = frozenset({"/health"})
POST_ROUTES = (
    "generate",
    "pause_generation",
    "continue_generation",
    "abort_request",
    "update_weights_from_disk",
    "init_weights_update_group",
    "update_weights_from_distributed",
    "update_weights_from_tensor",
    "destroy_weights_update_group",
    "flush_cache",
)
GET_ROUTES = ("health", "get_model_info", "get_server_info", "get_weight_version", "metrics")


@dataclass
class ServerOptions:
    model_path: str
    api_key: str | None = None
    allowed_weight_roots: list[str] = field(default_factory=list)
    max_batch_size: int = 64


async def load_bucket(scheduler, job, version: int | None, what: str) -> web.Response:
    """Run `job` (load one bucket of weights) between batches; tag `version` after it, if
    given. A failure is a 400 naming `what`."""

    def load() -> str:
        message = job()
        if version is not None:
            scheduler.set_weight_version(version)
        return message

    try:
        message = await asyncio.wrap_future(scheduler.run_exclusive(load))
    except Exception as e:
        msg = f"{what}: {e}" if isinstance(e, RefusedPayload) else f"{what} failed: {e}"
        return web.json_response({"success": False, "message": msg, "error": msg}, status=400)
    return web.json_response(
        {"success": True, "message": message, "weight_version": scheduler.weight_version}
    )


def _error(status: int, message: str, **extra) -> web.Response:
    return web.json_response({"error": message, **extra}, status=status)


@web.middleware
async def _errors_as_json(request: web.Request, handler):
    """Turn client mistakes into 400 and anything unexpected into 500; never drop the server."""
    try:
        return await handler(request)
    except BadRequest as e:
        return _error(400, str(e))
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return _error(e.status, f"{e.reason}: {request.method} {request.path}")
    except asyncio.CancelledError:
        raise
    except Exception as e:
        logger.exception("unhandled error in %s %s", request.method, request.path)
        return _error(500, f"internal error: {type(e).__name__}: {e}")


def _auth_middleware(api_key: str):
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def check(request: web.Request, handler):
        if request.path not in PUBLIC_PATHS:
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                return _error(
                    401, "unauthorized: missing or wrong 'Authorization: Bearer <api key>'"
                )
        return await handler(request)

    return check


class InferenceServer:
    """Routes + the shared state they need (runner for metadata, scheduler for everything else)."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, options: ServerOptions):
        self.runner = runner
        self.scheduler = scheduler
        self.options = options
        # A standalone server loads only from its own model's folder unless told otherwise.
        roots = options.allowed_weight_roots or [options.model_path]
        self.allowed_roots = [os.path.realpath(r) for r in roots]
        self.version_gate = VersionGate()
        self.weight_groups = WeightGroups(runner.device)

    def build_app(self) -> web.Application:
        middlewares = [_errors_as_json]
        if self.options.api_key:
            middlewares.insert(0, _auth_middleware(self.options.api_key))
        app = web.Application(middlewares=middlewares, client_max_size=256 * 1024**2)
        for path in POST_ROUTES:  # SGLang's native paths, each served by the method of its name
            app.router.add_post(f"/{path}", getattr(self, path))
        for path in GET_ROUTES:
            app.router.add_get(f"/{path}", getattr(self, path))
        app.router.add_get("/health_generate", self.health)
        OpenAIChatAPI(self.runner, self.scheduler, self.options.model_path).register(app)
        return app

    # ---- generation -------------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.Response:
        """One prompt, or SGLang's batch form (a list of prompts, answered with a list): a
        batch is admitted together, so a group of samples of one prompt is prefilled once."""
        reqs, batched = parse_generate_body(
            decode_json_body(await request.read()),
            vocab_size=self.runner.vocab_size,
            max_positions=self.runner.max_positions,
            accepts_images=self.runner.accepts_images,
        )
        seqs = [await self._new_sequence(req) for req in reqs]
        work = []
        for seq in seqs:
            if seq.req.params.max_new_tokens > 0:
                work.append(seq)
            else:  # nothing to generate: answered as finished by length, at the current weights
                seq.finish_reason = {"type": "length", "length": 0}
                seq.weight_version = self.scheduler.weight_version
        futures = self.scheduler.submit_many(work)
        try:  # each future resolves to its own sequence, filled in
            await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
        except asyncio.CancelledError:  # client went away: free its batch slots
            for seq in work:
                self.scheduler.abort_sequence(seq)
            raise
        answers = [self._generate_response(s) for s in seqs]
        return web.json_response(answers if batched else answers[0])

    async def _new_sequence(self, req) -> Sequence:
        if req.image_data:  # image decoding / preprocessing is CPU work: keep it off the loop
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(None, self.runner.new_sequence, req)
        return self.runner.new_sequence(req)

    def _generate_response(self, seq: Sequence) -> dict:
        req = seq.req
        meta = {
            "id": req.rid,
            "finish_reason": seq.finish_reason,
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": len(seq.output_ids),
            "cached_tokens": 0,
            "weight_version": seq.weight_version,
            "e2e_latency": time.monotonic() - seq.arrival,
        }
        if spans := seq.version_spans():  # weights updated under it (in-place pause)
            meta["weight_versions"] = spans
        if req.return_logprob:
            meta["output_token_logprobs"] = [
                [lp, t, None] for lp, t in zip(seq.output_logprobs, seq.output_ids)
            ]
        text = self.runner.tokenizer.decode(
            seq.output_ids, skip_special_tokens=req.params.skip_special_tokens
        )
        return {"text": text, "output_ids": seq.output_ids, "meta_info": meta}

    async def pause_generation(self, request: web.Request) -> web.Response:
        """SGLang's modes: `abort` (default) ends in-flight requests with what they have;
        `in_place` freezes them, KV caches kept, until continue_generation (`retract` is not
        supported: it would need KV-cache offload)."""
        mode = parse_body("pause_generation", await request.read()).get("mode")
        if mode not in (None, "abort", "retract", "in_place"):
            raise BadRequest(f"mode: expected 'abort', 'retract' or 'in_place', got {mode!r}")
        if mode == "retract":
            raise BadRequest("mode: 'retract' is not supported by the embedded server")
        await asyncio.wrap_future(self.scheduler.pause(in_place=mode == "in_place"))
        return web.json_response(
            {"success": True, "message": f"generation paused ({mode or 'abort'})"}
        )

    async def continue_generation(self, request: web.Request) -> web.Response:
        parse_body("continue_generation", await request.read())
        self.scheduler.resume()
        return web.json_response({"success": True, "message": "generation continued"})

    async def abort_request(self, request: web.Request) -> web.Response:
        body = parse_body("abort_request", await request.read())
        rid, abort_all = body.get("rid"), body.get("abort_all", False)
        if not abort_all and not (isinstance(rid, str) and rid):
            raise BadRequest("rid: required (a request id string) unless abort_all is true")
        self.scheduler.abort(None if abort_all else rid)
        return web.json_response({"success": True})

    # ---- weights ----------------------------------------------------------------------------
    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = parse_body("update_weights_from_disk", await request.read())
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            raise BadRequest("model_path: required (a directory with the new weights)")
        version = parse_weight_version(body.get("weight_version"), self.scheduler.weight_version)
        token = parse_fencing_token(body.get("fencing_token"))
        try:  # roots and versions are checked before anything is read or paused
            real = resolve_weight_dir(path, self.allowed_roots)
            self.version_gate.check(token, version, self.scheduler.weight_version)
        except WeightRefused as e:
            return self._refused(e)
        if body.get("abort_all_requests"):
            self.scheduler.abort(None)

        def job() -> str:  # exclusive: concurrent updates are checked again in order
            self.version_gate.check(token, version, self.scheduler.weight_version)
            message = self.runner.load_weights_from_disk(real)
            self.version_gate.accept(token)
            self.scheduler.set_weight_version(version)
            return message

        start = time.monotonic()
        try:
            message = await asyncio.wrap_future(self.scheduler.run_exclusive(job))
        except WeightRefused as e:
            return self._refused(e)
        except Exception as e:
            msg = f"model_path: failed to load weights from {path}: {e}"
            return web.json_response({"success": False, "message": msg, "error": msg}, status=400)
        logger.info(
            "weights updated to version %s in %.2fs: %s", version, time.monotonic() - start, message
        )
        return web.json_response({"success": True, "message": message, "weight_version": version})

    def _refused(self, e: WeightRefused) -> web.Response:
        logger.warning("%s", e.message)
        body = {"success": False, "message": e.message, "error": e.message, **e.detail}
        return web.json_response(body, status=e.status)

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        spec = parse_group_spec(parse_body("init_weights_update_group", await request.read()))
        try:
            self.weight_groups.check_backend(spec)
        except Unsupported as e:
            return web.json_response(
                {"success": False, "message": str(e), "error": str(e)}, status=501
            )
        loop = asyncio.get_running_loop()
        message = await loop.run_in_executor(None, self.weight_groups.join, spec)
        logger.info("%s", message)
        return web.json_response({"success": True, "message": message})

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        """Receive one bucket by broadcast; the version moves when the request carries one
        (the trainer sends it with the last bucket). Pause generation around a multi-bucket push."""
        body = parse_body("update_weights_from_distributed", await request.read())
        specs = parse_tensor_specs(body)
        group = self.weight_groups.get(body.get("group_name") or "weight_update_group")
        version = body.get("weight_version")
        version = None if version is None else parse_weight_version(version, 0)
        if body.get("abort_all_requests"):
            self.scheduler.abort(None)

        def job() -> str:
            return self.runner.load_named_tensors(self.weight_groups.receive(group, specs))

        return await load_bucket(self.scheduler, job, version, "update_weights_from_distributed")

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        """One bucket as tensor handles from a trainer on this GPU (a payload per TP rank: one
        here); the version moves when the request carries one (the trainer's last bucket)."""
        body = parse_body("update_weights_from_tensor", await request.read())
        payloads = body["serialized_named_tensors"]
        if len(payloads) != 1:
            raise BadRequest(
                "serialized_named_tensors: one payload per tensor-parallel rank; this server "
                f"has 1, got {len(payloads)}"
            )
        version = body.get("weight_version")
        version = None if version is None else parse_weight_version(version, 0)
        if body.get("abort_all_requests"):
            self.scheduler.abort(None)

        def job() -> str:
            return load_tensor_payload(self.runner, payloads[0])

        return await load_bucket(self.scheduler, job, version, "serialized_named_tensors")

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        body = parse_body("destroy_weights_update_group", await request.read())
        self.weight_groups.destroy(body.get("group_name") or "weight_update_group")
        return web.json_response({"success": True, "message": "group destroyed"})

    # ---- introspection ----------------------------------------------------------------------
    async def flush_cache(self, request: web.Request) -> web.Response:
        return web.json_response({"success": True, "message": "no prefix cache to flush"})

    async def health(self, request: web.Request) -> web.Response:
        if not self.scheduler.is_alive():
            return _error(503, "scheduler thread is not running")
        return web.Response(text="OK")

    async def get_model_info(self, request: web.Request) -> web.Response:
        r = self.runner
        return web.json_response(
            {
                "model_path": self.options.model_path,
                "tokenizer_path": self.options.model_path,
                "is_generation": True,
                "weight_version": self.scheduler.weight_version,
                "dtype": str(r.dtype).removeprefix("torch."),
                "device": str(r.device),
                "vocab_size": r.vocab_size,
                "max_position_embeddings": r.max_positions,
                "max_batch_size": self.options.max_batch_size,
                "eos_token_ids": sorted(r.eos_ids),
                "is_multimodal": r.accepts_images,
                "paused": self.scheduler.paused,
                "server": "arealite-embedded",
            }
        )

    async def get_server_info(self, request: web.Request) -> web.Response:
        info = {"tp_size": 1, "dp_size": 1, "max_running_requests": self.options.max_batch_size}
        return web.json_response(
            {**info, "model_path": self.options.model_path, "version": "arealite"}
        )

    async def get_weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.scheduler.weight_version})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            text=self.scheduler.metrics.render(), content_type="text/plain", charset="utf-8"
        )
