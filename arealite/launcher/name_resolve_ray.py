"""The Ray backend of name resolve: entries in one named, detached Ray actor.

For clusters without a shared filesystem (`cluster.name_resolve.type=ray`); the contract is in
`name_resolve_base.py`, the keys, the file backend and `make_repository` in `name_resolve.py`.
The actor's clock is the TTL clock.
"""

from __future__ import annotations

import time

from arealite.launcher.name_resolve_base import NameResolveRepository, _under

__all__ = ["RayNameResolveRepository"]


class _KVStore:
    """The state of the Ray backend: lives in one named detached actor (its clock is the TTL clock)."""

    def __init__(self):
        self.entries: dict[str, tuple[str, float | None, float]] = {}

    def _live(self, key: str) -> bool:
        entry = self.entries.get(key)
        if entry is None:
            return False
        _, ttl, stamp = entry
        return ttl is None or time.monotonic() - stamp <= ttl

    def put(self, key: str, value: str, replace: bool, ttl: float | None) -> bool:
        if not replace and self._live(key):
            return False
        self.entries[key] = (value, ttl, time.monotonic())
        return True

    def get(self, key: str) -> str | None:
        return self.entries[key][0] if self._live(key) else None

    def keys(self, prefix: str) -> list[str]:
        return sorted(k for k in self.entries if _under(k, prefix) and self._live(k))

    def delete(self, key: str) -> bool:
        return self.entries.pop(key, None) is not None

    def clear(self, prefix: str) -> None:
        for k in [k for k in self.entries if _under(k, prefix)]:
            del self.entries[k]

    def refresh(self, key: str) -> None:
        if key in self.entries:
            value, ttl, _ = self.entries[key]
            self.entries[key] = (value, ttl, time.monotonic())


class RayNameResolveRepository(NameResolveRepository):
    """Entries in a named detached Ray actor, shared by every process connected to the cluster.

    Connects with `ray.init(address)` when this process is not connected yet (`"auto"` finds the
    cluster this node belongs to). The actor outlives the launcher until `kill_store()`.
    """

    ACTOR_NAME = "arealite_name_resolve"
    NAMESPACE = "arealite"

    def __init__(self, address: str | None = "auto"):
        super().__init__()
        try:
            import ray
        except ImportError:
            raise ImportError(
                "cluster.name_resolve.type=ray needs Ray: pip install 'ray[default]' "
                "(the `ray` extra of arealite)"
            ) from None
        self._ray = ray
        if not ray.is_initialized():
            ray.init(address=address, log_to_driver=False)
        self._store = (
            ray.remote(num_cpus=0)(_KVStore)
            .options(
                name=self.ACTOR_NAME,
                namespace=self.NAMESPACE,
                lifetime="detached",
                get_if_exists=True,
            )
            .remote()
        )

    def _call(self, method: str, *args):
        return self._ray.get(getattr(self._store, method).remote(*args))

    def _put(self, key, value, replace, ttl):
        return self._call("put", key, value, replace, ttl)

    def _get(self, key):
        return self._call("get", key)

    def _keys(self, prefix):
        return self._call("keys", prefix)

    def _delete(self, key):
        return self._call("delete", key)

    def _clear(self, prefix):
        self._call("clear", prefix)

    def _refresh(self, key):
        self._call("refresh", key)

    def reset(self) -> None:
        if self._ray.is_initialized():
            super().reset()

    def kill_store(self) -> None:
        """Remove the detached actor (and every entry of every run it held)."""
        self._ray.kill(self._store)
