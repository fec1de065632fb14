"""Can a critic learn the returns of a policy's arithmetic rollouts at all? Fit one offline.

Samples `--prompts` x 4 rollouts of POLICY (temperature 1, training expressions) plus a held-out
set of rollouts, labels them with the exact verifier, then trains an FSDPPPOCritic from
`--critic-init` (default: POLICY) with the same GAE targets as PPO (gamma 1, lambda 0.95, value
clip 0.2) for `--epochs` passes of 64-sequence batches. One JSON line per epoch: explained
variance on the training batches (before each update, as PPO logs it) and on the held-out
rollouts. Compare with bench/critic_ev_ceiling.py (what a perfect critic would reach).

    .venv/bin/python bench/critic_offline_fit.py POLICY [--critic-init DIR] [--lr 1e-4]
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from arealite.api.cli_args import (
    FSDPConfig,
    MicroBatchSpec,
    OptimizerConfig,
    PPOActorConfig,
    PPOCriticConfig,
)
from arealite.api.presets import ACTOR_PRESETS
from arealite.engine.ppo.actor import PPOActor
from arealite.engine.ppo.critic import FSDPPPOCritic, explained_variance
from arealite.engine.rm.preference_data import prompt_ids, sample_answers
from arealite.tasks.arith import generate_arith_problems
from arealite.utils.data import pad_sequences_to_tensors


def rollouts(model, tok, n_prompts: int, seed: int):
    problems = generate_arith_problems(n_prompts, seed, "train", 1, 3, "+", 0.2)
    answers = sample_answers(model, tok, [f"{e}=" for e, _ in problems], 4)
    rows = []
    for (e, v), texts in zip(problems, answers):
        p = prompt_ids(tok, {"prompt": f"{e}="})
        for text in texts:
            c = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            rows.append(
                {
                    "input_ids": torch.tensor(p + c),
                    "loss_mask": torch.tensor([0] * len(p) + [1] * len(c)),
                    "rewards": torch.tensor(float(text.strip() == str(v))),
                }
            )
    batch = pad_sequences_to_tensors(rows)
    batch["logprobs"] = torch.zeros(batch["input_ids"].shape)
    return batch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("policy")
    ap.add_argument("--critic-init")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=256)
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(args.policy)
    model = AutoModelForCausalLM.from_pretrained(args.policy).eval()
    torch.manual_seed(0)
    train, test = rollouts(model, tok, args.prompts, 1), rollouts(model, tok, 64, 2)
    ppo = ACTOR_PRESETS["ppo"]  # the loader applies presets; a bare dataclass needs them here
    gae = PPOActor(PPOActorConfig(path=args.policy, group_size=4, **ppo), engine=None)
    critic = FSDPPPOCritic(
        PPOCriticConfig(
            path=args.critic_init or args.policy,
            fsdp=FSDPConfig(param_dtype="float32"),
            mb_spec=MicroBatchSpec(max_tokens_per_mb=8192),
            optimizer=OptimizerConfig(lr=args.lr, weight_decay=0.0),
        )
    )
    critic.initialize(None, None)
    for epoch in range(args.epochs):
        evs = []
        for i in range(0, train.batch_size[0], 64):
            b = train[i : i + 64].clone()
            b["values"] = critic.compute_values(b)
            gae.compute_advantages(b)
            evs.append(critic.ppo_update(b)["explained_variance"])
        t = test.clone()
        t["values"] = critic.compute_values(t)
        gae.compute_advantages(t)
        print(
            json.dumps(
                {
                    "epoch": epoch,
                    "train_ev_mean": round(sum(evs) / len(evs), 3),
                    "train_ev_max": round(max(evs), 3),
                    "held_out_ev": round(explained_variance(t["values"], t["returns"], t), 3),
                }
            ),
            flush=True,
        )
    critic.destroy()


if __name__ == "__main__":
    main()
