"""Request validation for the SGLang-native `/generate` subset (docs/design.md, wire protocol).

Validation lives apart from the HTTP layer so that every malformed request becomes one
`BadRequest` naming the offending field, and the scheduler only ever sees well-formed work.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default when the client sends none

# Fields we accept only at their neutral value: real SGLang clients may send them, and silently
# honouring a non-neutral value we do not implement would corrupt the rollout.
_NEUTRAL_SAMPLING = {
    "n": (1,),
    "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "stop": ("", ()),
    "json_schema": (),
    "regex": (),
    "ebnf": (),
}
_IGNORED_SAMPLING = {"no_stop_trim", "spaces_between_special_tokens"}
_NEUTRAL_TOP = {
    "stream": (False,),
    "top_logprobs_num": (0,),
    "return_text_in_logprobs": (False,),
    "lora_path": (),
    "text": (),
}
_IGNORED_TOP = {
    "logprob_start_len",
    "custom_logit_processor",
    "bootstrap_host",
    "data_parallel_rank",
}


class BadRequest(ValueError):
    """A client error: answered with HTTP 400 and {"error": str(exc)}."""


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0): whole vocabulary
    min_new_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # SGLang's `sampling_seed`: the draw at each position depends only on (seed, position), so
    # the same request (or its resubmission after an abort) samples the same tokens whatever
    # else shares the batch. None: the server's own generator.
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        """SGLang treats temperature ~0 and top_k == 1 as argmax decoding."""
        return self.temperature < 1e-6 or self.top_k == 1

    @property
    def logprob_temperature(self) -> float:
        """Temperature of the distribution the logprobs describe (1 for temperature-0 greedy)."""
        return 1.0 if self.temperature < 1e-6 else self.temperature


@dataclass
class GenerateRequest:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    # Base64 images / data URLs (SGLang's `image_data`), one per <|image_pad|> run, in order.
    image_data: list[str] = field(default_factory=list)


def decode_json_body(body: bytes) -> Any:
    """bytes -> JSON value, with errors that say what was wrong with the body."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRequest(f"body: not valid UTF-8 ({e.reason} at byte {e.start})") from None
    if not text.strip():
        raise BadRequest("body: empty; expected a JSON object")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise BadRequest(
            f"body: not valid JSON ({e.msg} at line {e.lineno} col {e.colno})"
        ) from None
    except RecursionError:
        raise BadRequest("body: JSON nested too deeply") from None


def require_object(value: Any, name: str = "body") -> dict:
    if not isinstance(value, dict):
        raise BadRequest(f"{name}: expected a JSON object, got {type(value).__name__}")
    return value


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _field(d: dict, key: str, default: Any, convert: Callable, expected: str, prefix: str):
    """`d[key]` through `convert` (which answers None for a value of the wrong type), or
    `default` when the key is absent or null; the one place a wrong type becomes a 400."""
    v = d.get(key)
    if v is None:
        return default
    out = convert(v)
    if out is None:
        raise BadRequest(f"{prefix}{key}: expected {expected}, got {json.dumps(v)[:40]}")
    return out


def _as_int(v: Any) -> int | None:
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v if _is_int(v) else None


def _as_finite_float(v: Any) -> float | None:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return None
    try:
        f = float(v)
    except OverflowError:  # an integer beyond float range
        return None
    return f if math.isfinite(f) else None


def _int(d: dict, key: str, default: int, *, low: int | None = None, prefix: str = "") -> int:
    v = _field(d, key, default, _as_int, "an integer", prefix)
    if low is not None and d.get(key) is not None and v < low:
        raise BadRequest(f"{prefix}{key}: must be >= {low}, got {v}")
    return v


def _float(d: dict, key: str, default: float, *, prefix: str = "") -> float:
    return _field(d, key, default, _as_finite_float, "a finite number", prefix)


def _bool(d: dict, key: str, default: bool, *, prefix: str = "") -> bool:
    return _field(
        d, key, default, lambda v: v if isinstance(v, bool) else None, "true or false", prefix
    )


