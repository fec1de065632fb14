"""One owner per run directory.

Two trainers on one run directory (an orphan beside a retry, or the same command typed twice)
interleave their recover checkpoints and push weights to the same servers. The trainer's rank 0
therefore holds `<run_dir>/run.lock` for the whole run:

- `flock` where the filesystem has it: the kernel drops the lock when the holder dies, however it
  dies, so a lock left by a dead process is simply taken over (and logged);
- otherwise (some shared filesystems) a lease: the holder rewrites the file every `ttl / 3`
  seconds, and a lease not renewed for `ttl` seconds (or held by a dead pid on this host) may be
  taken over. A holder that finds its lease taken exits at once.

The file says who holds it (host, pid, start time) and carries a fencing token that grows with
every new owner. The owner exports it (`$AREAL_RUN_FENCING_TOKEN`); the inference client sends it
with weight updates and the embedded server refuses updates from an older owner, so a stray
trainer can never roll the weights back, while a resumed owner may restore an older version.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import threading
import time
import uuid

logger = logging.getLogger("arealite.run_lock")

LOCK_FILE = "run.lock"
FENCING_TOKEN_ENV = "AREAL_RUN_FENCING_TOKEN"
RUN_LOCK_MODE_ENV = "AREAL_RUN_LOCK"  # "flock" (default, lease where unsupported) | "lease"
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class RunLockHeld(RuntimeError):
    """Another live process owns the run directory; the message names it."""


def _describe(holder: dict) -> str:
    started = holder.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if started else "?"
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')} (started {when})"


def _pid_alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, TypeError, ValueError):
        return True
    return True


class RunLock:
    """`with RunLock(run_dir):` or `acquire()` / `release()`; see the module docstring."""

    def __init__(self, run_dir: str, ttl: float = 60.0, mode: str | None = None):
        self.run_dir = os.path.abspath(run_dir)
        self.path = os.path.join(self.run_dir, LOCK_FILE)
        self.ttl = ttl
        self.mode = mode or os.environ.get(RUN_LOCK_MODE_ENV, "flock")
        self.token: int | None = None
        self._fd: int | None = None
        self._nonce = uuid.uuid4().hex
        self._renewer: threading.Thread | None = None
        self._stop = threading.Event()

    # ------------------------------------------------------------------ file content

    def _read(self) -> dict:
        try:
            with open(self.path) as f:
                data = json.load(f)
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def _record(self) -> dict:
        return {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": self._started,
            "token": self.token,
            "mode": self.mode,
            "renewed": time.time(),
            "ttl": self.ttl,
            "nonce": self._nonce,
            "released": False,
        }

    def _write(self, record: dict) -> None:
        """Write a complete file and rename it into place: a reader never sees half of it."""
        tmp = f"{self.path}.{self._nonce}.tmp"
        with open(tmp, "w") as f:
            json.dump(record, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    # ------------------------------------------------------------------ acquire / release

    def acquire(self) -> int:
        """Take the lock (RunLockHeld naming the holder if a live process has it); returns the
        fencing token, also exported as $AREAL_RUN_FENCING_TOKEN."""
        os.makedirs(self.run_dir, exist_ok=True)
        self._started = time.time()
        previous = self._take_flock() if self.mode == "flock" else None
        if self.mode == "lease":
            previous = self._take_lease()
        if previous and not previous.get("released"):
            logger.warning(
                "run directory %s: taking over the lock left by %s, which is gone",
                self.run_dir,
                _describe(previous),
            )
        self.token = self._next_token(previous)
        self._write(self._record())
        if self.mode == "lease":
            self._confirm_lease()
            self._renewer = threading.Thread(target=self._renew, name="run-lock", daemon=True)
            self._renewer.start()
        os.environ[FENCING_TOKEN_ENV] = str(self.token)
        logger.info(
            "run directory %s locked (%s, fencing token %d)", self.run_dir, self.mode, self.token
        )
        return self.token

    @staticmethod
    def _next_token(previous: dict | None) -> int:
        token = (previous or {}).get("token")
        if isinstance(token, int) and not isinstance(token, bool):
            return token + 1
        return 1 if not previous else int(time.time())  # unreadable: still above any counter

    def _take_flock(self) -> dict | None:
        """flock a separate `.flock` file (the record itself is replaced by renames)."""
        fd = os.open(f"{self.path}.flock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise self._held(self._read()) from None
        except OSError as e:
            os.close(fd)
            if e.errno not in _NO_FLOCK:
                raise
            logger.warning("%s: no flock on this filesystem (%s); using a lease", self.path, e)
            self.mode = "lease"
            return None
        self._fd = fd
        return self._read()

    def _take_lease(self) -> dict:
        holder = self._read()
        if holder and not holder.get("released") and self._lease_live(holder):
            raise self._held(holder)
        return holder

    def _lease_live(self, holder: dict) -> bool:
        if holder.get("host") == socket.gethostname() and not _pid_alive(holder.get("pid")):
            return False
        age = time.time() - float(holder.get("renewed") or 0)
        return age < float(holder.get("ttl") or self.ttl)

    def _confirm_lease(self) -> None:
        """Two takers at once: both wrote, the last rename won; the loser backs off."""
        time.sleep(0.2)
        holder = self._read()
        if holder.get("nonce") != self._nonce:
            raise self._held(holder)

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            holder = self._read()
            if holder.get("nonce") != self._nonce:
                logger.critical(
                    "run directory %s: lease taken over by %s; exiting (one owner per run)",
                    self.run_dir,
                    _describe(holder),
                )
                os._exit(75)
            self._write(self._record())

    def _held(self, holder: dict) -> RunLockHeld:
        who = _describe(holder) if holder else "another process"
        return RunLockHeld(
            f"run directory {self.run_dir} is in use by {who} (lock {self.path}): stop that run "
            "first, or pick another trial_name"
        )

    def release(self) -> None:
        """Mark the record released (the next owner logs no takeover) and drop the lock."""
        if self.token is None:
            return
        self._stop.set()
        record = self._record()
        record["released"] = True
        try:
            self._write(record)
        except OSError as e:
            logger.warning("cannot mark %s released: %s", self.path, e)
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None
        self.token = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def fencing_token() -> int | None:
    """This process's fencing token, when it owns a run directory."""
    value = os.environ.get(FENCING_TOKEN_ENV, "")
    return int(value) if value.strip().isdigit() else None


def claim_run_dir(run_dir: str, rank: int) -> RunLock | None:
    """Where a trainer starts: every rank dies with its launcher (`lifeline.watch_parent`, when a
    launcher asked for it), and rank 0 owns the run directory until it exits."""
    import atexit

    from arealite.lifecycle.lifeline import WATCH_PARENT_ENV, watch_parent

    if os.environ.get(WATCH_PARENT_ENV) == "1":
        watch_parent()
    if rank != 0:
        return None
    lock = RunLock(run_dir)
    lock.acquire()
    atexit.register(lock.release)  # a clean exit leaves no "taken over" warning behind
    return lock
