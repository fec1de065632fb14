"""Reward workers import the reward's module, not the trainer's script: a forkserver / spawn
child re-imports `__main__` by default, which for a trainer script means torch, transformers
and FSDP in every worker (~3 s each on 2 cores, the first reward calls waiting). A reward
defined in the script itself still gets the script."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

TESTS = os.path.dirname(os.path.abspath(__file__))

SCRIPT = textwrap.dedent(
    """
    import asyncio, os, sys
    sys.path.insert(0, {tests!r})
    import workflow_rewards
    from arealite.reward.pool import RewardPool

    # Top level: runs in the parent and in every worker that imports this script.
    with open(os.environ["IMPORT_LOG"], "a") as f:
        f.write(__name__ + "\\n")

    def reward_here(prompt, completion, prompt_ids, completion_ids, **kw):
        return 0.5

    if __name__ == "__main__":
        fn = reward_here if sys.argv[1] == "here" else workflow_rewards.always_one
        pool = RewardPool(fn, max_workers=2, timeout=60)
        print(asyncio.run(pool("p", "c", [1], [2])), flush=True)
        pool.close()
        print("main intact:",
              sys.modules["__main__"].__file__ == os.path.abspath(__file__), flush=True)
    """
)


def run_script(tmp_path, where: str) -> tuple[str, list[str]]:
    script = tmp_path / "trainer_script.py"
    script.write_text(SCRIPT.format(tests=TESTS))
    log = tmp_path / f"imports_{where}.log"
    env = {**os.environ, "IMPORT_LOG": str(log)}
    p = subprocess.run(
        [sys.executable, str(script), where], capture_output=True, text=True, env=env, timeout=120
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout, log.read_text().split()


def test_workers_of_a_module_reward_do_not_import_the_main_script(tmp_path):
    out, imports = run_script(tmp_path, "module")
    assert "1.0" in out and "main intact: True" in out
    assert imports == ["__main__"]  # the parent only, though a worker scored the call


def test_a_reward_defined_in_the_main_script_gets_the_script_in_its_workers(tmp_path):
    out, imports = run_script(tmp_path, "here")
    assert "0.5" in out and "main intact: True" in out
    assert "__mp_main__" in imports  # the worker that scored it (the other may be killed first)
