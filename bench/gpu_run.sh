#!/usr/bin/env bash
# The GPU figures on a one-GPU machine with no hub access: the GPU tests, then the demo's two
# steps (SFT warm start, GRPO with the embedded server sharing the GPU with the trainer) on a
# randomly initialised model of Qwen2.5-0.5B's shapes (bf16 where native, torch's SDPA kernels),
# with bench/vs_trl.py --gpu from that warm start in between. Each stage has a time limit and
# its own log in OUT_DIR; a failed stage does not stop the next. The figures are printed last.
#
#   bash bench/gpu_run.sh OUT_DIR [quick]     # quick: a few steps of each (finds breakage)
#   bash bench/gpu_run.sh OUT_DIR dry         # CPU, seconds: the preflight memory plans of
#                                             # gsm8k_grpo.yaml at Qwen2.5-0.5B / 1.5B shapes
#   bash bench/gpu_run.sh OUT_DIR long        # the long regime (long_sums) at the same shapes:
#                                             # SFT warm start, then bench/long_regime.py part a
#                                             # (eta 0 vs eta 4) and part b (vs TRL), ~8 minutes,
#                                             # after the decoding step profiled alone
#
# Knobs (environment): LONG_SFT_STEPS LONG_SFT_LR LONG_BUDGET LONG_ARMS LONG_TRL_MIN LONG_EVAL_SECS
# DECODE_RUNS DECODE_MAX_NEW, and for a CPU rehearsal GPU_ARGS SFT_DEVICE_ARGS VS_DEVICE_FLAG (long mode);
# SFT_STEPS GRPO_STEPS VS_MIN VS_STEPS; the stage limits T_TESTS T_MODEL
# T_SFT T_VS T_GRPO (seconds); GPU_TESTS (pytest args), VS_ARGS (extra vs_trl.py args, e.g.
# "--systems arealite --runs-from trl.jsonl"), WEIGHT_UPDATE (tensor | disk); PY (python).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: bench/gpu_run.sh OUT_DIR [quick]}
MODE=${2:-full}
PY=${PY:-python3}
if [ "$MODE" = dry ]; then  # no GPU, no model, no download: bench/memory_plan.py --dry
  mkdir -p "$OUT"
  $PY bench/memory_plan.py --dry | tee "$OUT/memory_plan.log"
  exit "${PIPESTATUS[0]}"
fi
# Weights pass through disk every step: keep them in RAM where /dev/shm has room (20 GB).
SHM_KB=$(df --output=avail -k /dev/shm 2>/dev/null | tail -n 1)
W=${GPU_RUN_DIR:-$([ "${SHM_KB:-0}" -gt 20000000 ] && echo /dev/shm/gpu_run || echo /tmp/gpu_run)}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
mkdir -p "$OUT" "$W"

# Steps, and each stage's limit in seconds (the whole fits a 10-minute device call).
if [ "$MODE" = quick ]; then
  SFT_STEPS=8 GRPO_STEPS=4 EVAL=2 VS_MIN=0.4 VS_STEPS=6
else
  SFT_STEPS=${SFT_STEPS:-200} GRPO_STEPS=${GRPO_STEPS:-40} EVAL=20
  VS_MIN=${VS_MIN:-1} VS_STEPS=${VS_STEPS:-200}
fi
T_TESTS=${T_TESTS:-100} T_MODEL=${T_MODEL:-60} T_SFT=${T_SFT:-100} T_GRPO=${T_GRPO:-150} T_VS=${T_VS:-180}

need_sft() {  # a bench given no warm start would build its own tiny one: stop instead
  [ -n "$SFT" ] && return 0
  echo "== no SFT checkpoint under $W (see $OUT/$1.log): the stages after it are skipped"
  exit 1
}

stage() {  # stage NAME SECONDS CMD...: run with a limit, log to OUT/NAME.log, report rc and time
  local name=$1 secs=$2 t0=$SECONDS rc
  shift 2
  echo "== $name (limit ${secs}s)"
  timeout -k 10 "$secs" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  echo "== $name: rc=$rc in $((SECONDS - t0))s"
  tail -n 6 "$OUT/$name.log"
  strays  # a stage killed at its limit must not keep the GPU busy under the next one
}

