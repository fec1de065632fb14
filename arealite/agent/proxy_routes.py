"""HTTP routes of the AgentProxy (kept apart from its session bookkeeping).

POST /v1/sessions                         {"wait": s} -> {session_id, base_url, api_key, data}
POST /sessions/{id}/v1/chat/completions   OpenAI chat completions (stream too)
GET  /sessions/{id}/v1/models
POST /sessions/{id}/v1/reward             {"reward": r, "completion_id"?, "choice_index"?}
POST /sessions/{id}/v1/end                {"reward"?: final reward} -> {status, samples}
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import math
from typing import Any, Protocol

from aiohttp import web

from arealite.openai_wire.request import ChatRequestError
from arealite.openai_wire.response import error_body, sse_event

logger = logging.getLogger("arealite.agent")


class SessionHost(Protocol):
    """What the routes need of the AgentProxy (its sessions); a Protocol, so this module never
    imports its owner."""

    api_key: str | None
    stats: Any  # a Counter of session events

    @property
    def url(self) -> str: ...
    async def claim(self, wait: float) -> Any: ...
    def session(self, sid: str, authorization: str) -> Any: ...
    def end(self, s: Any) -> tuple[int, str]: ...


def _error(status: int, message: str, param: str | None = None) -> web.Response:
    return web.json_response(error_body(message, param), status=status)


async def _json(request: web.Request) -> dict[str, Any]:
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ChatRequestError("body", f"not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise ChatRequestError("body", "expected a JSON object")
    return body


def _reward(body: dict, required: bool) -> float | None:
    r = body.get("reward")
    if r is None and not required:
        return None
    if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r):
        raise ChatRequestError("reward", f"expected a finite number, got {json.dumps(r)[:40]}")
    return float(r)


@web.middleware
async def _errors(request: web.Request, handler):
    """Client mistakes are OpenAI-shaped 4xx; nothing a client sends stops the proxy."""
    try:
        return await handler(request)
    except ChatRequestError as e:
        return _error(400, str(e), e.param)
    except KeyError as e:  # unknown completion id in /reward
        return _error(404, str(e.args[0]) if e.args else "not found", "completion_id")
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return _error(e.status, e.reason)
    except asyncio.CancelledError:
        raise
    except Exception as e:
        logger.exception("agent proxy: %s %s failed", request.method, request.path)
        return _error(502, f"generation failed: {type(e).__name__}: {e}", None)


class ProxyRoutes:
    """The proxy's HTTP handlers over its sessions (one method a route)."""

    def __init__(self, proxy: SessionHost):
        self.proxy = proxy

    def session(self, request: web.Request):
        return self.proxy.session(
            request.match_info["sid"], request.headers.get("Authorization", "")
        )

    async def start_session(self, request: web.Request) -> web.Response:
        if self.proxy.api_key and not hmac.compare_digest(
            request.headers.get("Authorization", "").encode(),
            f"Bearer {self.proxy.api_key}".encode(),
        ):
            return _error(401, "wrong or missing proxy key (Bearer <api_key>)")
        wait = (await _json(request)).get("wait", 30)
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait <= 3600:
            raise ChatRequestError("wait", "seconds to wait for a task, in [0, 3600]")
        s = await self.proxy.claim(float(wait))
        if s is None:
            return web.Response(status=204)
        base = f"{self.proxy.url}/sessions/{s.id}/v1"
        return web.json_response(
            {"session_id": s.id, "base_url": base, "api_key": s.key, "data": s.task.data}
        )

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """A retried request (the SDK's `x-stainless-retry-count` > 0, or an `Idempotency-Key`
        seen before) with the same body gets the recorded answer: the first attempt's answer
        may have been lost with the connection, and a second generation would be a second
        branch (an extra training row) of the session."""
        s = self.session(request)
        raw = await request.read()
        body = await _json(request)
        idem = request.headers.get("Idempotency-Key")
        key = "idem:" + idem if idem else hashlib.sha256(raw).hexdigest()
        retried = idem or request.headers.get("x-stainless-retry-count", "0") not in ("", "0")
        recorded = s.replies.get(key) if retried else None
        if recorded is None:
            result = await s.client.create_chat_completion(**body)
            if body.get("stream"):
                recorded = [c.model_dump(exclude_unset=True) async for c in result]
            else:
                recorded = result.model_dump(exclude_unset=True)
            s.replies[key] = recorded
        else:
            self.proxy.stats["retries_replayed"] += 1
        if not isinstance(recorded, list):
            return web.json_response(recorded)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for chunk in recorded:
            await resp.write(sse_event(chunk))
        await resp.write(sse_event("[DONE]"))
        await resp.write_eof()
        return resp

    async def models(self, request: web.Request) -> web.Response:
        s = self.session(request)
        card = {"id": s.client.model_name, "object": "model", "created": 0, "owned_by": "arealite"}
        return web.json_response({"object": "list", "data": [card]})

    async def set_reward(self, request: web.Request) -> web.Response:
        s = self.session(request)
        body = await _json(request)
        reward = _reward(body, required=True)
        if body.get("completion_id") is None:
            if len(s.client.tree) == 0:
                raise ChatRequestError("reward", "the session made no chat completion to reward")
            s.client.set_final_reward(reward)
        else:
            s.client.set_reward(
                str(body["completion_id"]), reward, int(body.get("choice_index", 0))
            )
        s.rewarded = True
        return web.json_response({"ok": True})

    async def end(self, request: web.Request) -> web.Response:
        s = self.session(request)
        reward = _reward(await _json(request), required=False)
        if reward is not None:
            if len(s.client.tree) == 0:
                raise ChatRequestError("reward", "the session made no chat completion to reward")
            s.client.set_final_reward(reward)
            s.rewarded = True
        samples, status = self.proxy.end(s)
        if status == "already ended":
            return _error(409, f"session {s.id} already ended")
        return web.json_response({"status": status, "samples": samples})


def add_routes(app: web.Application, proxy: SessionHost) -> None:
    app.middlewares.append(_errors)
    routes = ProxyRoutes(proxy)
    app.router.add_post("/v1/sessions", routes.start_session)
    app.router.add_post("/sessions/{sid}/v1/chat/completions", routes.chat_completions)
    app.router.add_get("/sessions/{sid}/v1/models", routes.models)
    app.router.add_post("/sessions/{sid}/v1/reward", routes.set_reward)
    app.router.add_post("/sessions/{sid}/v1/end", routes.end)
