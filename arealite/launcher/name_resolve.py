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
  in `name_resolve_ray.py`. The contract of both: `name_resolve_base.py`.
There is no etcd backend (it would need an etcd server and an etcd v3 client package); the
config accepts only `nfs` and `ray`.

An entry added with `keepalive_ttl` is refreshed by a background thread of the process that
added it and reads as absent once that process stops refreshing it for `keepalive_ttl` seconds,
so a crashed server's address disappears by itself.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid

from arealite.launcher.name_resolve_base import (
    NameEntryExistsError,
    NameEntryNotFoundError,
    NameResolveRepository,
    check_key,
)
from arealite.launcher.name_resolve_ray import RayNameResolveRepository

__all__ = [
    "NameEntryExistsError",
    "NameEntryNotFoundError",
    "NameResolveRepository",
    "FileNameResolveRepository",
    "RayNameResolveRepository",
    "make_repository",
    "check_key",
    "trial_root",
    "servers_root",
    "server_key",
]

_ENTRY_FILE = "ENTRY"


def trial_root(experiment: str, trial: str) -> str:
    """Every key of one trial lives under this prefix."""
    return check_key(f"{experiment}/{trial}")


def servers_root(experiment: str, trial: str) -> str:
    return f"{trial_root(experiment, trial)}/servers"


def server_key(experiment: str, trial: str, index: int) -> str:
    """Key of inference server `index`; zero-padded so key order is index order."""
    return f"{servers_root(experiment, trial)}/{index:05d}"


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
        return RayNameResolveRepository()
    raise ValueError(f"cluster.name_resolve.type={kind!r}: choose one of ['nfs', 'ray']")
