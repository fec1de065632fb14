"""Recover checkpoints: kill a run at any moment, rerun the same command, and it continues.

A recover checkpoint is one directory `<run_dir>/recover/checkpoint` holding
- `model/`: the trainer's DCP checkpoint (model + optimizer + LR scheduler + RNG, every rank);
- `rank<r>.json`: per rank, the dataloader position, the rollout executor's staleness counters,
  the saver / evaluator timers and the next step to run.
It is written into a staging directory and swapped in only when complete, so a crash during the
write leaves the previous checkpoint intact. Only JSON, safetensors and DCP files are written and
read back (no pickles).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Any

import torch

from arealite.utils import distributed as du
from arealite.utils.save_load import swap_in, tmp_sibling
from arealite.utils.saver import _save_load_meta_cls
from arealite.utils.timer import EpochStepTimeFreqCtl

logger = logging.getLogger("arealite.recover")


def to_json(obj: Any) -> Any:
    """JSON form of a state dict: tensors become {"__tensor__": list, "dtype": str}."""
    if isinstance(obj, torch.Tensor):
        return {"__tensor__": obj.tolist(), "dtype": str(obj.dtype).removeprefix("torch.")}
    if isinstance(obj, dict):
        return {str(k): to_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_json(v) for v in obj]
    return obj


def from_json(obj: Any) -> Any:
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return torch.tensor(obj["__tensor__"], dtype=getattr(torch, obj["dtype"]))
        return {k: from_json(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [from_json(v) for v in obj]
    return obj


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
             force: bool = False) -> bool:  # fmt: skip
        """After a finished step: write a checkpoint if due. Collective over trainer ranks."""
        if not self.enabled:
            return False
        end_of_epoch = next_step % self.ft_spec.steps_per_epoch == 0
        if not (self.freq_ctl.check(epochs=int(end_of_epoch), steps=1) or force):
            return False
        staged = tmp_sibling(self.path, "staging")
        if du.is_main():
            shutil.rmtree(staged, ignore_errors=True)
            os.makedirs(staged)
        du.barrier()
        meta_cls = _save_load_meta_cls()
        engine.save(
            meta_cls(path=os.path.join(staged, "model"), weight_format="dcp", with_optim=True)
        )
        state = {
            "next_step": next_step,
            "dataloader": dataloader.state_dict(),
            "rollout": rollout.executor.state_dict() if rollout is not None else None,
            "saver": saver.state_dict() if saver is not None else None,
            "evaluator": evaluator.state_dict() if evaluator is not None else None,
            "recover": self.freq_ctl.state_dict(),
        }
        with open(self._state_path(staged), "w") as f:
            json.dump(to_json(state), f)
        du.barrier()
        if du.is_main():
            swap_in(staged, self.path)
        du.barrier()
        logger.info("recover checkpoint written for step %d: %s", next_step, self.path)
        return True

    def load(self, engine, dataloader, rollout, saver, evaluator) -> int:
        """Restore the newest checkpoint (per `mode`); returns the step to start from (0 = fresh)."""
        if not self.enabled:
            return 0
        if not os.path.exists(self._state_path(self.path, 0)):
            if self.config.mode == "resume":
                raise FileNotFoundError(
                    f"recover.mode=resume but no recover checkpoint at {self.path}"
                )
            logger.info("no recover checkpoint at %s: starting fresh", self.path)
            return 0
        rank_file = self._state_path(self.path)
        if not os.path.exists(rank_file):
            raise RuntimeError(f"recover checkpoint {self.path} has no state for rank {du.rank()}: "
                               "resume with the same number of trainer ranks")  # fmt: skip
        with open(rank_file) as f:
            state = from_json(json.load(f))
        meta_cls = _save_load_meta_cls()
        engine.load(
            meta_cls(path=os.path.join(self.path, "model"), weight_format="dcp", with_optim=True)
        )
        dataloader.load_state_dict(state["dataloader"])
        if rollout is not None and state["rollout"] is not None:
            rollout.executor.load_state_dict(state["rollout"])
        if saver is not None and state["saver"] is not None:
            saver.load_state_dict(state["saver"])
        if evaluator is not None and state["evaluator"] is not None:
            evaluator.load_state_dict(state["evaluator"])
        self.freq_ctl.load_state_dict(state["recover"])
        engine.set_version(state["next_step"])
        logger.info("resumed from %s at step %d", self.path, state["next_step"])
        return state["next_step"]
