"""Child processes that live and die together: each in its own session, logged to a file,
torn down as a group on exit, on Ctrl-C, or as soon as any one of them fails; and killed by the
kernel when the launcher itself is killed (`die_with_parent`), so a `kill -9` leaves no orphans."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from arealite.lifecycle.lifeline import die_with_parent

logger = logging.getLogger("arealite.launcher")


class LaunchError(RuntimeError):
    """A process of the run failed; the message names it and shows its log tail."""


def failed_ranks_summary(log_path: str) -> str:
    """'rank 1 exited with code 3' from torchrun's failure report, when it printed one."""
    try:
        text = open(log_path, errors="replace").read()
    except OSError:
        return "failing rank unknown"
    found = re.findall(r"rank\s*:\s*(\d+) \(local_rank.*?\n\s*exitcode\s*:\s*(-?\d+)", text)
    if not found:
        return "failing rank unknown"
    return ", ".join(f"rank {r} exited with code {c}" for r, c in dict(found).items())


def log_tail(path: str, n_lines: int = 30) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n_lines:])
    except OSError:
        return "(no log)"


@dataclass
class Child:
    name: str
    popen: subprocess.Popen
    log_path: str
    critical: bool = True
    threads: list[threading.Thread] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)  # as started (to restart it the same way)
    env: dict[str, str] = field(default_factory=dict)  # extra environment it was started with

    def alive(self) -> bool:
        return self.popen.poll() is None


def _tee(src, log_file, prefix: str) -> None:
    """Copy a child's output to its log file and, prefixed, to our stdout."""
    for line in iter(src.readline, b""):
        log_file.write(line)
        log_file.flush()
        sys.stdout.write(prefix + line.decode(errors="replace"))
        sys.stdout.flush()
    log_file.close()


class ProcessSet:
    """Start children, watch them, and stop all of them (process groups, TERM then KILL)."""

    def __init__(self, log_dir: str):
        self.log_dir = log_dir
        os.makedirs(log_dir, exist_ok=True)
        self.children: dict[str, Child] = {}

    def start(
        self,
        name: str,
        cmd: list[str],
        env: dict[str, str] | None = None,
        stream: bool = False,
        critical: bool = True,
        watches_parent: bool = False,
    ) -> Child:
        """`watches_parent`: the child runs its own `lifeline.watch_parent`, which takes its
        children along when the launcher dies; the kernel's SIGKILL would orphan them."""
        log_path = os.path.join(self.log_dir, f"{name}.log")
        full_env = {**os.environ, **(env or {})}
        log_file = open(log_path, "ab")  # noqa: SIM115 - closed by the tee thread / on exit
        log_file.write(f"$ {' '.join(cmd)}\n".encode())
        log_file.flush()
        out = subprocess.PIPE if stream else log_file
        # Called from the launcher's main thread, which lives as long as the launcher: the
        # parent-death signal fires exactly when the launcher dies.
        popen = subprocess.Popen(
            cmd,
            env=full_env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=None if watches_parent else die_with_parent,
        )
        child = Child(name, popen, log_path, critical, cmd=list(cmd), env=dict(env or {}))
        if stream:
            t = threading.Thread(target=_tee, args=(popen.stdout, log_file, ""), daemon=True)
            t.start()
            child.threads.append(t)
        else:
            log_file.close()
        self.children[name] = child
        logger.info("started %s (pid %d), log: %s", name, popen.pid, log_path)
        return child

    def wait(self, main: str, poll: float = 0.5, on_death=None) -> int:
        """Block until `main` exits (its return code) or another critical child dies
        (LaunchError naming it). `on_death(child)` may restart a non-critical child."""
        while True:
            main_child = self.children[main]
            rc = main_child.popen.poll()
            if rc is not None:
                for t in main_child.threads:
                    t.join(timeout=5)
                return rc
            for child in list(self.children.values()):
                if child.name == main or child.alive():
                    continue
                if child.critical:
                    raise LaunchError(
                        f"{child.name} exited with code {child.popen.returncode}; "
                        f"log tail ({child.log_path}):\n{log_tail(child.log_path)}"
                    )
                if on_death is not None:
                    on_death(child)
            time.sleep(poll)

    def kill_group(self, name: str) -> None:
        """SIGKILL what is left of a child's process group: when a torchrun agent dies, its
        workers stay in its group (and would train on as orphans) until this."""
        child = self.children.get(name)
        if child is not None:
            _signal_group(child.popen, signal.SIGKILL)

    def stop(self, name: str, grace: float = 10.0) -> None:
        child = self.children.get(name)
        if child is None or not child.alive():
            return
        _signal_group(child.popen, signal.SIGTERM)
        try:
            child.popen.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            _signal_group(child.popen, signal.SIGKILL)
            child.popen.wait(timeout=5)

    def stop_all(self, grace: float = 10.0) -> None:
        for child in self.children.values():
            if child.alive():
                _signal_group(child.popen, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for child in self.children.values():
            try:
                child.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(child.popen, signal.SIGKILL)
                child.popen.wait(timeout=5)
        # Children may have left grandchildren in their session: sweep the groups once more.
        for child in self.children.values():
            _signal_group(child.popen, signal.SIGKILL)


def _signal_group(popen: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(popen.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def install_signal_handlers(on_signal) -> None:
    """Turn SIGINT/SIGTERM into KeyboardInterrupt so `finally:` blocks tear the run down."""

    def handler(signum, frame):
        on_signal(signum)
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


class LogFollower(threading.Thread):
    """Copy a growing log file to our stdout, optionally prefixed: how cluster launchers show a
    remote process's output (the file lives on the run's shared filesystem). Starts at the
    file's current end: logs are appended to across runs of a trial."""

    def __init__(self, path: str, prefix: str = ""):
        super().__init__(daemon=True)
        self.path, self.prefix, self.done = path, prefix, threading.Event()
        self.offset = os.path.getsize(path) if os.path.exists(path) else 0

    def run(self) -> None:
        while not os.path.exists(self.path):
            if self.done.wait(0.3):
                return
        partial = b""
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            while True:
                partial += f.readline()
                if partial.endswith(b"\n"):
                    self._write(partial)
                    partial = b""
                elif self.done.wait(0.3):  # drain what was written before the stop
                    for line in (partial + f.read()).splitlines(True):
                        self._write(line)
                    return

    def _write(self, line: bytes) -> None:
        sys.stdout.write(self.prefix + line.decode(errors="replace"))
        sys.stdout.flush()

    def stop(self, timeout: float = 5.0) -> None:
        self.done.set()
        if self.ident is not None:  # started
            self.join(timeout)


def run_launcher(run, argv: list[str]) -> None:
    """Shared `main` of the launchers: exit 0 on success, 2 for a config error (nothing was
    started), 1 when a part of the run failed (named in the message), 130 on Ctrl-C."""
    from arealite.api.cli_args import ConfigError

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s [launcher] %(message)s", datefmt="%H:%M:%S"
    )
    try:
        sys.exit(run(argv))
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        sys.exit(2)
    except LaunchError as e:
        print(f"launch failed: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
