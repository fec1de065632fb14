"""A finished process ends without the interpreter's teardown, but with what a normal exit does
that matters: non-daemon threads joined, atexit hooks run, buffered output flushed."""

from __future__ import annotations

import subprocess
import sys
import textwrap

CHILD = textwrap.dedent(
    """
    import atexit, sys, threading, time
    from arealite.lifecycle.fast_exit import run_then_exit_fast

    def main(mode):
        atexit.register(lambda: print("atexit hook ran"))
        worker = threading.Thread(target=lambda: (time.sleep(0.3), print("thread finished")))
        worker.start()
        sys.stdout.write("buffered, no newline")  # a pipe: block-buffered
        if mode == "raise":
            raise RuntimeError("main failed")

    run_then_exit_fast(main, sys.argv[1])
    print("never printed")
    """
)


def run_child(mode: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", CHILD, mode]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def test_a_finished_main_exits_0_after_threads_hooks_and_output():
    p = run_child("ok")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("buffered, no newline")
    assert "thread finished" in p.stdout and "atexit hook ran" in p.stdout
    assert p.stdout.index("thread finished") < p.stdout.index("atexit hook ran")
    assert "never printed" not in p.stdout and p.stderr == ""


def test_a_failing_main_takes_the_normal_exit_with_its_traceback():
    p = run_child("raise")
    assert p.returncode == 1
    assert "RuntimeError: main failed" in p.stderr
    assert "thread finished" in p.stdout and "atexit hook ran" in p.stdout
