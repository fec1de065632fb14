"""Training statistics with masks, scopes and a distributed reduce.

Per-token statistics (ratios, KL, advantages) only mean something over the tokens that count,
so a statistic names a boolean *denominator* mask recorded before it; `export` then gives the
exact masked mean over every call and every rank (sums and counts are all-reduced, never means
of means), plus min and max.

    with stats_tracker.scope("ppo_actor"):
        stats_tracker.denominator(n_tokens=loss_mask.bool())
        stats_tracker.stat(behave_kl=kl, denominator="n_tokens")
        stats_tracker.scalar(lr=lr)
    stats = stats_tracker.export(reduce_group=group)  # {"ppo_actor/behave_kl/avg": ..., ...}
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

REDUCE_TYPES = ("avg_min_max", "avg", "sum", "min", "max")


class StatsTracker:
    """Accumulates named statistics until `export`.

    Exported keys: a denominator `name` -> number of True entries; a stat `name` ->
    `name/avg`, `name/min`, `name/max` (or just `name` for reduce_type avg/sum/min/max);
    a scalar `name` -> mean of the recorded values.
    """

    def __init__(self, name: str = ""):
        self.name = name
        self._scopes: list[str] = [name] if name else []
        self._masks: dict[str, torch.Tensor] = {}
        self._reset()

    def _reset(self) -> None:
        self._counts: dict[str, Any] = {}  # denominators: running count (a device tensor)
        self._stats: dict[str, list[torch.Tensor]] = defaultdict(list)  # [sum, n, min, max]
        self._reduce: dict[str, str] = {}
        self._scalars: dict[str, list[float]] = defaultdict(list)
        self._masks.clear()

    def _key(self, name: str) -> str:
        return "/".join([*self._scopes, name])

    @contextlib.contextmanager
    def scope(self, name: str) -> Iterator[None]:
        """Prefix keys recorded inside with `name/` (scopes nest)."""
        self._scopes.append(name)
        try:
            yield
        finally:
            self._scopes.pop()

    def denominator(self, **masks: torch.Tensor) -> None:
        """Record boolean masks that later `stat` calls average over."""
        for name, mask in masks.items():
            if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
                raise TypeError(
                    f"denominator {name!r} must be a bool tensor, got "
                    f"{getattr(mask, 'dtype', type(mask).__name__)}"
                )
            key = self._key(name)
            self._masks[key] = mask.detach()
            self._counts[key] = self._counts.get(key, 0) + mask.sum()

    def stat(self, denominator: str, reduce_type: str = "avg_min_max", **values: torch.Tensor):
        """Record tensors shaped like the mask `denominator` (named within the current scope)."""
        if reduce_type not in REDUCE_TYPES:
            raise ValueError(f"reduce_type must be one of {REDUCE_TYPES}, got {reduce_type!r}")
        mask_key = self._key(denominator)
        if mask_key not in self._masks:
            raise KeyError(
                f"stat denominator {mask_key!r} was not recorded; call "
                f"denominator({denominator}=mask) first in this scope"
            )
        mask = self._masks[mask_key]
        for name, value in values.items():
            if value.shape != mask.shape:
                raise ValueError(
                    f"stat {self._key(name)!r} has shape {tuple(value.shape)} but its "
                    f"denominator {mask_key!r} has shape {tuple(mask.shape)}"
                )
            v = value.detach().float()
            m = mask.to(v.device)
            inf = torch.tensor(math.inf, device=v.device)
            key = self._key(name)
            self._stats[key].append(
                torch.stack(
                    [
                        torch.where(m, v, 0.0).sum(),
                        m.sum().float(),
                        torch.where(m, v, inf).min() if v.numel() else inf,
                        torch.where(m, v, -inf).max() if v.numel() else -inf,
                    ]
                )  # stays on the device: no sync per call, one at export
            )
            self._reduce[key] = reduce_type

    def scalar(self, **values: float) -> None:
        """Record plain numbers (lr, grad norm, seconds); exported as their mean."""
        for name, value in values.items():
            self._scalars[self._key(name)].append(float(value))

    @contextlib.contextmanager
    def record_timing(self, name: str) -> Iterator[None]:
        """Time the block as scalar `timeperf/<name>` (seconds)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            with self.scope("timeperf"):
                self.scalar(**{name: time.perf_counter() - t0})

    def export(self, reduce_group: Any = None, reset: bool = True) -> dict[str, float]:
        """Reduce everything recorded (across `reduce_group`'s ranks if given) and reset.

        With a group this is collective: every rank of the group must call it. Keys recorded on
        only some ranks are still reduced correctly (absent = zero count).
        """
        keys = self._all_keys(reduce_group)
        # One row per key: [sum, count, min, max]; ranks combine them with 3 all-reduces.
        rows = torch.tensor([self._local_row(k) for k in keys], dtype=torch.float64).reshape(-1, 4)
        if reduce_group is not None and dist.get_world_size(reduce_group) > 1 and len(keys):
            rows = _all_reduce_rows(rows, reduce_group)
        out = {}
        for (kind, key), (s, n, lo, hi) in zip(keys, rows.tolist()):
            out.update(self._format(kind, key, s, n, lo, hi))
        if reset:
            self._reset()
        return out

    def _all_keys(self, group: Any) -> list[tuple[str, str]]:
        keys = {("count", k) for k in self._counts}
        keys |= {("stat", k) for k in self._stats}
        keys |= {("scalar", k) for k in self._scalars}
        mine = sorted(keys)
        if group is None or dist.get_world_size(group) == 1:
            return mine
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, (mine, self._reduce), group=group)
        for _, reduce in gathered:
            self._reduce.update(reduce)
        return sorted(set().union(*(set(map(tuple, k)) for k, _ in gathered)))

    def _local_row(self, kind_key: tuple[str, str]) -> list[float]:
        kind, key = kind_key
        if kind == "count":
            return [float(self._counts.get(key, 0.0)), 0.0, math.inf, -math.inf]
        if kind == "scalar":
            vals = self._scalars.get(key, [])
            return [sum(vals), len(vals), min(vals, default=math.inf), max(vals, default=-math.inf)]
        parts = self._stats.get(key)
        if not parts:
            return [0.0, 0.0, math.inf, -math.inf]
        t = torch.stack(parts).double()
        return torch.stack([t[:, 0].sum(), t[:, 1].sum(), t[:, 2].min(), t[:, 3].max()]).tolist()

    def _format(self, kind: str, key: str, s: float, n: float, lo: float, hi: float):
        if kind == "count":
            return {key: s}
        if n == 0:  # nothing was selected by the mask anywhere: no value to report
            return {}
        if kind == "scalar":
            return {key: s / n}
        reduce = self._reduce.get(key, "avg_min_max")
        if reduce == "avg_min_max":
            return {f"{key}/avg": s / n, f"{key}/min": lo, f"{key}/max": hi}
        return {key: {"avg": s / n, "sum": s, "min": lo, "max": hi}[reduce]}


