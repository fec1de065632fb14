"""A trivial 'training script' for launcher tests: records its rank environment and whether
torchrun's agent started it."""

import json
import os
import sys

from arealite.api.cli_args import SFTConfig, load_expr_config

config = load_expr_config(sys.argv[1:], SFTConfig)
out = os.path.join(config.run_dir, f"rank{os.environ['RANK']}.json")
with open(out, "w") as f:
    json.dump(
        {
            k: os.environ.get(k)
            for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "AREAL_LLM_SERVER_ADDRS")
        }
        | {"under_agent": "torch.distributed.run" in open(f"/proc/{os.getppid()}/cmdline").read()},
        f,
    )
print(f"rank {os.environ['RANK']} ok", flush=True)
if os.environ.get("PROBE_FAIL_RANK") == os.environ["RANK"]:
    sys.exit(3)
