"""Name resolve: a small key-value registry through which the processes of a run find each other.

Inference servers start wherever the cluster scheduler puts them, so their addresses are not
known in advance: each server registers `host:port` under `server_key(experiment, trial, i)` once
it is healthy, and the launcher waits for the entries there. Keys are `/`-separated paths scoped
by experiment and trial (`trial_root`), so a launcher clears what an earlier run of the same
trial left behind (`clear_subtree(trial_root(...))`) before it starts anything.

Backends (`make_repository`):
- `nfs` (default): a directory per key under a root every node sees (shared filesystem); one
  file per entry, written atomically (temp file + link/rename), so readers never see half a value.
- `ray`: a named, detached Ray actor holding a dict (clusters without a shared filesystem);
  in `name_resolve_ray.py`.
There is no etcd backend (it would need an etcd server and an etcd v3 client package); the
config accepts only `nfs` and `ray`.

An entry added with `keepalive_ttl` is refreshed by a background thread of the process that
added it and reads as absent once that process stops refreshing it for `keepalive_ttl` seconds,
so a crashed server's address disappears by itself.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import threading
import time
import uuid
from abc import ABC, abstractmethod

__all__ = [
    "NameEntryExistsError",
    "NameEntryNotFoundError",
    "NameResolveRepository",
    "FileNameResolveRepository",
    "RayNameResolveRepository",  # noqa: F822 (module __getattr__: name_resolve_ray.py)
    "make_repository",
    "trial_root",
    "servers_root",
    "server_key",
]

_SEGMENT = re.compile(r"^[A-Za-z0-9_.:=+@-]+$")
_ENTRY_FILE = "ENTRY"


class NameEntryExistsError(KeyError):
    """`add(key, ..., replace=False)` found a live entry under `key`."""


class NameEntryNotFoundError(KeyError):
    """No (live) entry under the key."""


def check_key(key: str) -> str:
    """Keys are relative `/`-paths of plain segments: they become directories of the nfs backend."""
    parts = key.split("/")
    if not key or any(p in ("", ".", "..") or not _SEGMENT.match(p) for p in parts):
        raise ValueError(
            f"bad name_resolve key {key!r}: use '/'-separated segments of letters, digits and "
            "'_.:=+@-' (no empty, '.' or '..' segments, no leading '/')"
        )
    return key


def trial_root(experiment: str, trial: str) -> str:
    """Every key of one trial lives under this prefix."""
    return check_key(f"{experiment}/{trial}")


def servers_root(experiment: str, trial: str) -> str:
    return f"{trial_root(experiment, trial)}/servers"


def server_key(experiment: str, trial: str, index: int) -> str:
    """Key of inference server `index`; zero-padded so key order is index order."""
    return f"{servers_root(experiment, trial)}/{index:05d}"


def _under(key: str, prefix: str) -> bool:
    return key == prefix or key.startswith(prefix.rstrip("/") + "/")


class NameResolveRepository(ABC):
    """The contract every backend fulfils; values are strings (JSON-encode structured data)."""

    def __init__(self):
        self._owned: set[str] = set()  # keys to delete on exit
        self._keepalive: dict[str, float] = {}  # key -> ttl
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        atexit.register(self.reset)

    # -- backend primitives
    @abstractmethod
    def _put(self, key: str, value: str, replace: bool, ttl: float | None) -> bool:
        """Store; False when a live entry exists and `replace` is False."""

    @abstractmethod
    def _get(self, key: str) -> str | None:
        """The live value, or None."""

    @abstractmethod
    def _keys(self, prefix: str) -> list[str]:
        """Sorted keys of live entries equal to or under `prefix`."""

    @abstractmethod
    def _delete(self, key: str) -> bool:
        """Remove; False when there was nothing."""

    @abstractmethod
    def _clear(self, prefix: str) -> None: ...

    @abstractmethod
    def _refresh(self, key: str) -> None:
        """Mark a keepalive entry as alive now."""

    # -- public API
    def add(
        self,
        key: str,
        value: str,
        replace: bool = False,
        delete_on_exit: bool = False,
        keepalive_ttl: float | None = None,
    ) -> None:
        """Register `value` under `key`. With `keepalive_ttl` the entry lives only while this
        process keeps refreshing it; with `delete_on_exit` this process removes it when it exits."""
        check_key(key)
        if not isinstance(value, str):
            raise TypeError(f"name_resolve values are strings; got {type(value).__name__}")
        if keepalive_ttl is not None and keepalive_ttl <= 0:
            raise ValueError(f"keepalive_ttl must be > 0, got {keepalive_ttl}")
        if not self._put(key, value, replace, keepalive_ttl):
            raise NameEntryExistsError(f"name_resolve entry {key!r} already exists")
        with self._lock:
            if delete_on_exit:
                self._owned.add(key)
            if keepalive_ttl is not None:
                self._keepalive[key] = keepalive_ttl
                self._start_keepalive()

    def get(self, key: str) -> str:
        value = self._get(check_key(key))
        if value is None:
            raise NameEntryNotFoundError(f"no name_resolve entry {key!r}")
        return value

    def find_subtree(self, prefix: str) -> list[str]:
        """Keys under `prefix`, sorted."""
        return self._keys(check_key(prefix))

    def get_subtree(self, prefix: str) -> list[str]:
        """Values under `prefix`, in key order (entries that vanish meanwhile are skipped)."""
        values = (self._get(k) for k in self.find_subtree(prefix))
        return [v for v in values if v is not None]

    def wait(self, key: str, timeout: float | None = None, poll: float = 0.2) -> str:
        """Block until `key` has a value; TimeoutError naming the key after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            value = self._get(check_key(key))
            if value is not None:
                return value
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"name_resolve entry {key!r} did not appear within {timeout}s")
            time.sleep(poll)

    def delete(self, key: str) -> None:
        with self._lock:
            self._owned.discard(key)
            self._keepalive.pop(key, None)
        if not self._delete(check_key(key)):
            raise NameEntryNotFoundError(f"no name_resolve entry {key!r}")

    def clear_subtree(self, prefix: str) -> None:
        """Remove every entry under `prefix` (e.g. what an earlier run of this trial left)."""
        check_key(prefix)
        with self._lock:
            self._owned = {k for k in self._owned if not _under(k, prefix)}
            self._keepalive = {k: t for k, t in self._keepalive.items() if not _under(k, prefix)}
        self._clear(prefix)

    def reset(self) -> None:
        """Stop keepalives and delete the entries this process added with `delete_on_exit`."""
        self._stop.set()
        with self._lock:
            owned, self._owned = self._owned, set()
            self._keepalive.clear()
        for key in owned:
            try:
                self._delete(key)
            except Exception:  # noqa: BLE001 - best effort at interpreter exit
                pass

    # -- keepalive
    def _start_keepalive(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._keepalive_loop, daemon=True)
        self._thread.start()

    def _keepalive_loop(self) -> None:
        while True:
            with self._lock:
                entries = dict(self._keepalive)
            if not entries:
                return
            for key in entries:
                try:
                    self._refresh(key)
                except Exception:  # noqa: BLE001 - a missed refresh is retried next period
                    pass
            if self._stop.wait(min(entries.values()) / 3):
                return