def _all_reduce_rows(rows: torch.Tensor, group: Any) -> torch.Tensor:
    device = _group_device(group)
    sums = rows[:, :2].contiguous().to(device)
    mins = rows[:, 2].contiguous().to(device)
    maxs = rows[:, 3].contiguous().to(device)
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    dist.all_reduce(mins, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(maxs, op=dist.ReduceOp.MAX, group=group)
    return torch.cat([sums, mins[:, None], maxs[:, None]], dim=1).cpu()


def _group_device(group: Any) -> torch.device:
    # NCCL reduces only CUDA tensors; gloo only CPU ones.
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# Module-level default tracker (`from arealite.trainer import stats_tracker; stats_tracker.stat(...)`).
_TRACKERS: dict[str, StatsTracker] = {"": StatsTracker()}


def get(name: str = "") -> StatsTracker:
    """The process-wide tracker called `name` (created on first use); "" is the default one."""
    if name not in _TRACKERS:
        _TRACKERS[name] = StatsTracker(name)
    return _TRACKERS[name]


DEFAULT_TRACKER = _TRACKERS[""]
scope = DEFAULT_TRACKER.scope
denominator = DEFAULT_TRACKER.denominator
stat = DEFAULT_TRACKER.stat
scalar = DEFAULT_TRACKER.scalar
record_timing = DEFAULT_TRACKER.record_timing
export = DEFAULT_TRACKER.export