def _token_ids(v: Any, name: str, vocab_size: int, *, allow_empty: bool) -> list[int]:
    if not isinstance(v, list):
        raise BadRequest(f"{name}: expected a list of token ids, got {type(v).__name__}")
    if not v and not allow_empty:
        raise BadRequest(f"{name}: must not be empty")
    for i, t in enumerate(v):
        if not _is_int(t):
            if isinstance(t, list):
                raise BadRequest(f"{name}[{i}]: a batch must be a list of prompts, each a list")
            raise BadRequest(f"{name}[{i}]: expected an integer token id, got {json.dumps(t)[:40]}")
        if not 0 <= t < vocab_size:
            raise BadRequest(
                f"{name}[{i}]: token id {t} is outside the vocabulary [0, {vocab_size})"
            )
    return v


def _check_extras(d: dict, known: set[str], neutral: dict, ignored: set[str], prefix: str) -> None:
    for key, value in d.items():
        if key in known or key in ignored or value is None:
            continue
        if key in neutral:
            if value in neutral[key] or value == []:
                continue
            raise BadRequest(
                f"{prefix}{key}: value {json.dumps(value)[:40]} is not supported by the embedded server"
            )
        raise BadRequest(f"{prefix}{key}: unknown field")


_SAMPLING_KEYS = {
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_new_tokens",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "sampling_seed",
}
_TOP_KEYS = {"rid", "input_ids", "sampling_params", "return_logprob", "image_data"}


def parse_sampling_params(
    sp: Any, *, prompt_len: int, vocab_size: int, max_positions: int
) -> SamplingParams:
    """Validate `sampling_params` the way SGLang does, plus the context-length bound."""
    p = "sampling_params."
    sp = require_object({} if sp is None else sp, "sampling_params")
    _check_extras(sp, _SAMPLING_KEYS, _NEUTRAL_SAMPLING, _IGNORED_SAMPLING, p)
    room = max_positions - prompt_len
    if room < 1:
        raise BadRequest(
            f"input_ids: prompt of {prompt_len} tokens leaves no room in the model's "
            f"max_position_embeddings={max_positions}"
        )
    max_new = _int(sp, "max_new_tokens", min(DEFAULT_MAX_NEW_TOKENS, room), low=0, prefix=p)
    if prompt_len + max_new > max_positions:
        raise BadRequest(
            f"{p}max_new_tokens: prompt ({prompt_len}) + max_new_tokens ({max_new}) exceeds "
            f"max_position_embeddings={max_positions}"
        )
    temperature = _float(sp, "temperature", 1.0, prefix=p)
    if temperature < 0:
        raise BadRequest(f"{p}temperature: must be >= 0, got {temperature}")
    top_p = _float(sp, "top_p", 1.0, prefix=p)
    if not 0 < top_p <= 1:
        raise BadRequest(f"{p}top_p: must be in (0, 1], got {top_p}")
    top_k = _int(sp, "top_k", -1, low=-1, prefix=p)
    min_new = _int(sp, "min_new_tokens", 0, low=0, prefix=p)
    if min_new > max_new:
        raise BadRequest(f"{p}min_new_tokens: {min_new} exceeds max_new_tokens {max_new}")
    stop = sp.get("stop_token_ids")
    stop_ids = (
        ()
        if stop is None
        else tuple(_token_ids(stop, f"{p}stop_token_ids", vocab_size, allow_empty=True))
    )
    return SamplingParams(
        max_new_tokens=max_new,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_new_tokens=min_new,
        stop_token_ids=stop_ids,
        ignore_eos=_bool(sp, "ignore_eos", False, prefix=p),
        skip_special_tokens=_bool(sp, "skip_special_tokens", True, prefix=p),
        seed=_seed(sp, p),
    )


def _seed(sp: dict, prefix: str) -> int | None:
    if sp.get("sampling_seed") is None:
        return None
    seed = _int(sp, "sampling_seed", 0, low=0, prefix=prefix)
    if seed >= 1 << 64:
        raise BadRequest(f"{prefix}sampling_seed: must be < 2**64, got {seed}")
    return seed


def parse_image_data(value: Any, accepts_images: bool) -> list[str]:
    """SGLang accepts one image or a list; we take base64 strings / data URLs only."""
    if value is None or value == [] or value == "":
        return []
    if not accepts_images:
        raise BadRequest("image_data: the served model is not a vision-language model")
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list):
        raise BadRequest(
            f"image_data: expected a list of base64 images, got {type(value).__name__}"
        )
    for i, item in enumerate(items):
        if not isinstance(item, str) or not item:
            raise BadRequest(
                f"image_data[{i}]: expected a base64 string or data URL, got {json.dumps(item)[:40]}"
            )
    return items