# --------------------------------------------------------------------------------------- nfs


class FileNameResolveRepository(NameResolveRepository):
    """Entries as files `<root>/<key>/ENTRY` on a filesystem every process of the run sees."""

    def __init__(self, root: str):
        super().__init__()
        self.root = os.path.abspath(root)
        os.makedirs(self.root, exist_ok=True)

    def _path(self, key: str) -> str:
        return os.path.join(self.root, key, _ENTRY_FILE)

    def _read(self, path: str) -> str | None:
        try:
            with open(path) as f:
                record = json.load(f)
            age = time.time() - os.stat(path).st_mtime
        except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
            return None
        ttl = record.get("keepalive_ttl")
        return None if ttl is not None and age > ttl else record["value"]

    def _put(self, key, value, replace, ttl):
        path = self._path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{uuid.uuid4().hex}.tmp"
        with open(tmp, "w") as f:
            json.dump({"value": value, "keepalive_ttl": ttl}, f)
        try:
            if replace:
                os.replace(tmp, path)
                return True
            try:
                os.link(tmp, path)  # atomic create-if-absent: concurrent adders cannot both win
                return True
            except FileExistsError:
                if self._read(path) is not None:
                    return False
                os.replace(tmp, path)  # an expired (or unreadable) entry counts as absent
                return True
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)

    def _get(self, key):
        return self._read(self._path(key))

    def _keys(self, prefix):
        base = os.path.join(self.root, prefix)
        keys = []
        for dirpath, _, files in os.walk(base):
            if _ENTRY_FILE in files and self._read(os.path.join(dirpath, _ENTRY_FILE)) is not None:
                keys.append(os.path.relpath(dirpath, self.root).replace(os.sep, "/"))
        return sorted(keys)

    def _delete(self, key):
        try:
            os.remove(self._path(key))
        except (FileNotFoundError, NotADirectoryError):
            return False
        self._prune(os.path.join(self.root, key))
        return True

    def _prune(self, directory: str) -> None:
        """Remove now-empty directories up to (not including) the root."""
        while directory != self.root and directory.startswith(self.root):
            try:
                os.rmdir(directory)
            except OSError:
                return
            directory = os.path.dirname(directory)

    def _clear(self, prefix):
        shutil.rmtree(os.path.join(self.root, prefix), ignore_errors=True)

    def _refresh(self, key):
        os.utime(self._path(key))


def make_repository(config, fileroot: str) -> NameResolveRepository:
    """The repository `config` (a cli_args.NameResolveConfig) selects; nfs defaults to
    `<fileroot>/name_resolve`."""
    kind = getattr(config, "type", "nfs")
    if kind == "nfs":
        root = config.nfs_record_root or os.path.join(fileroot, "name_resolve")
        return FileNameResolveRepository(root)
    if kind == "ray":
        from arealite.utils.name_resolve_ray import RayNameResolveRepository

        return RayNameResolveRepository()
    raise ValueError(f"cluster.name_resolve.type={kind!r}: choose one of ['nfs', 'ray']")


def __getattr__(name: str):
    """`RayNameResolveRepository` lives in `name_resolve_ray.py` (imported on first use)."""
    if name == "RayNameResolveRepository":
        from arealite.utils.name_resolve_ray import RayNameResolveRepository

        return RayNameResolveRepository
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
