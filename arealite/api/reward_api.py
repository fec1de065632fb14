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
  is plainly broken stops the run with its first traceback and the counts: every call of a
  step failed (checked at the end of the step, before training on it;
  `rollout.reward_fail_fast_steps`: 1 such step), or more than
  `rollout.max_reward_error_rate` (0.5) of the last `rollout.reward_error_window` (256) did.

Example, `my_rewards.py` next to the YAML:

    def score(prompt, completions, prompt_ids, completion_ids, answer=None, difficulty=1, **row):
        return float(completions.strip() == str(answer)) * difficulty

    reward: my_rewards.py:score            # or an import path: my_pkg.rewards:score
    reward: [math_verify, my_rewards.py:brevity]
    reward_weights: [1.0, 0.1]             # weighted sum; each component is logged

Built-ins by short name (arith, math_verify / gsm8k, clevr_count): the built-in tasks' rewards
(arealite/tasks/registry.py). A directory is a trained reward model (`reward:
runs/arith-rm/demo/checkpoints/final/<name>`, from examples/rm.py): scored in the reward worker
process, see arealite/reward/reward_model.py. This file is the contract only; a spec becomes a
callable in arealite/reward/resolve.py.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

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


@dataclass(frozen=True)
class FailFast:
    """When a RewardPool gives up on a broken reward (the rules: arealite/reward/errors.py)."""

    steps: int = 1  # this many steps in a row in which every call failed: stop (0 = off)
    max_error_rate: float = 0.5  # more than this fraction of the last `window` failed: stop
    window: int = 256

    def __post_init__(self):
        if self.steps < 0 or self.window < 1 or not 0.0 <= self.max_error_rate <= 1.0:
            raise ValueError(
                f"FailFast needs steps >= 0, window >= 1, 0 <= max_error_rate <= 1; got {self}"
            )
