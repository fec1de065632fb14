"""GRPO on GSM8K (examples/configs/gsm8k_grpo.yaml).
`grpo.py` under its old name (the task is all in the YAML).
It runs that script as `__main__` rather than importing it (examples do not import each
other)."""

import os
import runpy

GRPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "grpo.py")


def main(*args, **kwargs):
    """For scripts that still import the loop from here (examples/agent_arith.py)."""
    return runpy.run_path(GRPO)["main"](*args, **kwargs)


if __name__ == "__main__":
    runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "grpo.py"),
                   run_name="__main__")  # fmt: skip
