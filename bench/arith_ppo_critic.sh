#!/usr/bin/env bash
# Issue 15's PPO-with-a-critic figures on a CPU, through the shipped launcher and YAMLs: explained
# variance and value loss of the critic, held-out accuracy, sync and async, on arithmetic at mixed
# difficulty (examples/configs/arith_sft_mixed.yaml, then arith_ppo.yaml); then the explained
# variance a PERFECT critic would reach on the same policies (bench/critic_ev_ceiling.py). For the
# uniform task (sums of three digits only), where no critic gets there, see
# bench/arith_critic_and_rm.sh. About 20 minutes on 2 idle cores (the SFT is 10 of them).
# Usage: bench/arith_ppo_critic.sh [WORKDIR]
W=${1:-runs/critic}
source "$(dirname "$0")/launch_env.sh"  # cd to the repo; PY, launch, final; the tiny model
[ -d "$W/arith-sft-mixed/demo/checkpoints/final" ] ||
  launch examples/sft.py --config examples/configs/arith_sft_mixed.yaml model.path="$W/tiny_model"
SFT=$(final arith-sft-mixed/demo)

echo "== PPO with a critic, sync then async (150 steps, the first 10 critic-only)"
PPO=(examples/grpo.py --config examples/configs/arith_ppo.yaml actor.path="$SFT" critic.path="$SFT")
launch "${PPO[@]}" trial_name=sync rollout.max_head_offpolicyness=0
launch "${PPO[@]}" trial_name=async
$PY bench/summarize_run.py "$W"/arith-ppo/sync "$W"/arith-ppo/async

echo "== explained variance of the exact value function: the SFT policy, then after async PPO"
$PY bench/critic_ev_ceiling.py "$SFT" "$(final arith-ppo/async)" \
  --config examples/configs/arith_ppo.yaml
