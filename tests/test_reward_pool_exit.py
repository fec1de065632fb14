"""A process that used RewardPools exits without a word (issue 42): at interpreter exit
concurrent.futures writes to each executor manager thread's wake-up pipe, and a thread still
closing that pipe then made Python print "Exception ignored ... OSError: [Errno 9] Bad file
descriptor" (1 exit in 30-40 here). The pool's exit hook waits for those threads first; these
tests check that order, which holds on every run, rather than wait for the race."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

TESTS = os.path.dirname(os.path.abspath(__file__))

SCRIPT = textwrap.dedent(
    """
    import asyncio, sys, threading
    sys.path.insert(0, {tests!r})
    from concurrent.futures.process import _ExecutorManagerThread
    import workflow_rewards
    from arealite.reward.pool import RewardPool

    def managers_left():
        # Registered before the pools: runs after their exit hooks, before concurrent.futures'.
        alive = [t for t in threading.enumerate() if isinstance(t, _ExecutorManagerThread)]
        print(f"manager threads alive at exit: {{len(alive)}}", flush=True)

    if __name__ == "__main__":
        threading._register_atexit(managers_left)
        pools = [RewardPool(workflow_rewards.always_one, max_workers=1, timeout=30)
                 for _ in range(3)]

        async def score():
            return [await p("p", "c", [1], [2]) for p in pools]

        print(asyncio.run(score()), flush=True)
        pools[0].close()  # one closed by its owner, the others left to the exit hook
    """
)


def test_pools_closed_or_left_open_leave_no_manager_thread_for_the_exit_hook(tmp_path):
    script = tmp_path / "uses_pools.py"
    script.write_text(SCRIPT.format(tests=TESTS))
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "[1.0, 1.0, 1.0]" in p.stdout
    assert "manager threads alive at exit: 0" in p.stdout, p.stdout + p.stderr
    assert "Traceback" not in p.stderr and "Exception ignored" not in p.stderr, p.stderr
