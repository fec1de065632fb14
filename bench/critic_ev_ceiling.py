"""The explained variance a PERFECT critic would reach on a policy's arithmetic rollouts.

PPO's explained variance is 1 - Var(R - V) / Var(R) over response tokens. Even the exact value
function V*(s_t) = P(correct | prefix) leaves the variance of the tokens not yet sampled: at
temperature 1 a policy that is right 20% of the time is mostly a coin flip at its first digit,
so V* there is ~0.2 whatever the critic knows. This script samples `--n` rollouts per prompt
from `MODEL` (as GRPO does: temperature 1), computes V* exactly from the policy's own
probabilities of the correct continuation, and prints the EV of V* against the outcome, per
response position and overall: the ceiling any critic can reach on that policy.

    .venv/bin/python bench/critic_ev_ceiling.py MODEL [MODEL ...] [--prompts 200] [--n 4]
        [--config examples/configs/arith_ppo.yaml]  # its train_dataset options (e.g. a `mix`)

Without --config the prompts are the demo's uniform task (sums of three digits).
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from arealite.engine.rm.preference_data import prompt_ids, sample_answers
from arealite.tasks.arith import generate_arith_problems, generate_mixed_problems


@torch.no_grad()
def value_star(model, prompt: list[int], answer: list[int], prefix: list[int]) -> float:
    """P(the policy completes `prefix` into exactly `answer` + EOS): 0 off the answer."""
    if prefix != answer[: len(prefix)]:
        return 0.0
    ids = torch.tensor([prompt + answer])
    logp = model(ids).logits[0].log_softmax(-1)
    start = len(prompt) + len(prefix) - 1
    return float(sum(logp[start + i, t] for i, t in enumerate(answer[len(prefix) :])).exp())


def problems_of(config: str | None, n_prompts: int) -> list[tuple[str, int]]:
    """The training prompts of `config`'s arith options (a `mix` or one difficulty)."""
    if config is None:
        return generate_arith_problems(n_prompts, 0, "train", 1, 3, "+", 0.2)
    from omegaconf import OmegaConf

    opts = OmegaConf.to_container(OmegaConf.load(config).train_dataset.options)
    knobs = {k: opts.get(k, d) for k, d in (("max_digits", 2), ("n_operands", 2), ("ops", "+"))}
    if opts.get("mix"):
        return generate_mixed_problems(n_prompts, 0, "train", knobs, opts["mix"], 0.2)
    return generate_arith_problems(n_prompts, 0, "train", **knobs)


def ceiling(model_dir: str, n_prompts: int, n: int, config: str | None = None) -> dict:
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    problems = problems_of(config, n_prompts)
    torch.manual_seed(0)
    samples = sample_answers(model, tok, [f"{e}=" for e, _ in problems], n)
    per_pos: dict[int, list[tuple[float, float]]] = {}
    for (e, v), answers in zip(problems, samples):
        prompt = prompt_ids(tok, {"prompt": f"{e}="})
        gold = tok(str(v), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        for text in answers:
            ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            r = float(text.strip() == str(v))
            for t in range(len(ids)):  # the value of the state before response token t
                per_pos.setdefault(t, []).append((r, value_star(model, prompt, gold, ids[:t])))

    def ev(pairs):
        r = torch.tensor([p[0] for p in pairs])
        d = r - torch.tensor([p[1] for p in pairs])
        return round(1 - float(d.var() / r.var()), 3) if r.var() > 0 else None

    everything = [p for pairs in per_pos.values() for p in pairs]
    return {
        "model": model_dir,
        "accuracy_t1": round(sum(p[0] for p in per_pos[0]) / len(per_pos[0]), 3),
        "ev_ceiling": ev(everything),
        "ev_ceiling_by_position": {t: ev(p) for t, p in sorted(per_pos.items()) if len(p) > 20},
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+")
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--config", help="a YAML whose train_dataset.options give the prompts")
    args = ap.parse_args()
    for m in args.models:
        print(json.dumps(ceiling(m, args.prompts, args.n, args.config)))


if __name__ == "__main__":
    main()
