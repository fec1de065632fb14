"""The reward a run uses, built from the config's `reward:` / `reward_weights:`: each spec
resolves to a callable (`resolve_reward`: a built-in short name, `pkg.module:fn`, `file.py:fn`,
or a reward-model directory) and runs in a worker process pool (pool.py) as a ContractReward.

One spec runs in one RewardPool. Several run as one pool each (so each keeps its own timeout
and error counts) and are summed with their weights; the mean of each component since the last
`component_stats()` call goes to the metrics as `reward/<spec>`.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

from arealite.api.reward_api import CONTRACT_ARGS, FailFast, RewardSpecError, reward_specs
from arealite.reward.pool import RewardPool
from arealite.reward.reward_model import RewardModelScorer
from arealite.tasks.registry import REWARD_NAMES, builtin_reward

COUNTERS = ("calls", "ok", "timeouts", "errors")


def _import_file(path: str, spec: str) -> Any:
    if not os.path.isfile(path):
        raise RewardSpecError(f"reward {spec!r}: no such file {path!r}")
    name = "arealite_user_reward_" + os.path.splitext(os.path.basename(path))[0]
    module_spec = importlib.util.spec_from_file_location(name, os.path.abspath(path))
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def resolve_reward(spec: str) -> Callable[..., Any]:
    """The function a spec names: a built-in short name (a built-in task's reward,
    arealite/tasks/registry.py), `pkg.module:fn`, `file.py:fn`, or a reward-model checkpoint
    directory (reward_model.py scores with it)."""
    if os.path.isdir(spec):
        return RewardModelScorer(spec)
    fn = builtin_reward(spec)
    if fn is None:
        fn = _import_reward(spec)
    check_reward_signature(fn, spec)
    return fn


def _import_reward(spec: str) -> Callable[..., Any]:
    """The user's function `pkg.module:fn` or `path/to/file.py:fn`."""
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr:
        raise RewardSpecError(
            f"reward {spec!r}: expected a built-in name ({list(REWARD_NAMES)}), "
            "'my_pkg.rewards:score' or 'path/to/file.py:score'"
        )
    try:
        if where.endswith(".py"):
            module = _import_file(where, spec)
        else:
            module = importlib.import_module(where)
    except RewardSpecError:
        raise
    except Exception as e:
        raise RewardSpecError(
            f"reward {spec!r}: importing {where!r} failed: {type(e).__name__}: {e}"
        ) from e
    fn = getattr(module, attr, None)
    if fn is None or not callable(fn):
        raise RewardSpecError(f"reward {spec!r}: {where!r} has no function {attr!r}")
    return fn


def is_library_reward(spec: str) -> bool:
    """A built-in short name or a reward-model directory: tested with the library, so
    preflight does not call it."""
    return builtin_reward(spec) is not None or os.path.isdir(spec)


def check_reward_signature(fn: Callable[..., Any], spec: str) -> None:
    """`fn` accepts the four contract arguments by name and the row's columns as keywords."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin or C callable: nothing to check
    params = sig.parameters.values()
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    var_kw = any(p.kind == p.VAR_KEYWORD for p in params)
    missing = [a for a in CONTRACT_ARGS if a not in names and not var_kw]
    if missing or not var_kw:
        need = "the arguments " + ", ".join(missing) if missing else "a **row catch-all"
        raise RewardSpecError(
            f"reward {spec!r}: {getattr(fn, '__name__', fn)}{sig} lacks {need}; the contract "
            "is fn(prompt, completions, prompt_ids, completion_ids, **row) -> float "
            "(see arealite/api/reward_api.py)"
        )


# Per process: each call unpickles a fresh ContractReward, so resolution and "first traceback"
# are remembered here, by spec.
_RESOLVED: dict[str, Callable[..., Any]] = {}
_TRACEBACK_LOGGED: set[str] = set()


class ContractReward:
    """A reward spec as a picklable callable: each worker process resolves the spec itself,
    once (a `file.py:fn` module cannot be pickled by name), awaits an async function, and
    prints the first traceback of each spec before re-raising (the pool scores 0, counts it)."""

    def __init__(self, spec: str):
        self.spec = spec
        self.__name__ = spec

    def __call__(self, *args: Any, **kwargs: Any) -> float:
        if self.spec not in _RESOLVED:
            _RESOLVED[self.spec] = resolve_reward(self.spec)
        try:
            value = _RESOLVED[self.spec](*args, **kwargs)
            if inspect.isawaitable(value):
                value = asyncio.run(_awaited(value))
            return value
        except Exception:
            if self.spec not in _TRACEBACK_LOGGED:
                _TRACEBACK_LOGGED.add(self.spec)
                print(
                    f"reward {self.spec!r} raised (first traceback in this process):\n"
                    f"{traceback.format_exc()}",
                    file=sys.stderr,
                    flush=True,
                )
            raise


async def _awaited(value: Any) -> Any:
    return await value


class WeightedRewardPool:
    """Drop-in for RewardPool (`await pool(**kw)`, `.stats`, `.end_step()`, `.close()`) over
    several rewards."""

    def __init__(
        self,
        specs: list[tuple[str, float]],
        workers: int,
        timeout: float,
        fail_fast: FailFast | None = None,
    ):
        self.components = [
            (s, w, RewardPool(ContractReward(s), workers, timeout, fail_fast=fail_fast))
            for s, w in specs
        ]
        self._sums = {s: 0.0 for s, _ in specs}
        self._counts = {s: 0 for s, _ in specs}

    async def __call__(self, *args: Any, **kwargs: Any) -> float:
        return (await self.many([(args, kwargs)]))[0]

    async def many(self, calls: list[tuple[tuple, dict]]) -> list[float]:
        """The weighted sum per call; each component scores the whole group at once."""
        per_component = await asyncio.gather(*(p.many(calls) for _, _, p in self.components))
        for (spec, _, _), values in zip(self.components, per_component):
            self._sums[spec] += sum(values)
            self._counts[spec] += len(values)
        return [
            sum(w * v for (_, w, _), v in zip(self.components, item))
            for item in zip(*per_component)
        ]

    @property
    def stats(self) -> dict[str, int]:
        """Counters summed over the components (a sample counts once per component)."""
        return {k: sum(p.stats[k] for _, _, p in self.components) for k in COUNTERS}

    def component_stats(self) -> dict[str, float]:
        """Mean of each component since the last call (then reset)."""
        out = {
            f"reward/{s}": self._sums[s] / self._counts[s] for s in self._sums if self._counts[s]
        }
        self._sums = dict.fromkeys(self._sums, 0.0)
        self._counts = dict.fromkeys(self._counts, 0)
        return out

    def end_step(self, what: str = "step") -> None:
        """The trainer's step boundary, for each component (each judged on its own calls)."""
        for _, _, p in self.components:
            p.end_step(what)

    def close(self) -> None:
        for _, _, p in self.components:
            p.close()


def make_reward_pool(
    reward: Any, weights: Any, workers: int, timeout: float, fail_fast: FailFast | None = None
):
    """A RewardPool for one reward spec, a WeightedRewardPool for a list of them; `fail_fast`
    (`config.rollout.reward_fail_fast()`) stops the run on a broken reward, each spec judged
    on its own calls."""
    specs = reward_specs(reward, weights)
    if len(specs) == 1 and specs[0][1] == 1.0:
        return RewardPool(ContractReward(specs[0][0]), workers, timeout, fail_fast=fail_fast)
    return WeightedRewardPool(specs, workers, timeout, fail_fast)
