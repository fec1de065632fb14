"""A trivial GRPO 'training script' for launcher tests: records the environment it got."""

import json
import os
import sys

from arealite.api.cli_args import GRPOConfig, load_expr_config

config = load_expr_config(sys.argv[1:], GRPOConfig)
keys = ("RANK", "LOCAL_RANK", "CUDA_VISIBLE_DEVICES", "NCCL_CUMEM_ENABLE", "NCCL_NVLS_ENABLE")
with open(os.path.join(config.run_dir, f"env{os.environ['RANK']}.json"), "w") as f:
    json.dump({k: os.environ.get(k) for k in keys}, f)
