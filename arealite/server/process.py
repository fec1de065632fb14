"""Start the embedded server as a real subprocess and wait until it answers /health.

Used by tests, benchmarks, the remote client's tests and the launchers. Stdlib only (plus
arealite.utils), so importing it does not pull in torch.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence

from arealite.utils.network import find_free_port

# Loopback health checks must not go through an HTTP(S)_PROXY from the environment.
_NO_PROXY_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class ServerProcess:
    """A running `python -m arealite.server`; use as a context manager or call stop()."""

    def __init__(self, proc: subprocess.Popen, host: str, port: int, log_path: str, api_key=None):
        self.proc = proc
        self.host = host
        self.port = port
        self.log_path = log_path
        self.api_key = api_key

    @property
    def address(self) -> str:
        """host:port, the form InferenceEngine configs use."""
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n_lines: int = 40) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n_lines:])
        except OSError as e:
            return f"<cannot read {self.log_path}: {e}>"

    def healthy(self, timeout: float = 2.0) -> bool:
        try:
            with _NO_PROXY_OPENER.open(f"{self.url}/health", timeout=timeout) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(
                    f"arealite server exited with code {self.proc.returncode} before becoming "
                    f"healthy; log {self.log_path}:\n{self.log_tail()}"
                )
            if self.healthy():
                return
            time.sleep(0.2)
        raise TimeoutError(
            f"arealite server at {self.address} not healthy after {timeout:.0f}s; "
            f"log {self.log_path}:\n{self.log_tail()}"
        )

    def started(self, timeout: float) -> ServerProcess:
        """This server once healthy; stopped (never left running) when it is not in time."""
        try:
            self.wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM, then SIGKILL after `timeout`; returns the exit code."""
        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"ServerProcess(pid={self.proc.pid}, address={self.address!r}, alive={self.alive()})"


def server_command(
    model_path: str,
    port: int,
    host: str = "127.0.0.1",
    dtype: str = "auto",
    api_key: str | None = None,
    extra_args: Sequence[str] = (),
    python: str | None = None,
) -> list[str]:
    """The argv that starts one server (launchers may wrap it, e.g. in srun)."""
    cmd = [python or sys.executable, "-m", "arealite.server", "--model-path", model_path]
    cmd += ["--host", host, "--port", str(port), "--dtype", dtype]
    if api_key:
        cmd += ["--api-key", api_key]
    return cmd + [str(a) for a in extra_args]


def launch_server(
    model_path: str,
    port: int | None = None,
    host: str = "127.0.0.1",
    dtype: str = "auto",
    api_key: str | None = None,
    extra_args: Sequence[str] = (),
    log_path: str | None = None,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
) -> ServerProcess:
    """Start `python -m arealite.server` and return once /health answers 200.

    With port=None a free port is picked, and picked again (up to 3 tries) if another process
    grabs it first. Raises RuntimeError (process died) or TimeoutError, with the log tail.
    """
    tries = 1 if port else 3
    for attempt in range(tries):
        try:
            return _launch_once(
                model_path,
                port or find_free_port(host),
                host,
                dtype,
                api_key,
                extra_args,
                log_path,
                timeout,
                env,
            )
        except RuntimeError as e:
            if attempt == tries - 1 or "address already in use" not in str(e).lower():
                raise
    raise AssertionError("unreachable")


def _launch_once(model_path, port, host, dtype, api_key, extra_args, log_path, timeout, env):
    if log_path is None:
        fd, log_path = tempfile.mkstemp(prefix=f"arealite-server-{port}-", suffix=".log")
        os.close(fd)
    cmd = server_command(model_path, port, host, dtype, api_key, extra_args)
    child_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env)
    return ServerProcess(proc, host, port, log_path, api_key).started(timeout)
