"""Preflight's reward call: each reward spec is called once on a real row of the data with a short
dummy completion, before any server starts.

Why call it: the signature check cannot see a reward that takes `**kw` but names a contract
argument wrong (`completion` for `completions`), imports a missing module inside the function,
reads a column the row lacks, or returns None; in a run each of those scores 0 on every sample,
for the whole run. Why a worker process: the call runs the user's code (it may hang: the timeout
kills the worker), and math-verify's `signal.alarm` needs the main thread of a process, which
is where a multiprocessing worker runs its tasks.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import multiprocessing
import traceback
from typing import Any

from arealite.api.config_loader import ConfigError
from arealite.api.reward_api import CONTRACT_ARGS
from arealite.reward.resolve import resolve_reward

# Never row-dependent: the reward fails like this on every sample. Anything else raised on row 0
# (a ValueError on an odd answer) is only printed: the run scores such samples 0, and stops if
# most calls fail (rollout.max_reward_error_rate).
FATAL = (TypeError, ImportError, NameError)
DUMMY_COMPLETION = "42"
DUMMY_PROMPT_IDS = [0, 1, 2, 3]
DUMMY_COMPLETION_IDS = [4, 5]
IMPORT_TIMEOUT_S = 120.0  # the worker imports the reward's module (sympy, a tokenizer...) first

_RESOLVED: dict[str, Any] = {}


def _resolve(spec: str) -> None:
    _RESOLVED[spec] = resolve_reward(spec)


def _call(spec: str, kwargs: dict[str, Any]) -> tuple[bool, str | None]:
    """In the worker: (fatal, the problem or None). Never raises: a user's exception may not
    unpickle in the launcher, its formatted traceback always does."""
    try:
        value = _RESOLVED[spec](**kwargs)
        if inspect.isawaitable(value):
            value = asyncio.run(_awaited(value))
    except Exception as e:
        text = f"raised {type(e).__name__}: {e}\n{traceback.format_exc().rstrip()}"
        return isinstance(e, FATAL), text
    if isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
        return True, f"returned {repr(value)[:200]} ({type(value).__name__}), not a float"
    if not math.isfinite(float(value)):
        return False, f"returned {float(value)}, not a finite float (such samples score 0)"
    return False, None


async def _awaited(value: Any) -> Any:
    return await value


def contract_kwargs(row: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments a workflow passes for `row` (dummy completion and token ids)."""
    messages = row.get("messages") or []
    prompt = "\n".join(str(m.get("content", "")) for m in messages if isinstance(m, dict))
    kwargs = {k: v for k, v in row.items() if k not in CONTRACT_ARGS}
    return dict(
        kwargs,
        prompt=prompt,
        completions=DUMMY_COMPLETION,
        prompt_ids=list(DUMMY_PROMPT_IDS),
        completion_ids=list(DUMMY_COMPLETION_IDS),
    )


def probe_rewards(key: str, specs: list[str], row: dict[str, Any], where: str, timeout: float):
    """Call each spec once on `row` in one worker process (`where`: which data row): ConfigError
    naming `key`, the spec and the row's columns on a TypeError, an ImportError, a NameError or
    a non-float; other exceptions and a timeout are printed, and the run goes on."""
    kwargs = contract_kwargs(row)
    columns = sorted(k for k in kwargs if k not in CONTRACT_ARGS)
    pool = multiprocessing.get_context("spawn").Pool(1)
    try:
        for spec in specs:
            head = (
                f"{key}: reward {spec!r}, called by preflight on {where} (columns "
                f"{columns}) with the dummy completion {DUMMY_COMPLETION!r},"
            )
            try:
                pool.apply_async(_resolve, (spec,)).get(IMPORT_TIMEOUT_S)
                fatal, problem = pool.apply_async(_call, (spec, kwargs)).get(timeout)
            except multiprocessing.TimeoutError:  # the worker is stuck: a fresh one goes on
                fatal, problem = False, f"did not return within {timeout:g}s"
                pool.terminate()
                pool = multiprocessing.get_context("spawn").Pool(1)
            except Exception as e:  # the worker died, or the import failed there
                fatal, problem = True, f"failed in the worker: {type(e).__name__}: {e}"
            if problem is not None and not fatal:
                print(
                    f"preflight: {head} {problem}\n(not fatal: the run scores such samples 0, "
                    "and stops if most calls fail)",
                    flush=True,
                )
            elif problem is not None:
                raise ConfigError(
                    f"{head} {problem}\nThe contract: fn(prompt, completions, prompt_ids, "
                    "completion_ids, **row) -> float (arealite/api/reward_api.py); the row's "
                    "columns arrive as keywords."
                )
    finally:
        pool.terminate()
