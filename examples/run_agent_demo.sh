#!/usr/bin/env bash
# CPU agent demos, each one command; prints held-out success before and after GRPO.
#   examples/run_agent_demo.sh arith [RUN_ROOT]       multi-turn agent (openai SDK only) through
#       the AgentProxy: arithmetic SFT warm start (as in `make demo`), then GRPO
#   examples/run_agent_demo.sh sum_then_add [RUN_ROOT]  the agent of examples/agents/ (openai SDK
#       and the standard library only) from its YAML alone (`agent.command`): a warm start with
#       two-turn rows, then GRPO; success = both turns right, greedy, through HTTP
#   examples/run_agent_demo.sh calculator [RUN_ROOT]  tool-using agent in process (AgentWorkflow):
#       SFT (a copy drill, then synthetic calculator traces), then GRPO
# Everything goes to <RUN_ROOT>/demo (default runs/demo); the tiny model and SFT are reused.
set -euo pipefail
cd "$(dirname "$0")/.."
DEMO=${1:?usage: examples/run_agent_demo.sh arith|sum_then_add|calculator [RUN_ROOT]}
RUN=${2:-runs}/demo
PY=${PY:-.venv/bin/python}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
start=$(date +%s)

if [ ! -f "$RUN/tiny_model/config.json" ]; then
  $PY -m arealite.testing.tiny_model "$RUN/tiny_model"
fi

case "$DEMO" in
  arith)
    if ! ls -d "$RUN"/arith-sft/demo/checkpoints/final/*/ >/dev/null 2>&1; then
      echo "== SFT warm start (examples/configs/arith_sft.yaml)"
      $PY -m arealite.launcher.local examples/sft.py --config examples/configs/arith_sft.yaml \
        cluster.fileroot="$RUN" model.path="$RUN/tiny_model"
    fi
    MODEL=$(ls -d "$RUN"/arith-sft/demo/checkpoints/final/*/ | tail -n 1)
    echo "== GRPO through the AgentProxy from $MODEL (examples/configs/agent_arith.yaml)"
    AGENT_MODE=proxy $PY -m arealite.launcher.local examples/agent_arith.py \
      --config examples/configs/agent_arith.yaml cluster.fileroot="$RUN" actor.path="$MODEL"
    RUN_DIR="$RUN/agent-arith/demo" ;;
  sum_then_add)
    if [ ! -f "$RUN/sum_then_add_sft/config.json" ]; then
      echo "== SFT warm start with two-turn rows (examples/agents/sum_then_add_sft.yaml)"
      $PY -m arealite.launcher.local examples/sft.py --config examples/agents/sum_then_add_sft.yaml \
        cluster.fileroot="$RUN" model.path="$RUN/tiny_model"
      MODEL=$(ls -d "$RUN"/sum-then-add-sft/demo/checkpoints/final/*/ | tail -n 1)
      ln -sfn "$(cd "$MODEL" && pwd)" "$RUN/sum_then_add_sft"  # the path the YAML names
    fi
    echo "== GRPO of the agent, from its YAML alone (examples/agents/sum_then_add.yaml)"
    $PY -m arealite.launcher.local examples/grpo.py --config examples/agents/sum_then_add.yaml \
      cluster.fileroot="$RUN" actor.path="$RUN/sum_then_add_sft"
    RUN_DIR="$RUN/agent-sum-then-add/demo" ;;
  calculator)
    MODEL="$RUN/calc_sft"
    if [ ! -f "$MODEL/model.safetensors" ]; then
      echo "== SFT warm start: copy drill, then synthetic calculator traces"
      $PY examples/agent_calculator.py sft --base "$RUN/tiny_model" --out "$MODEL"
    fi
    echo "== GRPO in process from $MODEL (examples/configs/agent_calculator.yaml)"
    $PY -m arealite.launcher.local examples/agent_calculator.py \
      --config examples/configs/agent_calculator.yaml cluster.fileroot="$RUN" actor.path="$MODEL"
    RUN_DIR="$RUN/agent-calculator/demo" ;;
  *) echo "unknown demo $DEMO (arith | sum_then_add | calculator)" >&2; exit 2 ;;
esac

$PY -m arealite.trainer.run_summary "$RUN_DIR" "$(( $(date +%s) - start ))" success