def parse_generate_request(
    body: Any, *, vocab_size: int, max_positions: int, accepts_images: bool = False
) -> GenerateRequest:
    """JSON body of POST /generate -> GenerateRequest, or BadRequest naming the field."""
    body = require_object(body)
    _check_extras(body, _TOP_KEYS, _NEUTRAL_TOP, _IGNORED_TOP, "")
    if "input_ids" not in body or body["input_ids"] is None:
        hint = (
            " ('text' input is not supported; tokenize on the client)" if body.get("text") else ""
        )
        raise BadRequest(f"input_ids: required field is missing{hint}")
    input_ids = _token_ids(body["input_ids"], "input_ids", vocab_size, allow_empty=False)
    rid = body.get("rid")
    if rid is None:
        rid = uuid.uuid4().hex
    elif not isinstance(rid, str) or not rid:
        raise BadRequest(f"rid: expected a non-empty string, got {json.dumps(rid)[:40]}")
    params = parse_sampling_params(
        body.get("sampling_params"),
        prompt_len=len(input_ids),
        vocab_size=vocab_size,
        max_positions=max_positions,
    )
    return GenerateRequest(
        rid=rid,
        input_ids=input_ids,
        params=params,
        return_logprob=_bool(body, "return_logprob", False),
        image_data=parse_image_data(body.get("image_data"), accepts_images),
    )


def _batch_field(body: dict, key: str, n: int, per_item_type: type | tuple) -> list[Any]:
    """SGLang's batch form: `key` is one value for every prompt, or a list of one per prompt."""
    v = body.get(key)
    if v == []:  # as if absent
        return [None] * n
    if isinstance(v, list) and (isinstance(v[0], per_item_type) or v[0] is None):
        if len(v) != n:
            raise BadRequest(f"{key}: {len(v)} values for a batch of {n} prompts")
        return v
    return [v] * n


def parse_generate_body(
    body: Any, *, vocab_size: int, max_positions: int, accepts_images: bool = False
) -> tuple[list[GenerateRequest], bool]:
    """POST /generate body -> (requests, batched). SGLang's batch form sends `input_ids` as a
    list of prompts, with `rid` / `sampling_params` / `return_logprob` / `image_data` either
    shared or one per prompt; it is answered with a list. Errors name the prompt's index."""
    body = require_object(body)
    ids = body.get("input_ids")
    if not (isinstance(ids, list) and ids and isinstance(ids[0], list)):
        one = parse_generate_request(
            body, vocab_size=vocab_size, max_positions=max_positions, accepts_images=accepts_images
        )
        return [one], False
    n = len(ids)
    columns = {
        "rid": _batch_field(body, "rid", n, str),
        "sampling_params": _batch_field(body, "sampling_params", n, dict),
        "return_logprob": _batch_field(body, "return_logprob", n, bool),
        "image_data": _batch_field(body, "image_data", n, (list, str)),  # as SGLang: per prompt
    }
    if body.get("rid") is not None and not isinstance(body["rid"], list):
        raise BadRequest("rid: a batch needs a list of request ids, one per prompt")
    reqs = []
    for i in range(n):
        item = {**body, "input_ids": ids[i], **{k: col[i] for k, col in columns.items()}}
        try:
            reqs.append(
                parse_generate_request(
                    item,
                    vocab_size=vocab_size,
                    max_positions=max_positions,
                    accepts_images=accepts_images,
                )
            )
        except BadRequest as e:
            raise BadRequest(f"batch item {i}: {e}") from None
    rids = [r.rid for r in reqs]
    if len(set(rids)) != n:
        dup = next(r for r in rids if rids.count(r) > 1)
        raise BadRequest(f"rid: {dup!r} appears more than once in the batch")
    return reqs, True


def parse_weight_version(value: Any, current: int) -> int:
    """SGLang sends weight_version as a string; we keep integers (the trainer's step count)."""
    if value is None:
        return current
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    if _is_int(value):
        return value
    raise BadRequest(f"weight_version: expected an integer, got {json.dumps(value)[:40]}")
