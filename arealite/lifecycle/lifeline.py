"""Processes of a run die with the process that started them.

A `kill -9` of a launcher or of a torchrun agent runs no cleanup code, so the children must notice
by themselves, or they keep training, writing checkpoints and holding GPUs as orphans:

- `die_with_parent` (a Popen `preexec_fn`): the kernel sends the child SIGKILL when its parent
  dies (Linux `PR_SET_PDEATHSIG`). Launchers start servers and torchrun agents with it.
- `watch_parent`: a daemon thread for trainer ranks (started by torchrun, or by the launcher
  directly when there is one rank): it kills this process and its children (reward pools'
  forkservers, ...) once the parent pid changes, or once the launcher's heartbeat file
  (`$AREAL_LAUNCHER_HEARTBEAT`, written by launchers whose jobs run elsewhere, e.g. Slurm)
  stops changing.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time

logger = logging.getLogger("arealite.lifeline")

PR_SET_PDEATHSIG = 1
# A file whose mtime the launcher bumps every HEARTBEAT_INTERVAL_S; its jobs exit when it stops.
LAUNCHER_HEARTBEAT_ENV = "AREAL_LAUNCHER_HEARTBEAT"
# Set by launchers for the trainer processes: their parent (a torchrun agent, a Ray actor) is
# watched. Not by default: a script run by hand under `nohup` must outlive its shell.
WATCH_PARENT_ENV = "AREAL_WATCH_PARENT"
# The pid to watch when the launcher itself is the parent: a trainer rank may start its watch
# seconds after a `kill -9` of the launcher, when getppid() already names init.
WATCHED_PARENT_PID_ENV = "AREAL_WATCHED_PARENT_PID"
LAUNCHER_HEARTBEAT_TTL_ENV = "AREAL_LAUNCHER_HEARTBEAT_TTL"
HEARTBEAT_INTERVAL_S = 2.0
DEFAULT_HEARTBEAT_TTL_S = 30.0  # shared filesystems may cache mtimes for a few seconds


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send `sig` to this process when its parent exits (False off Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig)) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent() -> None:
    """Popen `preexec_fn`: the child gets SIGKILL when the launcher dies. The signal follows the
    *thread* that forked the child, so call Popen from a thread that lives as long as the child
    is meant to (the main thread, or a per-child monitor thread)."""
    parent = os.getppid()
    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the prctl took effect
        os._exit(1)


def _kill_self_and_children(reason: str) -> None:
    try:  # the launcher that read our output may be gone: a broken pipe must not stop us
        print(f"[lifeline] pid {os.getpid()}: {reason}; exiting", file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass
    try:
        import psutil

        for child in psutil.Process().children(recursive=True):
            try:
                child.kill()
            except psutil.Error:
                pass
    except Exception:  # noqa: BLE001 - dying anyway
        pass
    os.kill(os.getpid(), signal.SIGKILL)


class _HeartbeatWatch:
    """Stale once the file's mtime has not changed for `ttl` seconds of our own clock (clocks of
    different nodes may disagree, so mtimes are only compared with each other)."""

    def __init__(self, path: str, ttl: float):
        self.path, self.ttl = path, ttl
        self.last_mtime, self.last_change = self._mtime(), time.monotonic()

    def _mtime(self) -> float | None:
        try:
            return os.stat(self.path).st_mtime
        except OSError:
            return None

    def stale(self) -> bool:
        mtime = self._mtime()
        if mtime != self.last_mtime:
            self.last_mtime, self.last_change = mtime, time.monotonic()
        return time.monotonic() - self.last_change > self.ttl


def watch_parent(interval: float = 0.5) -> threading.Thread:
    """Exit (with every child of this process) as soon as the parent dies or the launcher's
    heartbeat goes stale. Cheap: one getppid() and at most one stat() per interval."""
    # No PDEATHSIG here: a parent thread that exits would fire it.
    parent = int(os.environ.get(WATCHED_PARENT_PID_ENV) or os.getppid())
    hb_path = os.environ.get(LAUNCHER_HEARTBEAT_ENV)
    ttl = float(os.environ.get(LAUNCHER_HEARTBEAT_TTL_ENV, DEFAULT_HEARTBEAT_TTL_S))
    heartbeat = _HeartbeatWatch(hb_path, ttl) if hb_path else None

    def run() -> None:
        while True:
            time.sleep(interval)
            if os.getppid() != parent:
                _kill_self_and_children(f"parent pid {parent} died")
            if heartbeat is not None and heartbeat.stale():
                _kill_self_and_children(
                    f"launcher heartbeat {hb_path} unchanged for {ttl:.0f}s (launcher gone)"
                )

    thread = threading.Thread(target=run, name="lifeline", daemon=True)
    thread.start()
    return thread


class HeartbeatWriter(threading.Thread):
    """The launcher side: bump the heartbeat file's mtime every HEARTBEAT_INTERVAL_S."""

    def __init__(self, path: str, interval: float = HEARTBEAT_INTERVAL_S):
        super().__init__(name="launcher-heartbeat", daemon=True)
        self.path, self.interval, self.done = path, interval, threading.Event()
        self.beat()

    def beat(self) -> None:
        with open(self.path, "a"):
            pass
        os.utime(self.path)

    def run(self) -> None:
        while not self.done.wait(self.interval):
            try:
                self.beat()
            except OSError as e:
                logger.warning("cannot write the launcher heartbeat %s: %s", self.path, e)

    def stop(self) -> None:
        self.done.set()
