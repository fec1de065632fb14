"""Record and replay the trained batches (`rollout.record: <dir>`, GRPOConfig.mode).

A recording is one JSON-lines file per trainer rank, `<dir>/episodes_rank<r>.jsonl`, one line
per trajectory (one row of the batch a step trained on), appended and flushed step by step so
a crash loses nothing already written:

    {"step", "index" (row in the step's batch), "rows" (the batch's size), "query_id", "text",
     "input_ids", "loss_mask", "logprobs", "versions" (per token), "rewards",
     "seq_no_eos_mask", ..., "dtypes": {key: torch dtype}}

`RecordedBatches` rebuilds a step's batch exactly as it was trained (same rows, same order,
same dtypes and padding), so `mode: train_only` replays a run without inference servers. A
step recorded twice (a resumed or re-run recording appends) is replayed from its last record;
a step cut short by a crash (a partial last line, missing rows) is left out.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from tensordict import TensorDict

from arealite.api.cli_args import ConfigError
from arealite.utils.data import pad_sequences_to_tensors

FILE_PATTERN = "episodes_rank{rank}.jsonl"
logger = logging.getLogger("arealite.record")


def record_path(record_dir: str, rank: int) -> str:
    return os.path.join(record_dir, FILE_PATTERN.format(rank=rank))


class EpisodeRecorder:
    """Appends each trained batch of this rank to its recording file.

    `decode(token_ids) -> str` renders a row's text (the tokenizer's decode)."""

    def __init__(self, record_dir: str, rank: int, decode: Callable[[list[int]], str]):
        os.makedirs(record_dir, exist_ok=True)
        self.path = record_path(record_dir, rank)
        self.decode = decode
        self._file = open(self.path, "a")

    def write(self, step: int, batch: TensorDict, data: Sequence[dict[str, Any]] = ()) -> int:
        """Append the rows of `batch` (step `step`); `data` are the dataset rows its episodes
        came from, in order (each episode's rows are contiguous). Returns the rows written."""
        n = batch.batch_size[0]
        per_item = n // len(data) if data and n % len(data) == 0 else 0
        lengths = batch["attention_mask"].sum(dim=1).tolist()
        length_of_batch = batch["attention_mask"].shape[1]
        lines = []
        for i in range(n):
            item = data[i // per_item] if per_item else {}
            rec: dict[str, Any] = {"step": step, "index": i, "rows": n}
            rec["query_id"] = item.get("query_id")
            rec["text"] = self.decode(batch["input_ids"][i, : lengths[i]].tolist())
            dtypes = {}
            for key, value in batch.items():
                if key == "attention_mask":
                    continue  # rebuilt from the lengths
                if not isinstance(value, torch.Tensor):
                    raise ValueError(
                        f"rollout.record: batch entry {key!r} is not a tensor (a vision "
                        "batch?); recording supports token batches only"
                    )
                row = value[i]
                if value.ndim >= 2 and value.shape[1] == length_of_batch:
                    row = row[: lengths[i]]
                rec[key] = row.tolist()
                dtypes[key] = str(value.dtype).removeprefix("torch.")
            rec["dtypes"] = dtypes
            lines.append(json.dumps(rec))
        self._file.write("".join(line + "\n" for line in lines))
        self._file.flush()
        os.fsync(self._file.fileno())
        return n

    def close(self) -> None:
        self._file.close()


class RecordedBatches:
    """The recorded batches of one rank, by step (see the module docstring)."""

    def __init__(self, record_dir: str | None, rank: int, world_size: int = 1):
        self.path = check_recording(record_dir, world_size)
        self.steps: dict[int, list[dict[str, Any]]] = {}
        with open(record_path(record_dir, rank)) as f:
            lines = f.read().split("\n")
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                if n < len(lines):  # only the last line can be cut by a crash
                    raise ValueError(f"{f.name}:{n}: not a JSON line") from None
                logger.warning(
                    "%s: a partial last line (a crash while recording): left out", f.name
                )
                continue
            rows = self.steps.setdefault(rec["step"], [])
            if rec["index"] == 0:
                rows.clear()  # a step recorded again: its last record wins
            rows.append(rec)
        for step, rows in list(self.steps.items()):
            if len(rows) != rows[0]["rows"]:
                logger.warning(
                    "%s: step %d has %d of its %d rows: left out",
                    f.name,
                    step,
                    len(rows),
                    rows[0]["rows"],
                )
                del self.steps[step]
        if not self.steps:
            raise ConfigError(f"rollout.record={record_dir!r}: {f.name} holds no episodes")

    @property
    def n_steps(self) -> int:
        """Recorded steps 0, 1, ... without a gap."""
        n = 0
        while n in self.steps:
            n += 1
        return n

    def batch(self, step: int) -> TensorDict:
        """Step `step`'s batch as it was trained: rows in order, original dtypes and padding."""
        if step not in self.steps:
            raise KeyError(f"{self.path}: no recorded batch for step {step}")
        rows = []
        for rec in self.steps[step]:
            dtypes = rec["dtypes"]
            rows.append({k: torch.tensor(rec[k], dtype=getattr(torch, dtypes[k])) for k in dtypes})
        return pad_sequences_to_tensors(rows)

    def query_ids(self, step: int) -> list[Any]:
        return [rec["query_id"] for rec in self.steps[step]]


def check_recording(record_dir: str | None, world_size: int = 1) -> str:
    """The recording directory, or a ConfigError naming what is missing (before any engine)."""
    if not record_dir:
        raise ConfigError("mode=train_only reads a recording: set rollout.record=<dir>")
    if not os.path.isdir(record_dir):
        raise ConfigError(f"rollout.record={record_dir!r}: no such directory (mode=train_only)")
    missing = [
        record_path(record_dir, r)
        for r in range(world_size)
        if not os.path.isfile(record_path(record_dir, r))
        or os.path.getsize(record_path(record_dir, r)) == 0
    ]
    if missing:
        raise ConfigError(
            f"rollout.record={record_dir!r}: no episodes for {len(missing)} of {world_size} "
            f"trainer ranks ({', '.join(missing)}); record with the same number of trainer "
            "ranks (mode=rollout_only or a train run with rollout.record set)"
        )
    return record_dir