strays() {  # report and kill what a stage left running (on the GPU or as arealite processes)
  local apps
  apps=$(nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader 2>/dev/null)
  [ -n "$apps" ] && echo "== still on the GPU after the stage: $apps"
  pkill -9 -f 'arealite[.](server|launcher)|torchrun|examples/(grpo|sft)[.]py|vs_trl[.]py' 2>/dev/null
  sleep 1
}

nvidia-smi -L
GPU_GIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n 1 | awk '{print $1 / 1024}')
[ "$MODE" = long ] || $PY bench/memory_plan.py --dry --gpu-gb "$GPU_GIB" >"$OUT/memory_plan.log" 2>&1
[ -n "${VS_FLAGS-x}" ] && $PY -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'transformers', transformers.__version__, torch.cuda.get_device_name(0),
'capability', torch.cuda.get_device_capability(0))"
MODEL=$W/qwen05b_shapes
if [ "$MODE" = long ]; then  # issue 41's GPU part; every arealite run shares the GPU
  GPU_ARGS=${GPU_ARGS-cluster.n_gpus_per_node=1 cluster.share_gpus=true weight_update=tensor}
  SFT_DEVICE_ARGS=${SFT_DEVICE_ARGS-cluster.n_gpus_per_node=1} VS_DEVICE_FLAG=${VS_DEVICE_FLAG---gpu}
  SFT_STEPS=${LONG_SFT_STEPS:-200}  # 0.31-0.33 s/step on an H200 (93 s with start and save)
  stage model "$T_MODEL" $PY -m arealite.testing.tiny_model "$MODEL" ${MODEL_ARGS---qwen2.5-0.5b-shapes}
  # The decoding step alone, before anything is trained (GRPO groups of ROWS_A_PROMPT rows), with
  # the profiler's tables: the long regime's steps are the server's decode steps.
  DECODE_RUNS=${DECODE_RUNS:-qwen05b_shapes:8}  # MODEL:ROWS_A_PROMPT; MODEL tiny builds a 4-layer one
  [[ " $DECODE_RUNS" == *" tiny:"* ]] && stage tiny_model 60 $PY -m arealite.testing.tiny_model "$W/tiny"
  for run in $DECODE_RUNS; do
    m=${run%%:*} s=${run##*:}
    stage "decode_${m}_s$s" "${T_DECODE:-35}" $PY bench/server_decode_profile.py "$W/$m" \
      --samples "$s" --max-new ${DECODE_MAX_NEW:-128} --profile-steps 10
  done
  stage long_sft "${T_LONG_SFT:-110}" $PY -m arealite.launcher.local examples/sft.py \
    --config examples/configs/long_sums_sft.yaml cluster.fileroot="$W" model.path="$MODEL" \
    $SFT_DEVICE_ARGS total_train_steps=$SFT_STEPS \
    train_dataset.options.size=$((SFT_STEPS * 32)) model.optimizer.lr=${LONG_SFT_LR:-3e-4}
  SFT=$(ls -d "$W"/long-sums-sft/demo/checkpoints/final/*/ 2>/dev/null | tail -n 1)
  need_sft long_sft
  # Each 60-s arm takes ~125 s on an H200: 15-20 s an evaluation, plus start and stop.
  stage long_a "${T_LONG_A:-280}" $PY bench/long_regime.py --parts a --seeds 1 \
    --arms ${LONG_ARMS:-eta0_decoupled_mb1,eta4_decoupled_mb1} --budget ${LONG_BUDGET:-60} \
    --eval-secs ${LONG_EVAL_SECS:-30} --target-gain 0.10 --model-path "$SFT" \
    --workdir "$W/long_a" --arealite-args "$GPU_ARGS"
  # TRL alone for LONG_TRL_MIN minutes: long_a's eta 4 run is arealite's arm of the comparison.
  stage long_b "${T_LONG_B:-115}" $PY bench/vs_trl.py --task long_sums $VS_DEVICE_FLAG \
    --model-path "$SFT" --seeds 1 --minutes ${LONG_TRL_MIN:-1} --steps 0 --lr 1e-5 \
    --systems trl --workdir "$W/long_b"
  echo "== figures"
  grep -h '^{' "$OUT"/decode_*.log | grep '"figure": "decode'
  grep -h '^{' "$OUT/long_a.log" "$OUT/long_b.log" | grep -v '"figure": "machine"'
  tail -n 3 "$W"/long-sums-sft/demo/metrics.jsonl 2>/dev/null
  tar czf "$OUT/long_runs.tgz" -C "$W" --exclude='*.safetensors' --exclude='*.bin' \
    --exclude='*.pt' --exclude='*.distcp' long_a long_b long-sums-sft 2>/dev/null
  exit 0
fi

stage gpu_tests "$T_TESTS" $PY -m pytest ${GPU_TESTS:-tests/gpu} -q -p no:cacheprovider

stage model "$T_MODEL" $PY -m arealite.testing.tiny_model "$MODEL" ${MODEL_ARGS---qwen2.5-0.5b-shapes}

stage sft "$T_SFT" $PY -m arealite.launcher.local examples/sft.py --config examples/configs/arith_sft.yaml \
  cluster.fileroot="$W" model.path="$MODEL" cluster.n_gpus_per_node=1 \
  total_train_steps=$SFT_STEPS train_dataset.options.size=$((SFT_STEPS * 64)) \
  model.optimizer.lr=3e-4 stats_logger.print_every=10
SFT=$(ls -d "$W"/arith-sft/demo/checkpoints/final/*/ 2>/dev/null | tail -n 1)
need_sft sft

# VS_ARGS: e.g. "--systems arealite --runs-from trl_runs.jsonl" (TRL's runs of an earlier call)
stage vs_trl "$T_VS" $PY bench/vs_trl.py ${VS_FLAGS---gpu} --model-path "$SFT" --seeds 1 \
  --minutes "$VS_MIN" --steps "$VS_STEPS" --workdir "$W/vs_trl" ${VS_ARGS:-}

# The demo's GRPO config; weight_update=tensor: the server opens CUDA IPC handles of the
# trainer's weights on the shared GPU (WEIGHT_UPDATE=disk for the checkpoint round trip).
stage grpo "$T_GRPO" $PY -m arealite.launcher.local examples/grpo.py \
  --config examples/configs/arith_grpo.yaml cluster.fileroot="$W" actor.path="$SFT" \
  cluster.n_gpus_per_node=1 cluster.share_gpus=true weight_update=${WEIGHT_UPDATE:-tensor} \
  total_train_steps=$GRPO_STEPS evaluator.freq_steps=$EVAL actor.optimizer.lr=2e-5

echo "== figures"
for run in arith-sft arith-grpo; do
  $PY - "$W/$run/demo/metrics.jsonl" <<'PYEOF'
import json, statistics, sys
recs = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
wall = [r["wall_time"] for r in recs]
out = {"run": sys.argv[1], "steps": len(recs),
       "sec_per_step_median": round(statistics.median(b - a for a, b in zip(wall, wall[1:])), 3)}
for k in sorted({k for r in recs for k in r if k.startswith("timeperf/")}):
    out[k] = round(statistics.median(r[k] for r in recs[1:] if k in r), 3)
out["loss_last"] = recs[-1].get("loss")
out["accuracy"] = [(r["step"], round(r["eval/accuracy"], 3)) for r in recs if r.get("eval/accuracy") is not None]
out["accuracy_before"] = next((r["eval/accuracy_before_training"] for r in recs if r.get("eval/accuracy_before_training") is not None), None)
print(json.dumps(out))
PYEOF
done
grep '^{' "$OUT/vs_trl.log" | tail -n 12
cp "$W"/arith-grpo/demo/metrics.jsonl "$OUT/grpo_metrics.jsonl" 2>/dev/null
true
