#!/usr/bin/env bash
# The CPU demo (`make demo`): a tiny model built offline, an SFT warm start on synthetic
# arithmetic stopped early, then GRPO with the embedded inference server; prints held-out accuracy
# before and after GRPO. Everything goes to <RUN_ROOT>/demo (default runs/demo).
# DEMO_TASK=long_sums (`make demo-long`): the same on long worked sums (<RUN_ROOT>/long_sums).
# DEMO_SFT_ARGS / DEMO_GRPO_ARGS: extra config overrides (tests/test_demo.py: a few steps).
set -euo pipefail
cd "$(dirname "$0")/.."
TASK=${DEMO_TASK:-arith}
if [ "$TASK" = arith ]; then RUN=${1:-runs}/demo; else RUN=${1:-runs}/$TASK; fi
PY=${PY:-.venv/bin/python}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
start=$(date +%s)

if [ ! -f "$RUN/tiny_model/config.json" ]; then
  $PY -m arealite.testing.tiny_model "$RUN/tiny_model"
fi

echo "== 1/2 SFT warm start (examples/configs/${TASK}_sft.yaml)"
$PY -m arealite.launcher.local examples/sft.py --config "examples/configs/${TASK}_sft.yaml" \
  cluster.fileroot="$RUN" model.path="$RUN/tiny_model" ${DEMO_SFT_ARGS:-}
SFT_MODEL=$(ls -d "$RUN/${TASK//_/-}"-sft/demo/checkpoints/final/*/ | tail -n 1)
# The stable path the YAMLs name (actor.path: runs/demo/sft_model).
ln -sfn "$(cd "$SFT_MODEL" && pwd)" "$RUN/sft_model"

echo "== 2/2 GRPO from $SFT_MODEL (examples/configs/${TASK}_grpo.yaml)"
$PY -m arealite.launcher.local examples/grpo.py --config "examples/configs/${TASK}_grpo.yaml" \
  cluster.fileroot="$RUN" actor.path="$SFT_MODEL" ${DEMO_GRPO_ARGS:-}

GRPO_DIR="$RUN/${TASK//_/-}-grpo/demo"
$PY -m arealite.trainer.run_summary "$GRPO_DIR" "$(( $(date +%s) - start ))"
