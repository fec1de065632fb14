#!/usr/bin/env bash
# CPU demo (placeholder until the end-to-end entry points land): builds the tiny offline model
# and checks that it loads and generates.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN_DIR=${1:-runs}
PY=${PY:-.venv/bin/python}
mkdir -p "$RUN_DIR/demo"
$PY -m arealite.utils.tiny_model "$RUN_DIR/demo/tiny_model"
$PY - "$RUN_DIR/demo/tiny_model" <<'PYEOF'
import sys
from transformers import AutoModelForCausalLM, AutoTokenizer
path = sys.argv[1]
tok = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path)
ids = tok.apply_chat_template([{"role": "user", "content": "12+34="}], add_generation_prompt=True, return_tensors="pt", return_dict=True)
out = model.generate(**ids, max_new_tokens=8, do_sample=False)
print("smoke generation:", repr(tok.decode(out[0, ids["input_ids"].shape[1]:])))
PYEOF
