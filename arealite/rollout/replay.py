"""Which dataloader items the executor pulled ahead of the trainer, for exact recovery.

`prepare_batch` pulls dataloader batches ahead of training, so at a checkpoint some pulled items
are queued, running or finished but not yet trained on. The state records the dataloader
position before the oldest such batch and which of its items (and of the later batches) are
done; after a restore the feed replays from there, skipping the done items: no item is trained
twice or skipped.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

Cursor = tuple[int, int]  # (pulled batch number, index in it)


@dataclass
class PulledBatch:
    """A dataloader batch whose items are not all done yet."""

    position: Any  # dataloader.state_dict() just before it was pulled
    size: int
    done: set[int]  # indices trained on (results consumed), rejected or failed


class DataloaderFeed:
    """Rows out of a dataloader, each with a cursor, replaying a restored state first.

    Thread-safe: `next_batch` runs on the trainer's thread, `mark_done` also on the loop's.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._pulled: dict[int, PulledBatch] = {}  # by batch number, oldest first
        self._n_pulled = 0
        self._dataloader: Any = None
        self._data_iter: Any = None
        self._replay: dict[str, Any] | None = None  # from load_state_dict, used at next pull
        self._replay_done: list[set[int]] = []  # done indices of the batches being replayed

    def next_batch(self, dataloader: Any) -> list[tuple[Cursor, dict[str, Any]]]:
        """The next dataloader batch as (cursor, row) pairs, without the rows a restored state
        marks done (an empty list when all of a replayed batch is done). Restarts the
        dataloader at epoch end."""
        if self._replay is not None:
            self._start_replay(dataloader)
        elif self._dataloader is not dataloader:
            self._dataloader, self._data_iter = dataloader, iter(dataloader)
        position = _position(dataloader)
        try:
            batch = next(self._data_iter)
        except StopIteration:
            self._data_iter = iter(dataloader)
            position = _position(dataloader)
            try:
                batch = next(self._data_iter)
            except StopIteration:
                raise ValueError("prepare_batch: the dataloader yields no data") from None
        rows = _rows(batch)
        done = self._replay_done.pop(0) if self._replay_done else set()
        number = self._n_pulled
        self._n_pulled += 1
        with self._lock:
            if len(done) < len(rows):
                self._pulled[number] = PulledBatch(position, len(rows), set(done))
        return [((number, i), row) for i, row in enumerate(rows) if i not in done]

    def _start_replay(self, dataloader: Any) -> None:
        """Rewind the dataloader to the oldest batch that was not fully done at the checkpoint."""
        replay, self._replay = self._replay, None
        if replay["position"] is not None:
            dataloader.load_state_dict(replay["position"])
        self._dataloader, self._data_iter = dataloader, iter(dataloader)
        self._replay_done = [set(d) for d in replay["done"]]

    def mark_done(self, cursor: Cursor | None) -> None:
        """The item at `cursor` needs no replay after a restart."""
        if cursor is None:
            return
        number, index = cursor
        with self._lock:
            pulled = self._pulled.get(number)
            if pulled is not None:
                pulled.done.add(index)
                if len(pulled.done) == pulled.size:
                    del self._pulled[number]

    def pending(self) -> int:
        """Pulled items not done yet (queued, running, or finished and not consumed)."""
        with self._lock:
            return sum(b.size - len(b.done) for b in self._pulled.values())

    def state_dict(self) -> dict[str, Any]:
        """`position` (None = the dataloader's own state) and the done items after it."""
        with self._lock:
            oldest = next(iter(self._pulled.values()), None)
            return {
                "position": None if oldest is None else oldest.position,
                "done": [sorted(b.done) for b in self._pulled.values()],
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replay from `state` at the next pull (when it names a position or done items)."""
        if state.get("position") is not None or state.get("done"):
            self._replay = {"position": state.get("position"), "done": state["done"]}


def _rows(batch: Any) -> list[Any]:
    if isinstance(batch, dict):  # default collate: dict of columns -> rows
        n = len(next(iter(batch.values())))
        return [{k: v[i] for k, v in batch.items()} for i in range(n)]
    return list(batch)


def _position(dataloader: Any) -> Any:
    """The dataloader's resumable position (StatefulDataLoader), or None."""
    state_dict = getattr(dataloader, "state_dict", None)
    return state_dict() if callable(state_dict) else None
