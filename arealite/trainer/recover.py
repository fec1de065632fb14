"""Recover checkpoints: kill a run at any moment, rerun the same command, and it continues.

The script names everything a resumed run needs once, in `states` (torchtitan's
CheckpointManager is the model): `TrainEngine`s are saved as DCP checkpoints, anything else with
`state_dict()` / `load_state_dict()` as JSON. A recover checkpoint is one directory
`<run_dir>/recover/checkpoint` holding
- `<name>/` per TrainEngine: its DCP checkpoint (model + optimizer + LR scheduler + RNG, every rank);
- `rank<r>.json`: per rank, the state of every other named object (dataloader position, the
  rollout executor's staleness counters and the items it had pulled but the trainer had not
  consumed yet, saver / evaluator timers, ...) and the next step to run (which is also the stats
  logger's first step);
- `COMPLETE.json`, written last.
It is written into a staging directory and swapped in only when complete, so a crash (or a full
disk) during the write leaves the previous checkpoint intact, and a kill between the swap's two
renames is repaired on the next start. Only JSON and DCP files are written, and nothing is
unpickled on load (see arealite/checkpoint/safe_state.py).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful

from arealite.api.cli_args import RecoverConfig
from arealite.api.engine_api import TrainEngine
from arealite.api.io_struct import FinetuneSpec, SaveLoadMeta
from arealite.checkpoint.safe_state import read_json, write_json
from arealite.checkpoint.save_load import swap_in, tmp_sibling
from arealite.trainer.timer import EpochStepTimeFreqCtl
from arealite.utils import distributed as du

logger = logging.getLogger("arealite.recover")

STATE_FORMAT = 3  # bump when rank<r>.json changes incompatibly
COMPLETE = "COMPLETE.json"  # written last into a staged checkpoint: every rank's part is there
_STATE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")  # also a directory name for engines


# ----------------------------------------------------------------------------- data order


class ResumableSampler(torch.utils.data.Sampler[int]):
    """Visits `range(n)` once per epoch, shuffled by a permutation drawn from (seed, epoch)
    alone; (epoch, offset) is its state. A StatefulDataLoader built on it and restored mid-epoch
    continues the same order, later epochs included (torch's RandomSampler carries a generator
    whose state a restore does not reproduce, so the epochs after a resume would differ)."""

    def __init__(self, n: int, shuffle: bool = True, seed: int = 0):
        super().__init__()
        self.n, self.shuffle, self.seed = n, shuffle, seed
        self.epoch = self.offset = 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            order = torch.randperm(self.n, generator=g).tolist()
        else:
            order = list(range(self.n))
        while self.offset < self.n:
            self.offset += 1
            yield order[self.offset - 1]
        self.epoch, self.offset = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])


# ----------------------------------------------------------------------------- the handler


class RecoverError(RuntimeError):
    """A recover checkpoint could not be written or read; the message says which and why."""


class RecoverHandler:
    """Writes recover checkpoints on a schedule and restores the newest one on start.

    `config.mode`: `auto` resumes when a valid checkpoint exists and starts fresh otherwise;
    `resume` requires one; `disabled` does nothing. `states` maps names to what is saved, e.g.
    {"model": actor, "dataloader": loader, "rollout": executor, "saver": saver,
    "evaluator": evaluator, "workflow": workflow}; a resumed run must pass the same names.
    """

    def __init__(
        self,
        config: RecoverConfig,
        ft_spec: FinetuneSpec,
        run_dir: str,
        states: Mapping[str, TrainEngine | Stateful],
    ):
        self.config = config
        self.ft_spec = ft_spec
        self.path = os.path.join(run_dir, "recover", "checkpoint")
        self.freq_ctl = EpochStepTimeFreqCtl.from_config(config)
        self.enabled = config.mode != "disabled"
        self.engines: dict[str, TrainEngine] = {}
        self.stateful: dict[str, Stateful] = {}
        for name, obj in states.items():
            if not _STATE_NAME.match(name):
                raise ValueError(f"recover state name {name!r} must match {_STATE_NAME.pattern}")
            if isinstance(obj, TrainEngine):
                self.engines[name] = obj
            elif isinstance(obj, Stateful):
                self.stateful[name] = obj
            else:
                raise TypeError(
                    f"recover state {name!r} is a {type(obj).__name__}: pass a TrainEngine or an "
                    "object with state_dict() and load_state_dict()"
                )

    def _state_path(self, root: str, rank: int | None = None) -> str:
        return os.path.join(root, f"rank{du.rank() if rank is None else rank}.json")

    def _engine_meta(self, root: str, name: str) -> SaveLoadMeta:
        return SaveLoadMeta(path=os.path.join(root, name), weight_format="dcp", with_optim=True)

    def dump(self, next_step: int, force: bool = False) -> bool:
        """After a finished (and logged) step: write a checkpoint if due. Collective over
        trainer ranks. On failure (e.g. a full disk) every rank raises RecoverError and the
        previous checkpoint is left as it was."""
        if not self.enabled:
            return False
        end_of_epoch = next_step % self.ft_spec.steps_per_epoch == 0
        if not (self.freq_ctl.check(epochs=int(end_of_epoch), steps=1) or force):
            return False
        staged = tmp_sibling(self.path, "staging")
        from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

        try:
            self._write(staged, next_step)
        except (Exception, CheckpointException) as e:
            if du.is_main():
                shutil.rmtree(staged, ignore_errors=True)
            raise RecoverError(
                f"recover checkpoint for step {next_step} failed ({type(e).__name__}: {e}); "
                f"the previous checkpoint at {self.path} is intact"
            ) from e
        logger.info("recover checkpoint written for step %d: %s", next_step, self.path)
        return True

    def _write(self, staged: str, next_step: int) -> None:
        error = None
        if du.is_main():
            try:
                shutil.rmtree(staged, ignore_errors=True)
                os.makedirs(staged)
            except OSError as e:
                error = e
        du.raise_if_any_rank_failed(error)
        for name, engine in self.engines.items():
            engine.save(self._engine_meta(staged, name))
        state = {
            "format": STATE_FORMAT,
            "next_step": next_step,
            "world_size": du.world_size(),
            "recover": self.freq_ctl.state_dict(),
            "states": {name: obj.state_dict() for name, obj in self.stateful.items()},
        }
        error = None
        try:
            write_json(self._state_path(staged), state)
        except (OSError, TypeError) as e:
            error = e
        du.raise_if_any_rank_failed(error)
        error = None
        if du.is_main():
            try:
                write_json(os.path.join(staged, COMPLETE), {"next_step": next_step})
                swap_in(staged, self.path)
            except OSError as e:
                error = e
        du.raise_if_any_rank_failed(error)

    def _repair(self) -> None:
        """A kill between swap_in's two renames leaves no checkpoint at `path`, but a complete
        staged one or the moved-aside previous one: put the newest complete one back."""
        if os.path.exists(self.path):
            return
        staged = tmp_sibling(self.path, "staging")
        parent = os.path.dirname(os.path.abspath(self.path))
        prefix = os.path.basename(tmp_sibling(self.path, "old-"))  # swap_in's aside names
        names = os.listdir(parent) if os.path.isdir(parent) else []
        old = sorted(
            (os.path.join(parent, d) for d in names if d.startswith(prefix)), key=os.path.getmtime
        )
        if os.path.exists(os.path.join(staged, COMPLETE)):
            os.replace(staged, self.path)
        elif old:
            os.replace(old[-1], self.path)
        else:
            return
        logger.warning("recover checkpoint restored after an interrupted swap: %s", self.path)

    def load(self) -> int:
        """Restore the newest checkpoint (per `mode`) into `states`; returns the step to start
        from (0 = fresh). Every TrainEngine's version is set to that step."""
        if not self.enabled:
            return 0
        if du.is_main():
            self._repair()
        du.barrier()
        if not os.path.exists(self._state_path(self.path, 0)):
            if self.config.mode == "resume":
                raise FileNotFoundError(
                    f"recover.mode=resume but no recover checkpoint at {self.path}"
                )
            logger.info("no recover checkpoint at %s: starting fresh", self.path)
            return 0
        state = self._read_state()
        saved = state["states"]
        for name in self.engines:
            if not os.path.isdir(os.path.join(self.path, name)):
                raise RecoverError(f"recover checkpoint {self.path} has no engine {name!r}")
        for name in self.stateful:
            if name not in saved:
                raise RecoverError(
                    f"recover checkpoint {self.path} has no state for {name!r} (it holds "
                    f"{sorted(saved)}): resume with the states the run was started with"
                )
        for name, engine in self.engines.items():
            engine.load(self._engine_meta(self.path, name))
        for name, obj in self.stateful.items():
            obj.load_state_dict(saved[name])
        self.freq_ctl.load_state_dict(state["recover"])
        for engine in self.engines.values():
            engine.set_version(state["next_step"])
        logger.info("resumed from %s at step %d", self.path, state["next_step"])
        return state["next_step"]

    def _read_state(self) -> dict[str, Any]:
        rank_file = self._state_path(self.path)
        if not os.path.exists(rank_file):
            raise RecoverError(
                f"recover checkpoint {self.path} has no state for rank {du.rank()}: resume with "
                "the same number of trainer ranks"
            )
        try:
            state = read_json(rank_file)
        except (OSError, ValueError) as e:
            raise RecoverError(f"recover state {rank_file} is unreadable: {e}") from e
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise RecoverError(
                f"recover state {rank_file} has format {state.get('format')!r} (expected "
                f"{STATE_FORMAT}): it was written by another arealite version; delete "
                f"{os.path.dirname(self.path)} to start fresh"
            )
        if state["world_size"] != du.world_size():
            raise RecoverError(
                f"recover checkpoint {self.path} was written by {state['world_size']} trainer "
                f"ranks, this run has {du.world_size()}: resume with the same allocation"
            )
        return state
