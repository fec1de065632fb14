"""Where training statistics go: TensorBoard + metrics.jsonl always, wandb / swanlab on request.

Files in the run directory (rank 0 writes, other ranks' calls are no-ops):
  tensorboard/    event files (`tensorboard --logdir <run_dir>/tensorboard`)
  metrics.jsonl   one JSON object per step: {"step": global_step, "epoch", "epoch_step", ...stats}
  curves.png      reward / accuracy / loss curves, written by `close()`
  summary.json    end-of-run summary (last and best values), written by `close()`

A resumed run passes `start_step` (the first global step it will commit): records with
step >= start_step from the crashed run are dropped from metrics.jsonl and purged in TensorBoard,
so every step appears exactly once.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch.distributed as dist

from arealite.api.cli_args import BaseExperimentConfig, StatsLoggerConfig
from arealite.api.io_struct import FinetuneSpec
from arealite.trainer.plotting import DEFAULT_PANELS, plot_curves, read_metrics_jsonl, select_curves
from arealite.trainer.progress import ProgressLine
from arealite.trainer.time_budget import TimeBudget

logger = logging.getLogger(__name__)


def _rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def _to_float(v: Any) -> float | None:
    """A JSON/TensorBoard-safe number (tensors and numpy scalars included), else None."""
    try:
        f = float(v.item() if hasattr(v, "item") else v)
    except (TypeError, ValueError, RuntimeError):
        return None
    return f


def _merge(stats: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> dict[str, float]:
    dicts = [stats] if isinstance(stats, Mapping) else list(stats)
    out = {}
    for d in dicts:
        for k, v in d.items():
            f = _to_float(v)
            if f is not None:
                out[k] = f
    return out


class StatsLogger:
    """`commit` once per training step with the exported stats; `close` at the end.

    `ft_spec` gives the total number of steps for the progress line's ETA (`total_steps`
    overrides it, e.g. config.total_train_steps), and `time_budget` the clock's end
    (total_train_secs); `exp_config` is recorded by wandb / swanlab.
    """

    def __init__(
        self,
        config: StatsLoggerConfig,
        run_dir: str,
        ft_spec: FinetuneSpec | None = None,
        start_step: int = 0,
        total_steps: int | None = None,
        exp_config: BaseExperimentConfig | None = None,
        time_budget: TimeBudget | None = None,
    ):
        self.config = config
        self.run_dir = run_dir
        self.start_step = start_step
        self.tb_dir = os.path.join(run_dir, "tensorboard")
        self.metrics_path = os.path.join(run_dir, "metrics.jsonl")
        self.plot_path = os.path.join(run_dir, "curves.png")
        self.summary_path = os.path.join(run_dir, "summary.json")
        if total_steps is None and ft_spec is not None:
            total_steps = ft_spec.total_train_steps
        self.progress = ProgressLine(
            total_steps, print_every=config.print_every, time_budget=time_budget
        )
        self.is_writer = _rank() == 0
        self._closed = False
        self._t0 = time.time()
        self._n_commits = 0
        self._tb = self._metrics_file = self._wandb = self._swanlab = None
        if self.is_writer:
            self._open(exp_config)

    def _open(self, exp_config: BaseExperimentConfig | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        os.makedirs(self.run_dir, exist_ok=True)
        self._truncate_metrics(self.start_step)
        self._metrics_file = open(self.metrics_path, "a")
        self._tb = SummaryWriter(self.tb_dir, purge_step=self.start_step or None)
        trial = os.path.basename(os.path.normpath(self.run_dir))
        experiment = os.path.basename(os.path.dirname(os.path.normpath(self.run_dir)))
        cfg = dataclasses.asdict(exp_config) if dataclasses.is_dataclass(exp_config) else None
        if self.config.wandb_mode != "disabled":
            wandb = _import_optional("wandb", "wandb")
            self._wandb = wandb.init(
                project=self.config.wandb_project or experiment,
                name=trial,
                id=f"{experiment}_{trial}",
                dir=self.run_dir,
                mode=self.config.wandb_mode,
                resume="allow",
                config=cfg,
            )
        if self.config.swanlab_mode != "disabled":
            swanlab = _import_optional("swanlab", "swanlab")
            self._swanlab = swanlab
            swanlab.init(
                project=self.config.wandb_project or experiment,
                experiment_name=trial,
                mode=self.config.swanlab_mode,
                logdir=os.path.join(self.run_dir, "swanlab"),
                config=cfg,
            )

    def _truncate_metrics(self, start_step: int) -> None:
        """Keep only records of steps before `start_step` (so a fresh run, start_step=0,
        replaces the records of an earlier trial with the same name)."""
        if not os.path.exists(self.metrics_path):
            return
        kept = [r for r in read_metrics_jsonl(self.metrics_path) if r.get("step", 0) < start_step]
        tmp = self.metrics_path + ".tmp"
        with open(tmp, "w") as f:
            for r in kept:
                f.write(json.dumps(r) + "\n")
        os.replace(tmp, self.metrics_path)
        logger.info("metrics.jsonl: kept %d records before step %d", len(kept), start_step)

    def commit(
        self,
        epoch: int,
        step: int,
        global_step: int,
        stats: Mapping[str, Any] | Sequence[Mapping[str, Any]],
        **progress_values: float,
    ) -> None:
        """Log the stats of (0-based) `global_step`. `progress_values` (reward=..., staleness=...,
        behave_kl=...) override what the progress line finds in `stats`."""
        if not self.is_writer:
            return
        if self._closed:
            raise RuntimeError("StatsLogger.commit after close()")
        flat = _merge(stats)
        record = {"step": global_step, "epoch": epoch, "epoch_step": step}
        record["wall_time"] = time.time() - self._t0
        record.update({k: (v if math.isfinite(v) else None) for k, v in flat.items()})
        self._metrics_file.write(json.dumps(record) + "\n")
        self._metrics_file.flush()
        for k, v in flat.items():
            self._tb.add_scalar(k, v, global_step)
        self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(flat, step=global_step)
        if self._swanlab is not None:
            self._swanlab.log(flat, step=global_step)
        self._n_commits += 1
        self.progress.update(global_step, flat, **progress_values)

    def close(self) -> dict[str, Any] | None:
        """Write summary.json and curves.png, close the backends; returns the summary."""
        if not self.is_writer or self._closed:
            return None
        self._closed = True
        self._metrics_file.close()
        self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._swanlab is not None:
            self._swanlab.finish()
        records = read_metrics_jsonl(self.metrics_path)
        summary = summarize(records)
        summary["wall_time_this_session"] = time.time() - self._t0
        with open(self.summary_path, "w") as f:
            json.dump(summary, f, indent=2)
        plot = plot_curves(records, self.plot_path)
        logger.info(
            "Run summary (%d steps): %s; plot: %s",
            summary["n_steps"],
            json.dumps(summary["last"]),
            plot or "none (no reward/accuracy/loss keys)",
        )
        return summary

    def __enter__(self) -> StatsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def summarize(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Last and best values of the reward / accuracy / loss keys (best = max, min for loss)."""
    out: dict[str, Any] = {"n_steps": len(records), "last": {}, "best": {}}
    if not records:
        return out
    out["last_step"] = records[-1]["step"]
    for panel, pattern in DEFAULT_PANELS.items():
        for k, (_, vals) in select_curves(records, pattern).items():
            out["last"][k] = vals[-1]
            out["best"][k] = min(vals) if panel == "loss" else max(vals)
    return out


def _import_optional(module: str, extra: str):
    try:
        return __import__(module)
    except ImportError:
        raise ImportError(
            f"stats_logger.{module}_mode is enabled but {module} is not installed: "
            f"pip install 'arealite[{extra}]' (or set stats_logger.{module}_mode=disabled)"
        ) from None
