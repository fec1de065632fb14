"""The project's GRPO loop vs the simplest synchronous loop a user would write with plain HF.

Same model (a random ~5M Qwen2 built offline), same batch shape: 4 arithmetic prompts x 8
samples, 16 new tokens, temperature 1, decoupled PPO with eta = 2 on one embedded server and
one trainer rank (the local launcher gives each one of the two cores). The baseline, in one
process with both cores: `model.generate` (bf16 autocast) on the 4 x 8 samples, the exact-match
reward, group-normalised advantages, one PyTorch step (forward, backward, clip, AdamW).

Figures (one JSON line each): steps/s of `sync_hf_<n>thread` (median over steps after a
warm-up, with 1 and with --threads torch threads; the faster is the baseline),
`arealite_eta2` and `arealite_eta0` (from each run's metrics.jsonl, step 0 left out: it
carries the first-call warm-ups), then `ratio`: arealite eta=2 / sync HF (goal >= 2) and
arealite eta=2 / eta=0 (aim >= 1.3), plus each run's per-phase seconds.

    python bench/grpo_vs_sync_hf.py [--steps 40] [--eta 2] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from bench_io import make_workdir
from e2e_async_vs_sync import emit, launch, read_metrics

N_PROMPTS, N_SAMPLES, NEW_TOKENS = 4, 8, 16


def build_model(workdir: str) -> str:
    from arealite.testing.tiny_model import build_tiny_model, model_sizes

    return build_tiny_model(os.path.join(workdir, "model"), **model_sizes(256, 6, 8, 768, 4))


def sync_hf_loop(model_dir: str, steps: int, threads: int) -> list[float]:
    """The baseline: generate, score, one train step; seconds per step."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from arealite.tasks import get_custom_dataset
    from arealite.tasks.arith import arith_reward_fn

    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = get_custom_dataset(
        "arith",
        0,
        1,
        type="rl",
        split="train",
        tokenizer=tok,
        size=4096,
        max_digits=1,
        n_operands=3,
    )
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        rows = [data[(step * N_PROMPTS + i) % len(data)] for i in range(N_PROMPTS)]
        prompts = [
            tok.apply_chat_template(r["messages"], tokenize=False, add_generation_prompt=True)
            for r in rows
        ]
        enc = tok(prompts, return_tensors="pt", padding=True)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            seqs = model.generate(
                **enc,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                max_new_tokens=NEW_TOKENS,
                num_return_sequences=N_SAMPLES,
                pad_token_id=tok.pad_token_id,
            )
        P = enc["input_ids"].shape[1]
        texts = tok.batch_decode(seqs[:, P:], skip_special_tokens=True)
        rewards = torch.tensor(
            [
                float(arith_reward_fn(None, t, None, None, **rows[i // N_SAMPLES]))
                for i, t in enumerate(texts)
            ]
        )
        groups = rewards.view(N_PROMPTS, N_SAMPLES)
        adv = (groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-5)
        attn = (seqs != tok.pad_token_id).long()
        attn[:, :P] = enc["attention_mask"].repeat_interleave(N_SAMPLES, 0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=seqs, attention_mask=attn).logits[:, P - 1 : -1]
        logp = logits.float().log_softmax(-1).gather(-1, seqs[:, P:, None])[..., 0]
        mask = attn[:, P:].float()
        loss = -(torch.exp(logp - logp.detach()) * adv.flatten()[:, None] * mask).sum() / mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return times


def run_arealite(workdir: str, model: str, steps: int, eta: int) -> dict:
    name = f"eta{eta}"
    overrides = [
        f"cluster.fileroot={workdir}",
        "experiment_name=bench",
        f"trial_name={name}",
        f"actor.path={model}",
        f"total_train_steps={steps}",
        "valid_dataset=null",
        "saver.freq_steps=null",
        f"rollout.max_head_offpolicyness={eta}",
        f"train_dataset.batch_size={N_PROMPTS}",
        f"gconfig.n_samples={N_SAMPLES}",
        f"gconfig.max_new_tokens={NEW_TOKENS}",
        "actor.optimizer.lr=1e-4",
    ]
    launch("grpo.py", "arith_grpo.yaml", overrides, os.path.join(workdir, f"{name}.log"))
    records = read_metrics(os.path.join(workdir, "bench", name))[1:]
    wall = [r["wall_time"] for r in records]
    phases = ("rollout", "train_step", "update_weights")
    return {
        "steps_per_s": round((len(wall) - 1) / (wall[-1] - wall[0]), 3),
        **{
            f"s_{p}": round(statistics.median(r.get(f"timeperf/{p}") or 0 for r in records), 4)
            for p in phases
        },
        "staleness_mean": round(statistics.mean(r.get("staleness") or 0 for r in records), 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--eta", type=int, default=2)
    p.add_argument("--threads", type=int, default=2, help="torch threads of the HF baseline")
    p.add_argument("--workdir")
    a = p.parse_args()
    workdir = make_workdir(a.workdir, "grpo_vs_sync_hf_")
    model = build_model(workdir)
    hf = {}  # the baseline at its best thread count (2 threads lose badly on a loaded machine)
    for threads in sorted({1, a.threads}):
        hf[threads] = statistics.median(sync_hf_loop(model, a.steps, threads)[3:])
        emit(
            f"sync_hf_{threads}thread",
            steps_per_s=round(1 / hf[threads], 3),
            s_step=round(hf[threads], 4),
        )
    hf_best = min(hf.values())
    runs = {eta: run_arealite(workdir, model, a.steps, eta) for eta in (a.eta, 0)}
    for eta, r in runs.items():
        emit(f"arealite_eta{eta}", **r)
    emit(
        "ratio",
        arealite_over_sync_hf=round(runs[a.eta]["steps_per_s"] * hf_best, 3),
        async_over_sync=round(runs[a.eta]["steps_per_s"] / runs[0]["steps_per_s"], 3),
        workdir=workdir,
    )


if __name__ == "__main__":
    main()
