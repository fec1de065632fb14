#!/usr/bin/env bash
# Issue 15's learning figures on a CPU, through the shipped launcher and YAMLs:
#   PPO with a critic (sync and async) on the UNIFORM task (the demo's sums of three digits;
#   the shipped mixed-difficulty figures come from bench/arith_ppo_critic.sh): explained
#   variance, value loss, held-out accuracy, and why a critic gets ~0 there;
#   reward models (likelihood, implicit and scalar heads) on the policy's own mistakes:
#   held-out pair accuracy by kind of mistake;
#   GRPO with an RM as the reward: TRUE held-out accuracy (exact verifier) before -> after.
# Two warm starts of the tiny model, same SFT recipe (examples/configs/arith_sft.yaml): the
# POLICY is the demo's (stopped at 90 steps, ~22% held-out, room for RL); the JUDGE backbone of
# the RM (and of one critic variant) is trained to convergence (400 steps, ~91% held-out): a
# model that cannot add cannot tell a right sum from a near miss, whatever its head. About 30
# minutes on 2 free cores.
# Usage: bench/arith_critic_and_rm.sh [WORKDIR]
W=${1:-runs/judges}
source "$(dirname "$0")/launch_env.sh"  # cd to the repo; PY, launch, final; the tiny model
SFT=(examples/sft.py --config examples/configs/arith_sft.yaml model.path="$W/tiny_model")
[ -d "$W/arith-sft/demo/checkpoints/final" ] || launch "${SFT[@]}"
[ -d "$W/arith-sft-judge/demo/checkpoints/final" ] || launch "${SFT[@]}" \
  experiment_name=arith-sft-judge total_train_steps=400 train_dataset.options.size=25600
POLICY=$(final arith-sft/demo) JUDGE=$(final arith-sft-judge/demo)

echo "== PPO with a critic on the uniform task (warm-up 10 steps): sync, async, async with the judge critic"
PPO=(examples/grpo.py --config examples/configs/arith_ppo.yaml actor.path="$POLICY"
     critic.path="$POLICY" total_train_steps=100 critic.warmup_steps=10
     train_dataset.options.mix=null valid_dataset.options.mix=null)
launch "${PPO[@]}" trial_name=sync rollout.max_head_offpolicyness=0
launch "${PPO[@]}" trial_name=async
launch "${PPO[@]}" trial_name=async-judge critic.path="$JUDGE" critic.optimizer.lr=3e-4 \
  critic.ppo_n_minibatches=2
echo "== explained variance a perfect critic would reach: SFT policy, then after PPO"
$PY bench/critic_ev_ceiling.py "$POLICY" "$(final arith-ppo/async)"
echo "== a critic fitted offline on the SFT policy's rollouts (from the SFT, then from the judge)"
$PY bench/critic_offline_fit.py "$POLICY"
$PY bench/critic_offline_fit.py "$POLICY" --critic-init "$JUDGE" --lr 3e-4

echo "== reward models on near misses + the policy's own wrong samples (held-out pair accuracy)"
RM_RUN=(examples/rm.py --config examples/configs/arith_rm_sft.yaml model.path="$JUDGE"
        train_dataset.options.sampled_negatives_from="$POLICY")
launch "${RM_RUN[@]}"  # the shipped head: likelihood (reference-free)
RM=$(final arith-rm-sft/demo)
$PY bench/rm_pair_accuracy.py "$RM" --policy "$POLICY"
launch "${RM_RUN[@]}" trial_name=implicit model.head=implicit  # DPO log-ratio to the judge
$PY bench/rm_pair_accuracy.py "$(final arith-rm-sft/implicit)" --policy "$POLICY"
launch "${RM_RUN[@]}" trial_name=scalar model.head=scalar model.optimizer.lr=3e-4
$PY bench/rm_pair_accuracy.py "$(final arith-rm-sft/scalar)" --policy "$POLICY"
UNTRAINED="$W/judge-as-likelihood-rm"  # the judge before any pair: what BT training adds
rm -rf "$UNTRAINED" && cp -r "$JUDGE" "$UNTRAINED"
echo '{"head": "likelihood", "beta": 0.1, "reference": null}' > "$UNTRAINED/reward_head.json"
$PY bench/rm_pair_accuracy.py "$UNTRAINED" --policy "$POLICY"

echo "== GRPO with an RM as the reward (true accuracy watched by the exact verifier)"
GRPO_RM=(examples/grpo.py --config examples/configs/arith_grpo_rm.yaml actor.path="$POLICY"
         ref.path="$POLICY")
launch "${GRPO_RM[@]}" "reward=[$RM,arith]"
launch "${GRPO_RM[@]}" "reward=[$RM,arith]" trial_name=seed2 seed=2
for seed in 1 2; do
  launch "${GRPO_RM[@]}" "reward=[$RM,arith]" trial_name=exact-verifier-$seed seed=$seed \
    "reward_weights=[0.0,1.0]"
  launch "${GRPO_RM[@]}" "reward=[$PWD/$UNTRAINED,arith]" trial_name=untrained-judge-$seed seed=$seed
done
launch "${GRPO_RM[@]}" "reward=[$(final arith-rm-sft/implicit),arith]" trial_name=implicit
$PY bench/summarize_run.py "$W"/arith-ppo/* "$W"/arith-grpo-rm/*
