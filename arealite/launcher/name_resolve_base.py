"""The contract of a name-resolve backend (`NameResolveRepository`: add / get / wait / delete
/ subtrees, entries owned by this process deleted on exit, keepalive refreshes) and the key
rules; the backends are in `name_resolve.py` (files) and `name_resolve_ray.py` (a Ray actor).
"""

from __future__ import annotations

import atexit
import re
import threading
import time
from abc import ABC, abstractmethod

__all__ = ["NameEntryExistsError", "NameEntryNotFoundError", "NameResolveRepository", "check_key"]

_SEGMENT = re.compile(r"^[A-Za-z0-9_.:=+@-]+$")


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
