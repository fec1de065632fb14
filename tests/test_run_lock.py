"""One owner per run directory: flock, and a lease with heartbeats where there is no flock."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from arealite.lifecycle.run_lock import FENCING_TOKEN_ENV, RunLock, RunLockHeld

HOLD = textwrap.dedent(
    """
    import sys, time
    from arealite.lifecycle.run_lock import RunLock
    lock = RunLock(sys.argv[1], ttl=float(sys.argv[3]), mode=sys.argv[2])
    print(lock.acquire(), flush=True)
    time.sleep(600)
    """
)


def hold_in_child(run_dir, mode: str, ttl: float = 60.0) -> tuple[subprocess.Popen, int]:
    """Another process that owns the run directory; (process, its fencing token)."""
    p = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run_dir), mode, str(ttl)],
        stdout=subprocess.PIPE,
        text=True,
    )
    return p, int(p.stdout.readline())


@pytest.mark.parametrize("mode", ["flock", "lease"])
def test_a_second_owner_fails_at_once_naming_the_holder(tmp_path, mode, monkeypatch):
    monkeypatch.delenv(FENCING_TOKEN_ENV, raising=False)
    holder, token = hold_in_child(tmp_path, mode)
    try:
        t0 = time.monotonic()
        with pytest.raises(RunLockHeld) as e:
            RunLock(str(tmp_path), mode=mode).acquire()
        assert time.monotonic() - t0 < 2
        assert f"pid {holder.pid} on host {socket.gethostname()}" in str(e.value)
        assert str(tmp_path) in str(e.value)
    finally:
        holder.kill()
        holder.wait()
    assert token == 1


@pytest.mark.parametrize("mode", ["flock", "lease"])
def test_a_lock_left_by_a_dead_process_is_taken_over_and_logged(
    tmp_path, mode, caplog, monkeypatch
):
    monkeypatch.delenv(FENCING_TOKEN_ENV, raising=False)
    holder, token = hold_in_child(tmp_path, mode)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    lock = RunLock(str(tmp_path), mode=mode)
    with caplog.at_level(logging.WARNING, logger="arealite.run_lock"):
        assert lock.acquire() == token + 1  # the fencing token grows with every owner
    assert f"taking over the lock left by pid {holder.pid}" in caplog.text
    assert os.environ[FENCING_TOKEN_ENV] == str(token + 1)
    lock.release()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="arealite.run_lock"):
        with RunLock(str(tmp_path), mode=mode) as again:  # released cleanly: no takeover
            assert again.token == token + 2
    assert "taking over" not in caplog.text


def test_a_lease_from_another_host_holds_until_it_expires(tmp_path, monkeypatch):
    """Across hosts only the heartbeat tells whether the holder lives."""
    monkeypatch.delenv(FENCING_TOKEN_ENV, raising=False)
    record = {
        "host": "node-b",
        "pid": 1234,
        "started": time.time() - 100,
        "token": 4,
        "renewed": time.time(),
        "ttl": 2.0,
        "nonce": "x",
        "released": False,
    }
    (tmp_path / "run.lock").write_text(json.dumps(record))
    with pytest.raises(RunLockHeld, match="pid 1234 on host node-b"):
        RunLock(str(tmp_path), mode="lease").acquire()
    record["renewed"] = time.time() - 3  # no heartbeat for longer than its ttl
    (tmp_path / "run.lock").write_text(json.dumps(record))
    lock = RunLock(str(tmp_path), ttl=0.6, mode="lease")
    assert lock.acquire() == 5
    first = json.loads((tmp_path / "run.lock").read_text())["renewed"]
    time.sleep(0.5)  # the holder renews every ttl / 3
    assert json.loads((tmp_path / "run.lock").read_text())["renewed"] > first
    lock.release()
