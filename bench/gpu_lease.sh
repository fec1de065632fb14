#!/usr/bin/env bash
# One device call for bench/gpu_run.sh on a lent GPU machine that has CUDA torch, transformers
# and the scientific stack but no registry and none of arealite's other packages.
#
#   bash bench/gpu_lease.sh wheels            # here, with internet: the missing packages as
#                                             # cp312 wheels in .whl (ignore it in git; carry it)
#   bash bench/gpu_lease.sh run OUT [MODE]    # there: install .whl into /tmp/site, print the
#                                             # versions, run gpu_run.sh MODE (default long)
#                                             # inside LEASE_SECS, pack its logs and runs into
#                                             # three files under OUT (the tool returns eight)
#
# The versions are the ones tested on the H200 image of 2026-11 (torch 2.11, transformers 5.17).
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS="tensordict==0.15.3 pyvers==0.2.3 torchdata==0.11.0 datasets==5.2.0 dill==0.4.1
multiprocess==0.70.19 omegaconf==2.4.0 antlr4-python3-runtime==4.13.2 math-verify==0.9.0
latex2sympy2_extended==1.11.0 trl==1.16.0"

case "${1:-}" in
wheels)
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl $WHEELS && du -sh .whl
  ;;
run)
  OUT=${2:?usage: bench/gpu_lease.sh run OUT [MODE]}
  MODE=${3:-long}
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 3
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PY=python3 GPU_RUN_DIR=${GPU_RUN_DIR:-/tmp/w}
  python3 -c "import torch, transformers, datasets, trl, tensordict
print('torch', torch.__version__, 'transformers', transformers.__version__, 'datasets',
      datasets.__version__, 'trl', trl.__version__, torch.cuda.get_device_name(0))" 2>&1 | tee "$OUT/versions.txt"
  # 555 s: the run and the packing below fit one 600-s call.
  timeout -k 5 "${LEASE_SECS:-555}" bash bench/gpu_run.sh /tmp/gpu_run_logs "$MODE" 2>&1 | tee "$OUT/gpu_run.log"
  tar czf "$OUT/logs.tgz" -C /tmp gpu_run_logs
  tar czf "$OUT/runs.tgz" -C "$GPU_RUN_DIR" --exclude='*.safetensors' --exclude='*.bin' \
    --exclude='*.pt' --exclude='*.distcp' --exclude=rollouts . 2>/dev/null
  ls -la "$OUT"
  ;;
*)
  sed -n 2,12p "$0"
  exit 2
  ;;
esac
