"""Recover checkpoints: kill a run at any moment, rerun the same command, and it continues.

A recover checkpoint is one directory `<run_dir>/recover/checkpoint` holding
- `model/`: the trainer's DCP checkpoint (model + optimizer + LR scheduler + RNG, every rank);
- `rank<r>.json`: per rank, the dataloader position, the rollout executor's state (staleness
  counters and the data items it had pulled but the trainer had not consumed yet), the saver /
  evaluator timers and the next step to run (which is also the stats logger's first step).
It is written into a staging directory and swapped in only when complete, so a crash (or a full
disk) during the write leaves the previous checkpoint intact. Only JSON and DCP files are
written, and nothing is unpickled on load: JSON for our state, and DCP's `.metadata` pickle is
read by an unpickler that admits only DCP's own metadata classes (`SafeDCPReader`).
"""

from __future__ import annotations

import logging
import os
import shutil
from typing import Any

import torch

from arealite.api.io_struct import SaveLoadMeta
from arealite.utils import distributed as du
from arealite.utils.safe_state import read_json, write_json
from arealite.utils.save_load import swap_in, tmp_sibling
from arealite.utils.timer import EpochStepTimeFreqCtl

logger = logging.getLogger("arealite.recover")

STATE_FORMAT = 2  # bump when rank<r>.json changes incompatibly
COMPLETE = "COMPLETE.json"  # written last into a staged checkpoint: every rank's part is there


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

    `config` is a RecoverConfig (mode disabled | auto | resume, freq_*): `auto` resumes when a
    valid checkpoint exists and starts fresh otherwise; `resume` requires one.
    """

    def __init__(self, config: Any, ft_spec: Any, run_dir: str):
        self.config = config
        self.ft_spec = ft_spec
        self.path = os.path.join(run_dir, "recover", "checkpoint")
        self.freq_ctl = EpochStepTimeFreqCtl.from_config(config)
        self.enabled = config.mode != "disabled"

    def _state_path(self, root: str, rank: int | None = None) -> str:
        return os.path.join(root, f"rank{du.rank() if rank is None else rank}.json")

    def dump(self, engine, dataloader, rollout, saver, evaluator, next_step: int,
             force: bool = False, extra: dict[str, Any] | None = None) -> bool:  # fmt: skip
        """After a finished (and logged) step: write a checkpoint if due. Collective over
        trainer ranks. `extra`: more objects with state_dict / load_state_dict (e.g. a
        workflow's cumulative counters), by name. On failure (e.g. a full disk) every rank
        raises RecoverError and the previous checkpoint is left as it was."""
        if not self.enabled:
            return False
        end_of_epoch = next_step % self.ft_spec.steps_per_epoch == 0
        if not (self.freq_ctl.check(epochs=int(end_of_epoch), steps=1) or force):
            return False
        staged = tmp_sibling(self.path, "staging")
        from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

        try:
            objs = (engine, dataloader, rollout, saver, evaluator, extra or {})
            self._write(staged, *objs, next_step)
        except (Exception, CheckpointException) as e:
            if du.is_main():
                shutil.rmtree(staged, ignore_errors=True)
            raise RecoverError(
                f"recover checkpoint for step {next_step} failed ({type(e).__name__}: {e}); "
                f"the previous checkpoint at {self.path} is intact"
            ) from e
        logger.info("recover checkpoint written for step %d: %s", next_step, self.path)
        return True

    def _write(self, staged, engine, dataloader, rollout, saver, evaluator, extra, next_step):
        error = None
        if du.is_main():
            try:
                shutil.rmtree(staged, ignore_errors=True)
                os.makedirs(staged)
            except OSError as e:
                error = e
        du.raise_if_any_rank_failed(error)
        engine.save(
            SaveLoadMeta(path=os.path.join(staged, "model"), weight_format="dcp", with_optim=True)
        )
        state = {
            "format": STATE_FORMAT,
            "next_step": next_step,
            "world_size": du.world_size(),
            "dataloader": dataloader.state_dict(),
            "rollout": rollout.executor.state_dict() if rollout is not None else None,
            "saver": saver.state_dict() if saver is not None else None,
            "evaluator": evaluator.state_dict() if evaluator is not None else None,
            "recover": self.freq_ctl.state_dict(),
            "extra": {name: obj.state_dict() for name, obj in extra.items()},
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
        old = sorted((os.path.join(parent, d) for d in names if d.startswith(prefix)),
                     key=os.path.getmtime)  # fmt: skip
        if os.path.exists(os.path.join(staged, COMPLETE)):
            os.replace(staged, self.path)
        elif old:
            os.replace(old[-1], self.path)
        else:
            return
        logger.warning("recover checkpoint restored after an interrupted swap: %s", self.path)

    def load(self, engine, dataloader, rollout, saver, evaluator,
             extra: dict[str, Any] | None = None) -> int:  # fmt: skip
        """Restore the newest checkpoint (per `mode`); returns the step to start from (0 = fresh).
        `extra` names the same objects `dump` was given."""
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
        engine.load(
            SaveLoadMeta(
                path=os.path.join(self.path, "model"), weight_format="dcp", with_optim=True
            )
        )
        dataloader.load_state_dict(state["dataloader"])
        if rollout is not None and state["rollout"] is not None:
            rollout.executor.load_state_dict(state["rollout"])
        if saver is not None and state["saver"] is not None:
            saver.load_state_dict(state["saver"])
        if evaluator is not None and state["evaluator"] is not None:
            evaluator.load_state_dict(state["evaluator"])
        self.freq_ctl.load_state_dict(state["recover"])
        for name, obj in (extra or {}).items():
            if name not in state["extra"]:
                raise RecoverError(f"recover checkpoint {self.path} has no state for {name!r}")
            obj.load_state_dict(state["extra"][name])
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
