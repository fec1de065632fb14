"""SFT on CLEVR-count, vision (examples/configs/clevr_count_70k_sft.yaml).
`sft.py` under its old name (the task is all in the YAML).
It runs that script as `__main__` rather than importing it (examples do not import each
other)."""

import os
import runpy

if __name__ == "__main__":
    runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "sft.py"),
                   run_name="__main__")  # fmt: skip
