"""The reward contract, and how a config names a reward (`reward:` in a GRPO YAML).

A reward function scores ONE sampled completion:

    def score(prompt: str, completions: str, prompt_ids: list[int], completion_ids: list[int],
              **row) -> float

- `prompt`: the chat-templated prompt text the model saw; `completions`: the text of this one
  sample (special tokens skipped; the name follows AReaL); `prompt_ids` / `completion_ids`:
  the exact token ids.
- `**row`: every other column of the dataset row, by its canonical name (`answer`, `images`,
  `query_id`, `messages`, and the user's own columns). A column renamed by the dataset's
  `columns:` arrives under both names: after `columns: {answer: solution}` the reward gets
  `answer` and `solution` (the same value). Take what you need, accept `**row`.
- It may be `async def`. It runs in a worker process, so it must live at module level (or be a
  picklable instance: a class with state subclasses `Reward` and implements `score`).
- It returns a float. Preflight (the launcher, before any server starts) calls each of your
  specs (not the built-ins) once on row 0 of `train_dataset` with a short dummy completion, in
  a worker process with the timeout: a TypeError, an ImportError, a NameError or a non-float there fails the launch,
  naming the spec and the row's columns (another exception or a timeout is printed only).
- At run time an exception, a non-finite value or a timeout (`rollout.reward_timeout`) scores 0
  for that sample; the run goes on, the metrics count it (`rollout/errors`,
  `rollout/timeouts`) and each kind of failure is logged once (then by count). A reward that
  is plainly broken stops the run with its first traceback and the counts: the first
  `rollout.reward_fail_fast_calls` calls (64) all failed, or more than
  `rollout.max_reward_error_rate` (0.5) of the last `rollout.reward_error_window` (256) did.

Example, `my_rewards.py` next to the YAML:

    def score(prompt, completions, prompt_ids, completion_ids, answer=None, difficulty=1, **row):
        return float(completions.strip() == str(answer)) * difficulty

    reward: my_rewards.py:score            # or an import path: my_pkg.rewards:score
    reward: [math_verify, my_rewards.py:brevity]
    reward_weights: [1.0, 0.1]             # weighted sum; each component is logged

Built-ins by short name: BUILTIN_REWARDS. A directory is a trained reward model
(`reward: runs/arith-rm/demo/checkpoints/final/<name>`, from examples/rm.py): scored in the
reward worker process, see arealite/reward/reward_model.py.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import logging
import os
import sys
import traceback
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("arealite.reward")

BUILTIN_REWARDS = {
    "math_verify": "arealite.reward.math_verify_reward:math_reward_fn",
    "gsm8k": "arealite.reward.math_verify_reward:gsm8k_reward_fn",
    "arith": "arealite.reward.arith:arith_reward_fn",
    "clevr_count": "arealite.reward.clevr_count:clevr_count_reward_fn",
}
REWARD_MODEL_SCORER = ("arealite.reward.reward_model", "RewardModelScorer")
CONTRACT_ARGS = ("prompt", "completions", "prompt_ids", "completion_ids")


@dataclass(frozen=True)
class RewardInput:
    """One sampled completion, as a class-based reward scores it: the contract's arguments."""

    prompt: str
    completion: str
    prompt_ids: list[int]
    completion_ids: list[int]
    row: dict[str, Any]


class Reward(ABC):
    """Base of rewards written as classes (state that pickles to the worker: an extractor, a
    model path): `__call__` is the contract's signature, written once here; a subclass
    implements `score`. A plain function with the same signature needs no base class."""

    def __call__(
        self,
        prompt: str,
        completions: str,
        prompt_ids: list[int],
        completion_ids: list[int],
        **row: Any,
    ) -> float:
        return self.score(RewardInput(prompt, completions, prompt_ids, completion_ids, row))

    @abstractmethod
    def score(self, sample: RewardInput) -> float:
        """The reward of one sample."""


class RewardSpecError(ValueError):
    """A `reward:` entry that does not resolve to a usable function (the message names it)."""


def _import_file(path: str, spec: str) -> Any:
    if not os.path.isfile(path):
        raise RewardSpecError(f"reward {spec!r}: no such file {path!r}")
    name = "arealite_user_reward_" + os.path.splitext(os.path.basename(path))[0]
    module_spec = importlib.util.spec_from_file_location(name, os.path.abspath(path))
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def resolve_reward(spec: str) -> Callable[..., Any]:
    """The function a spec names: a built-in short name, `pkg.module:fn`, `file.py:fn`, or a
    reward-model checkpoint directory (arealite/reward/reward_model.py scores with it)."""
    if os.path.isdir(spec):
        return _reward_model(spec)
    target = BUILTIN_REWARDS.get(spec, spec)
    where, sep, attr = target.rpartition(":")
    if not sep or not where or not attr:
        raise RewardSpecError(
            f"reward {spec!r}: expected a built-in name ({sorted(BUILTIN_REWARDS)}), "
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
    check_reward_signature(fn, spec)
    return fn


def _reward_model(path: str) -> Callable[..., Any]:
    """A scorer for a trained reward model (imported by name: api never imports reward)."""
    scorer = importlib.import_module(REWARD_MODEL_SCORER[0])
    return getattr(scorer, REWARD_MODEL_SCORER[1])(path)


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


def reward_specs(reward: Any, weights: Any) -> list[tuple[str, float]]:
    """(spec, weight) pairs of a `reward:` value (a string or a list) and `reward_weights`."""
    specs = [reward] if isinstance(reward, str) else list(reward or [])
    if not specs or not all(isinstance(s, str) and s for s in specs):
        raise RewardSpecError(f"reward must be a name/spec or a list of them, got {reward!r}")
    if weights is None:
        weights = [1.0] * len(specs)
    weights = list(weights)
    if len(weights) != len(specs):
        raise RewardSpecError(
            f"reward_weights has {len(weights)} entries for {len(specs)} rewards {specs}"
        )
    return list(zip(specs, (float(w) for w in weights)))


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
                print(f"reward {self.spec!r} raised (first traceback in this process):\n"
                      f"{traceback.format_exc()}", file=sys.stderr, flush=True)  # fmt: skip
            raise


async def _awaited(value: Any) -> Any:
    return await value
