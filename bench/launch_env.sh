# Sourced by the bench shell scripts after setting W (their work dir): the repo root as cwd, the
# interpreter, offline hub, and helpers to launch a run under $W, find its final checkpoint, and
# build the tiny model once.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PY:-.venv/bin/python}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
launch() { $PY -m arealite.launcher.local "$@" cluster.fileroot="$W"; }
final() { ls -d "$W/$1"/checkpoints/final/*/ | tail -n 1; }
[ -f "$W/tiny_model/config.json" ] || $PY -m arealite.testing.tiny_model "$W/tiny_model"
