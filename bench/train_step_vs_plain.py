"""The trainer's PPO step vs one plain PyTorch step on the same model and tokens.

Figures (one JSON line per case, ratio last):
- `arealite_step`: seconds of `actor.compute_logp` (proximal logprobs; skipped automatically
  when the update can reuse its own forward) + `compute_advantages` + `ppo_update`
  (FSDPPPOActor, one trainer rank, the default dtype policy: fp32 master weights, `auto`
  compute (bf16 only where native), decoupled loss).
- `plain_step`: seconds of one plain PyTorch step on the same model weights and tokens: HF
  forward on the right-padded batch (sdpa + padding mask), bf16 autocast where native, logprobs,
  a policy-gradient loss, backward, gradient clipping, AdamW (fp32 master weights).
- `ratio` = arealite_step / plain_step (goal <= 1.3) and, in a fresh process each,
  `peak_rss_mb` of both (goal: arealite / plain <= 1.2 on case b).
Cases: (a) the tiny ~5M Qwen2, 32 sequences of 17..33 tokens (4 prompts x 8 samples, up to 16
new tokens); (b) a ~50M Qwen2, 16 sequences with lengths uniform over 64..512; (g) the demo's
GRPO batch: 2.5M Qwen2, 16 prompts x 8 samples sharing their 14-token prompt, 1..8 new tokens
(the trainer computes each shared prompt once, `actor.share_prompts`; the plain step pads). (l) long_sums' GRPO batch: the same model, 8 prompts x 8 samples, 20-token prompts, answers of
14..249 tokens. Both systems
alternate within one process (median over rounds) because the machine is shared and noisy.
`--profile` adds a torch.profiler breakdown of one arealite step (top ops by self CPU time).

    python bench/train_step_vs_plain.py [--cases a,b,g] [--rounds 5] [--profile]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from bench_io import emit

from arealite.utils.hardware import resolve_dtype

CASES = {
    # name: (hidden, layers, intermediate, heads, kv_heads, n_seqs, min_len, max_len, prompt_len)
    "a": dict(hidden=256, layers=6, inter=768, heads=8, kv=4, n=32, lo=17, hi=33, prompt=9),
    "b": dict(hidden=512, layers=12, inter=1536, heads=8, kv=4, n=16, lo=64, hi=512, prompt=32),
    # the demo's GRPO batch: its 2.5M model, 16 prompts x 8 samples, 14-token prompts that a
    # group shares, answers of 1..8 tokens
    "g": dict(
        hidden=256, layers=4, inter=512, heads=4, kv=2, n=128, lo=15, hi=22, prompt=14, group=8
    ),
    # long_sums' GRPO batch: the same model, 8 prompts x 8 samples, ~20-token prompts, answers
    # of 14..249 tokens (~6.7k tokens a step, as in its runs)
    "l": dict(
        hidden=256, layers=4, inter=512, heads=4, kv=2, n=64, lo=34, hi=269, prompt=20, group=8
    ),
}


def build_model(case: dict, out_dir: str) -> str:
    from arealite.testing.tiny_model import build_tiny_model, model_sizes

    sizes = model_sizes(case["hidden"], case["layers"], case["heads"], case["inter"], case["kv"])
    return build_tiny_model(out_dir, **sizes)


def make_batch(case: dict, vocab: int, seed: int = 0):
    """A GRPO-shaped batch: groups of 8 samples, behaviour logprobs near the model's, rewards."""
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(seed)
    n, lo, hi, p = case["n"], case["lo"], case["hi"], case["prompt"]
    lens = torch.randint(lo, hi + 1, (n,), generator=g)
    L = int(lens.max())
    ids = torch.randint(3, vocab, (n, L), generator=g)
    if case.get("group"):  # a group's samples share their prompt
        ids[:, :p] = ids[:: case["group"], :p].repeat_interleave(case["group"], 0)
    att = torch.arange(L)[None] < lens[:, None]
    loss_mask = att & (torch.arange(L)[None] >= p)
    ids = torch.where(att, ids, 0)
    logprobs = torch.where(loss_mask, -torch.rand(n, L, generator=g) * 5 - 3.0, 0.0)
    return TensorDict(
        dict(
            input_ids=ids,
            attention_mask=att,
            loss_mask=loss_mask.int(),
            logprobs=logprobs,
            versions=torch.where(loss_mask, 0, -1),
            rewards=torch.randint(0, 2, (n,), generator=g).float(),
        ),
        batch_size=[n],
    )


