"""Abort requests recorded by the HTTP thread and applied by the scheduler thread between steps.

Waiting sequences hold no model state, so they leave the queue at once; running ones are only
marked here, because the runner's batch belongs to the scheduler thread. All methods run under
the scheduler's lock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from arealite.server.model_runner import ModelRunner, Sequence


class PendingAborts:
    """What must end as aborted before the next decoding step."""

    def __init__(self) -> None:
        self.waiting: list[Sequence] = []  # already out of the queue, never started
        self.everything = False
        self.rids: set[str] = set()
        self.ids: set[int] = set()  # id(seq) of single submissions to abort

    def __bool__(self) -> bool:
        return bool(self.waiting or self.everything or self.rids or self.ids)

    def add_rid(self, rid: str) -> None:
        """Abort every sequence of request `rid` at the next step (waiting ones: pull_waiting)."""
        self.rids.add(rid)

    def add_sequence(self, seq: Sequence) -> None:
        """Abort exactly this submission at the next step, if it is running by then."""
        self.ids.add(id(seq))

    def pull_waiting(self, queue: deque[Sequence], hit: Callable[[Sequence], bool]) -> bool:
        """Move the queued sequences `hit` selects here; whether there were any."""
        found = [s for s in queue if hit(s)]
        for s in found:
            queue.remove(s)
        self.waiting.extend(found)
        return bool(found)

    def abort_everything(self, queue: deque[Sequence]) -> None:
        """Every queued sequence and every running row."""
        self.waiting.extend(queue)
        queue.clear()
        self.everything = True

    def take(self, runner: ModelRunner, weight_version: int) -> list[Sequence]:
        """The waiting and running sequences that end now, marked aborted; clears the requests."""
        aborted, self.waiting = self.waiting, []
        for s in aborted:  # no tokens: the answer reports the weights this server serves now
            s.finish_reason = {"type": "abort", "message": "aborted before it started"}
            s.weight_version = weight_version
        if self.everything or self.rids or self.ids:
            every, rids, ids = self.everything, self.rids, self.ids
            aborted += runner.abort(
                lambda s: every or s.rid in rids or id(s) in ids,
                "aborted by pause_generation, abort_request or a client disconnect",
            )
        self.everything, self.rids, self.ids = False, set(), set()
        return aborted
