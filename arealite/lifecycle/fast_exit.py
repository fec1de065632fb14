"""End a finished process without the interpreter's finalization.

A process that imported torch, transformers and FSDP spends about a second tearing down its
modules after `main` returns (measured: ~1.0 s on a 2-core EPYC for the trainer's imports, of
which torch alone 0.3 s), and the launcher, a demo or a test waits for it. Once the process has
closed what it opened, nothing in that teardown is needed: the interpreter's own exit steps that
matter (joining non-daemon threads, atexit hooks such as logging's flush and name-resolve
deregistration, the standard streams) are run here, then the process ends.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading


def exit_fast(code: int = 0) -> None:
    """Join non-daemon threads, run the atexit hooks, flush stdout / stderr, `os._exit(code)`."""
    shutdown_threads = getattr(threading, "_shutdown", None)  # what a normal exit runs first
    if shutdown_threads is not None:
        shutdown_threads()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken: nothing left to say
            pass
    os._exit(code)


def run_then_exit_fast(main, *args) -> None:
    """`main(*args)`, then `exit_fast(0)` if it returned; an exception (SystemExit included)
    takes the normal exit path, so tracebacks and exit codes are as Python prints them."""
    main(*args)
    exit_fast(0)