def make_actor(model_dir: str, group_size: int = 8):
    from arealite.api.cli_args import MicroBatchSpec, OptimizerConfig, PPOActorConfig
    from arealite.engine.ppo.actor import FSDPPPOActor

    cfg = PPOActorConfig(
        path=model_dir,
        group_size=group_size,
        use_decoupled_loss=True,
        behav_imp_weight_cap=5.0,
        mb_spec=MicroBatchSpec(max_tokens_per_mb=8192),
        optimizer=OptimizerConfig(lr=1e-6),
    )
    actor = FSDPPPOActor(cfg)
    actor.initialize(None, None)
    return actor


def arealite_step(actor, batch) -> None:
    batch = batch.clone()  # prox_logp: the actor recomputes it only when it must
    actor.compute_advantages(batch)
    actor.ppo_update(batch)


class PlainStep:
    """The baseline a user would write: HF model + AdamW, padded batch, bf16 autocast where the
    CPU computes bf16 natively (the trainer's `dtype: auto` rule)."""

    def __init__(self, model_dir: str):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation="sdpa"
        )
        self.model.config.use_cache = False
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-6)

    def __call__(self, batch) -> None:
        ids, att = batch["input_ids"], batch["attention_mask"]
        mask = batch["loss_mask"][:, 1:].bool()
        adv = batch["rewards"][:, None] - batch["rewards"].mean()
        bf16 = resolve_dtype("auto", "cpu") == "bfloat16"  # as the trainer's `dtype: auto`
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = self.model(input_ids=ids, attention_mask=att.long()).logits[:, :-1]
        logp = logits.float().log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
        ratio = torch.exp(logp - logp.detach())
        loss = -(ratio * adv * mask).sum() / mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def time_case(name: str, case: dict, rounds: int, profile: bool) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(case, tmp)
        actor = make_actor(model_dir)
        plain = PlainStep(model_dir)
        batch = make_batch(case, actor.model.config.vocab_size)
        n_params = sum(p.numel() for p in plain.model.parameters())
        systems = {"arealite": lambda: arealite_step(actor, batch), "plain": lambda: plain(batch)}
        for f in systems.values():
            f()  # warm-up
        times = {k: [] for k in systems}
        for r in range(rounds):
            order = list(systems) if r % 2 == 0 else list(systems)[::-1]
            for k in order:
                t0 = time.perf_counter()
                systems[k]()
                times[k].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        rss = {k: peak_rss(k, name) for k in systems}
        emit(
            f"train_step_{name}",
            n_params_m=round(n_params / 1e6, 1),
            n_seqs=case["n"],
            n_tokens=int(batch["attention_mask"].sum()),
            arealite_s=round(med["arealite"], 4),
            plain_s=round(med["plain"], 4),
            arealite_peak_rss_mb=rss["arealite"],
            plain_peak_rss_mb=rss["plain"],
            rss_ratio=round(rss["arealite"] / rss["plain"], 3),
            ratio=round(med["arealite"] / med["plain"], 3),
        )
        if profile:
            print_profile(name, systems["arealite"])
        actor.destroy()


def print_profile(name: str, step) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    print(f"# profile of one arealite step, case {name} (self CPU time)\n{table}", flush=True)


def peak_rss(system: str, case_name: str) -> float:
    """Peak RSS (MB) of a fresh process that builds the model and runs 3 steps of `system`."""
    out = subprocess.run(
        [sys.executable, __file__, "--rss-child", system, "--cases", case_name],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())},
    )
    if out.returncode != 0:
        raise RuntimeError(f"rss child {system}/{case_name} failed:\n{out.stderr[-3000:]}")
    return float(out.stdout.strip().splitlines()[-1])


def rss_child(system: str, case: dict) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(case, tmp)
        if system == "arealite":
            actor = make_actor(model_dir)
            batch = make_batch(case, actor.model.config.vocab_size)
            step = lambda: arealite_step(actor, batch)  # noqa: E731
        else:
            plain = PlainStep(model_dir)
            batch = make_batch(case, plain.model.config.vocab_size)
            step = lambda: plain(batch)  # noqa: E731
        for _ in range(3):
            step()
    print(vm_hwm_mb())


def vm_hwm_mb() -> float:
    """Peak RSS of this process image (VmHWM; ru_maxrss would carry the parent's over exec)."""
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="a,b,g")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--rss-child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    names = a.cases.split(",")
    if a.rss_child:
        return rss_child(a.rss_child, CASES[names[0]])
    for name in names:
        time_case(name, CASES[name], a.rounds, a.profile)


if __name__ == "__main__":
    main()
