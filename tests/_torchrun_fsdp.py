"""Run under torchrun by tests/test_fsdp_engine.py (and importable for its helpers).

Each rank trains on its slice of one fixed global batch (deliberately uneven, so ranks run
different numbers of real micro-batches), then saves an HF checkpoint and a DCP checkpoint
that a fresh engine resumes from; rank 0 writes the losses, the full updated weights and the
resume check to --out for the test to compare with a 1-rank run.
"""

from __future__ import annotations

import argparse
import os

import torch
from tensordict import TensorDict

from arealite.api.cli_args import FSDPConfig, MicroBatchSpec, OptimizerConfig, TrainEngineConfig
from arealite.engine.fsdp import iter_full_buckets, plan_buckets
from arealite.utils.data import pad_sequences_to_tensors

VOCAB = 600  # below the tiny model's vocabulary size


def make_batch(n: int = 8, seed: int = 0, min_len: int = 4, max_len: int = 40):
    """A padded batch with a loss mask on the second half of every sequence."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        prompt = max(1, length // 2)
        rows.append(
            {
                "input_ids": torch.randint(0, VOCAB, (length,), generator=g),
                "loss_mask": torch.tensor([0] * prompt + [1] * (length - prompt)),
            }
        )
    return pad_sequences_to_tensors(rows)


def engine_config(model_dir: str, max_tokens: int | None = None, **kw) -> TrainEngineConfig:
    """fp32 everywhere so 1-rank, 2-rank and plain PyTorch agree to 1e-5.

    Adam's first step is lr * g / (|g| + eps): near g = 0 it amplifies float-reduction noise
    (~1e-9 here, from a different summation order) by lr / eps, so eps = 1e-6 rather than
    1e-8 keeps the weight comparison meaningful at 1e-5."""
    opt = OptimizerConfig(lr=1e-3, weight_decay=0.01, gradient_clipping=1.0, eps=1e-6)
    return TrainEngineConfig(
        path=model_dir,
        fsdp=kw.pop("fsdp", FSDPConfig(param_dtype="float32", reduce_dtype="float32")),
        mb_spec=MicroBatchSpec(max_tokens_per_mb=max_tokens),
        optimizer=kw.pop("optimizer", opt),
        **kw,
    )


def full_weights(engine) -> dict[str, torch.Tensor]:
    """Every parameter, unsharded, on CPU (a collective: call on all ranks)."""
    out = {}
    for bucket in iter_full_buckets(plan_buckets(engine.model, 1 << 30)):
        out.update({k: v.clone() for k, v in bucket.items()})
    return out


def server_logprob_gap(post, engine, prompt: list[int]) -> float:
    """Max |trainer - server| logprob over 8 tokens the server samples after `prompt`
    (`post(path, body) -> json`): ~0 only when the server holds the trainer's weights."""
    body = {
        "input_ids": prompt,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 8, "temperature": 1.0, "ignore_eos": True},
    }
    out = post("/generate", body)
    server_lp = torch.tensor([x[0] for x in out["meta_info"]["output_token_logprobs"]])
    ids = torch.tensor([prompt + out["output_ids"]])
    td = TensorDict({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, batch_size=[1])
    return (engine.compute_logprobs(td)[0, len(prompt) :] - server_lp).abs().max().item()


def rank_slice(n: int, rank: int, world: int) -> slice:
    """Uneven split: rank 0 takes more rows than the others."""
    if world == 1:
        return slice(0, n)
    first = n // world + 2
    if rank == 0:
        return slice(0, first)
    rest = (n - first) // (world - 1)
    start = first + (rank - 1) * rest
    return slice(start, n if rank == world - 1 else start + rest)


def critic_batch(seed: int):
    """make_batch with PPO returns that depend on each sequence (its first token)."""
    batch = make_batch(seed=seed)
    target = (batch["input_ids"][:, :1] % 7).float() / 3.0 - 1.0
    mask = batch["loss_mask"].bool() & batch["attention_mask"].bool()
    batch["returns"] = torch.where(mask, target.expand_as(mask), 0.0)
    return batch


def train_variant(mode: str, model_dir: str, max_tokens: int, steps: int, rank: int, world: int):
    """`critic`: FSDPPPOCritic value steps (values from compute_values, then ppo_update);
    `lora`: a LoRA actor's steps (FSDPLMEngine with adapters on q/k/v/o). Each rank takes its
    uneven slice of the same global batches. Returns (per-step stats, full weights)."""
    from arealite.api.cli_args import PPOCriticConfig
    from arealite.api.lora_config import LoRAConfig
    from arealite.engine.ppo.critic import FSDPPPOCritic
    from arealite.engine.sft.lm_engine import FSDPLMEngine

    if mode == "critic":
        base = engine_config(model_dir, max_tokens)
        keys = ("path", "fsdp", "mb_spec", "optimizer")
        engine = FSDPPPOCritic(PPOCriticConfig(**{k: getattr(base, k) for k in keys}))
    else:
        lora = LoRAConfig(rank=4, alpha=8.0)
        engine = FSDPLMEngine(engine_config(model_dir, max_tokens, lora=lora))
    engine.initialize(None, None)
    stats = []
    for step in range(steps):
        batch = critic_batch(step) if mode == "critic" else make_batch(seed=step)
        batch = batch[rank_slice(batch.batch_size[0], rank, world)]
        if mode == "critic":
            batch["values"] = engine.compute_values(batch)
            stats.append(engine.ppo_update(batch))
        else:
            stats.append(engine.train_lm(batch))
    weights = full_weights(engine)
    engine.destroy()
    return stats, weights


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--hf-dir", required=True)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--mode", choices=("lm", "critic", "lora"), default="lm")
    a = p.parse_args()
    if a.mode != "lm":  # critic / LoRA actor: stats and weights only
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        stats, weights = train_variant(a.mode, a.model, a.max_tokens, a.steps, rank, world)
        if rank == 0:
            torch.save({"stats": stats, "weights": weights, "world": world}, a.out)
        return

    from arealite.api.io_struct import SaveLoadMeta
    from arealite.engine.sft.lm_engine import FSDPLMEngine
    from arealite.utils import distributed as du

    engine = FSDPLMEngine(engine_config(a.model, a.max_tokens, weight_update_bucket_mb=1))
    engine.initialize(None, None)
    rank, world = du.rank(), du.world_size()
    stats = []
    for step in range(a.steps):
        batch = make_batch(seed=step)
        stats.append(engine.train_lm(batch[rank_slice(batch.batch_size[0], rank, world)]))
    weights = full_weights(engine)
    engine.save(SaveLoadMeta(path=a.hf_dir, weight_format="hf"))

    # Recovery across 2 ranks: a fresh engine resumes from DCP and takes the same next step.
    dcp = SaveLoadMeta(path=a.hf_dir + "_dcp", weight_format="dcp", with_optim=True)
    engine.save(dcp)
    resumed = FSDPLMEngine(engine_config(a.model, a.max_tokens))
    resumed.initialize(None, None)
    resumed.load(dcp)
    nxt = make_batch(seed=a.steps)[rank_slice(8, rank, world)]
    resume = [engine.train_lm(nxt)["loss"], resumed.train_lm(nxt)["loss"]]
    after = [full_weights(engine), full_weights(resumed)]

    # A bad batch on the last rank only: every rank must raise, none may hang.
    bad = make_batch(n=2)
    if rank == world - 1:
        bad = bad.exclude("loss_mask")
    try:
        engine.train_lm(bad)
        raised = None
    except Exception as e:  # recorded for the test to check
        raised = f"{type(e).__name__}: {e}"
    if rank == 0:
        diff = max((after[0][k] - after[1][k]).abs().max().item() for k in after[0])
        out = {"stats": stats, "weights": weights, "world": world, "resume": resume, "diff": diff}
        torch.save({**out, "bad_batch_error": raised}, a.out)
    resumed.destroy()
    engine.destroy()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
