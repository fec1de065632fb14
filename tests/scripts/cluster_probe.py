"""A 'training script' for cluster launcher tests: records its rank environment and pid,
generates a few tokens from every inference server in AREAL_LLM_SERVER_ADDRS, then
- PROBE_FAIL_RANK=<r>: rank r exits 3 (after PROBE_FAIL_DELAY seconds);
- PROBE_HANG=1: the other ranks (all ranks when no rank fails) sleep until they are killed,
so tests can check that a launcher stops every process when one part fails."""

import json
import os
import sys
import time
import urllib.request

from arealite.api.cli_args import GRPOConfig, SFTConfig, load_expr_config

argv = sys.argv[1:]
with_servers = any(a.startswith("allocation_mode=") and "+" in a for a in argv)
config = load_expr_config(argv, GRPOConfig if with_servers else SFTConfig)
rank = os.environ["RANK"]
keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
record = {k: os.environ.get(k) for k in keys}
record.update(pid=os.getpid(), tokens={})
addrs = [a for a in os.environ.get("AREAL_LLM_SERVER_ADDRS", "").split(",") if a]
for addr in addrs:
    body = {
        "rid": f"probe-{rank}",
        "input_ids": [1, 2, 3],
        "sampling_params": {"max_new_tokens": 3, "temperature": 1.0},
        "return_logprob": True,
    }
    req = urllib.request.Request(
        f"http://{addr}/generate",
        data=json.dumps(body).encode(),
        headers={
            "Content-Type": "application/json",
            # The launcher's per-run key: its embedded servers require it.
            "Authorization": f"Bearer {os.environ['AREAL_SERVER_API_KEY']}",
        },
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        record["tokens"][addr] = len(json.load(r)["output_ids"])
out_dir = os.path.join(config.run_dir, "probe")
os.makedirs(out_dir, exist_ok=True)
tmp = os.path.join(out_dir, f".rank{rank}.json")
with open(tmp, "w") as f:
    json.dump(record, f)
os.replace(tmp, os.path.join(out_dir, f"rank{rank}.json"))
print(f"rank {rank} probed {len(addrs)} server(s)", flush=True)
if os.environ.get("PROBE_FAIL_RANK") == rank:
    time.sleep(float(os.environ.get("PROBE_FAIL_DELAY", "0")))
    sys.exit(3)
if os.environ.get("PROBE_HANG") == "1":
    time.sleep(3600)
