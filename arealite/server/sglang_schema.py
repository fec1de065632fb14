"""SGLang's request models for the native control routes the embedded server serves.

SGLang's FastAPI handlers take a request model for each of these routes, so a request without
a JSON body is refused there with 400 ("Field required"); clients written against the embedded
server must fail the same way here, not first on a real SGLang. The fields, their types and
which are required follow SGLang's `python/sglang/srt/managers/io_struct.py` (`BaseReq`
msgspec structs) and `entrypoints/http_server.py` on its main branch as read in November 2026
(newer than v0.5.5, the last release whose /pause_generation and /continue_generation took no
body). Unknown fields are ignored, as SGLang's models ignore them. /generate has its own, stricter
parser (protocol.py); /flush_cache takes no body in SGLang either.
"""

from __future__ import annotations

import json
from typing import Any

from arealite.server.protocol import BadRequest, decode_json_body

SGLANG_CHECKED_AGAINST = "sglang main (io_struct.py msgspec BaseReq), 2026-11, after v0.5.5"

_STR, _INT, _BOOL, _DICT = "a string", "an integer", "true or false", "a JSON object"
_STR_LIST, _SHAPES = "a list of strings", "a list of lists of integers"
_VERSION = "a string (arealite also takes an integer)"  # SGLang: Optional[str]

# route -> {field: (expected, required)}; rid / http_worker_ipc come from SGLang's BaseReq.
_BASE = {"rid": (_STR, False), "http_worker_ipc": (_STR, False)}
# Optional fields every weight-update route takes.
_UPDATE = {
    **_BASE,
    "load_format": (_STR, False),
    "flush_cache": (_BOOL, False),
    "abort_all_requests": (_BOOL, False),
    "weight_version": (_VERSION, False),
}
MODELS: dict[str, dict[str, tuple[str, bool]]] = {
    "pause_generation": {**_BASE, "mode": (_STR, False)},
    "continue_generation": {**_BASE, "torch_empty_cache": (_BOOL, False)},
    "abort_request": {
        **_BASE,
        "abort_all": (_BOOL, False),
        "finished_reason": (_DICT, False),
        "abort_message": (_STR, False),
    },
    "update_weights_from_disk": {
        **_UPDATE,
        "model_path": (_STR, True),
        "is_async": (_BOOL, False),
        "torch_empty_cache": (_BOOL, False),
        "keep_pause": (_BOOL, False),
        "recapture_cuda_graph": (_BOOL, False),
        "token_step": (_INT, False),
        "manifest": (_DICT, False),
    },
    "init_weights_update_group": {
        **_BASE,
        "master_address": (_STR, True),
        "master_port": (_INT, True),
        "rank_offset": (_INT, True),
        "world_size": (_INT, True),
        "group_name": (_STR, False),
        "backend": (_STR, False),
    },
    "update_weights_from_distributed": {
        **_UPDATE,
        "names": (_STR_LIST, True),
        "dtypes": (_STR_LIST, True),
        "shapes": (_SHAPES, True),
        "group_name": (_STR, False),
        "torch_empty_cache": (_BOOL, False),
    },
    "update_weights_from_tensor": {**_UPDATE, "serialized_named_tensors": (_STR_LIST, True)},
    "destroy_weights_update_group": {**_BASE, "group_name": (_STR, False)},
}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_CHECKS = {
    _STR: lambda v: isinstance(v, str),
    _INT: _is_int,
    _BOOL: lambda v: isinstance(v, bool),
    _DICT: lambda v: isinstance(v, dict),
    _STR_LIST: lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    _SHAPES: lambda v: (
        isinstance(v, list) and all(isinstance(s, list) and all(_is_int(d) for d in s) for s in v)
    ),
    _VERSION: lambda v: isinstance(v, str) or _is_int(v),
}


def parse_body(route: str, raw: bytes) -> dict:
    """The JSON object body of POST /`route`, checked against SGLang's model for it: present,
    an object, every required field there, every known field of its type (null = unset)."""
    if not raw.strip():
        raise BadRequest(
            f"body: required; /{route} takes a JSON object (SGLang declares a request model for "
            "it and answers 400 without one): send at least {}"
        )
    body = decode_json_body(raw)
    if not isinstance(body, dict):
        raise BadRequest(f"body: expected a JSON object, got {type(body).__name__}")
    for name, (expected, required) in MODELS[route].items():
        value = body.get(name)
        if value is None:
            if required:
                raise BadRequest(f"{name}: required field is missing (/{route})")
            continue
        if not _CHECKS[expected](value):
            raise BadRequest(f"{name}: expected {expected}, got {json.dumps(value)[:40]}")
    return body
