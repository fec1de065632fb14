"""Which weight updates a server accepts.

- Paths: only directories under the allowed roots (the launcher passes the run's weight
  directory and the initial model; a standalone server allows its model's folder unless told
  otherwise). The path is resolved (`realpath`) and every file in the directory is checked
  before anything is read, so a symlink that leads out of the roots is refused too (HTTP 403).
- Versions: a server never goes back to an older version (HTTP 409), so a stray trainer cannot
  roll the weights back. A newer owner of the run (a higher fencing token, see
  `arealite.lifecycle.run_lock`) may: a resumed run restores the version of its last checkpoint.
"""

from __future__ import annotations

import os
import threading

from arealite.server.protocol import BadRequest


class WeightRefused(Exception):
    """A weight update this server will not apply; `status` is the HTTP answer."""

    def __init__(self, status: int, message: str, **detail):
        super().__init__(message)
        self.status, self.message, self.detail = status, message, detail


def _inside(path: str, roots: list[str]) -> bool:
    return any(os.path.commonpath([path, root]) == root for root in roots)


def resolve_weight_dir(path: str, roots: list[str]) -> str:
    """The real directory to load from; WeightRefused (403) outside the roots, (400) not a dir.
    Only names are looked at here (realpath, listdir, stat): no file content is read."""
    real = os.path.realpath(path)
    if not _inside(real, roots):
        raise WeightRefused(403, f"model_path: {path} is outside the allowed weight roots {roots}")
    if not os.path.isdir(real):
        raise WeightRefused(400, f"model_path: {path} is not a directory")
    for name in sorted(os.listdir(real)):
        target = os.path.realpath(os.path.join(real, name))
        if not _inside(target, roots):
            raise WeightRefused(
                403, f"model_path: {path}/{name} links outside the allowed weight roots {roots}"
            )
    return real


class VersionGate:
    """(fencing token, version) of the weights served; updates must not go back."""

    def __init__(self) -> None:
        self.token = 0
        self._lock = threading.Lock()

    def check(self, token: int | None, version: int, served: int) -> None:
        """WeightRefused (409) for an older owner, or for an older version of the same owner.
        No token: the current owner (a client that does not send one, e.g. SGLang's)."""
        with self._lock:
            current = self.token
        token = current if token is None else token
        if token < current:
            raise WeightRefused(
                409,
                f"weight update refused: fencing token {token} is older than {current}, the "
                "run's current owner (a stray trainer?)",
                served_version=served,
                fencing_token=current,
            )
        if token == current and version < served:
            raise WeightRefused(
                409,
                f"weight update refused: version {version} is older than the served version "
                f"{served} (versions only move forward)",
                served_version=served,
                fencing_token=current,
            )

    def accept(self, token: int | None) -> None:
        if token is not None:
            with self._lock:
                self.token = max(self.token, token)


def parse_fencing_token(value) -> int | None:
    if value is None:
        return None
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise BadRequest(f"fencing_token: expected a non-negative integer, got {value!r}")
