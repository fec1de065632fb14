"""Run under torchrun by tests/test_tensor_parallel.py: one launch per mesh (d1t2 on 2 ranks,
d2t2 on 4) does every check, since starting ranks dominates the cost on CPU.

Each rank takes its uneven slice of fixed global batches (data is split over all ranks, as
at t1; the engine joins a tensor group's slices). Rank 0 writes to --out: the per-token
logprobs (gathered back into global order), one SFT and one PPO step's stats and weights,
and, with --resume-from, the next SFT step of an engine resumed from a DCP checkpoint that
another mesh wrote; --save-dcp writes this mesh's checkpoint after its SFT step.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from _torchrun_fsdp import engine_config, full_weights, make_batch, rank_slice

N_SEQS = 8


def ppo_batch(seed: int = 7):
    """make_batch plus fixed advantages and behaviour logprobs (ratios away from 1, so the
    PPO clip is active on some tokens)."""
    batch = make_batch(n=N_SEQS, seed=seed)
    g = torch.Generator().manual_seed(seed)
    mask = batch["loss_mask"].float()
    batch["advantages"] = torch.randn(mask.shape, generator=g) * mask
    batch["logprobs"] = (-7.0 + 0.3 * torch.randn(mask.shape, generator=g)) * mask
    return batch


def ppo_config(model_dir: str, tp: int):
    from arealite.api.cli_args import PPOActorConfig

    base = engine_config(model_dir, 48)
    keys = ("path", "fsdp", "mb_spec", "optimizer")
    fields = {k: getattr(base, k) for k in keys}
    # old = the behaviour logprobs (not recomputed): ratios away from 1, the clip active
    return PPOActorConfig(**fields, tensor_parallel_size=tp, recompute_logprob=False)


def gather_rows(x: torch.Tensor) -> torch.Tensor:
    """Every rank's rows, in rank order (the global batch order of rank_slice)."""
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, x)
    return torch.cat(parts)


def sft_checks(model_dir: str, tp: int, rank: int, world: int, dcp_dir: str | None) -> dict:
    from arealite.api.io_struct import SaveLoadMeta
    from arealite.engine.sft.lm_engine import FSDPLMEngine

    engine = FSDPLMEngine(engine_config(model_dir, 48, tensor_parallel_size=tp))
    engine.initialize(None, None)
    batch = make_batch(n=N_SEQS, seed=0)
    mine = batch[rank_slice(N_SEQS, rank, world)]
    logp, ent = engine.compute_logprobs(mine, with_entropy=True)
    out = {"logprobs": gather_rows(logp), "entropy": gather_rows(ent)}
    out["sft"] = engine.train_lm(mine)
    out["bad_batch_error"] = bad_batch_error(engine, rank, world)
    out["sft_weights"] = full_weights(engine)
    if dcp_dir:
        engine.save(SaveLoadMeta(path=dcp_dir, weight_format="dcp", with_optim=True))
    engine.destroy()
    return out


def bad_batch_error(engine, rank: int, world: int) -> str | None:
    """The last rank's batch has a key the others lack: every rank must raise, none hang."""
    bad = make_batch(n=2, seed=5)
    if rank == world - 1:
        bad["extra"] = bad["loss_mask"].clone()
    try:
        engine.train_lm(bad)
    except Exception as e:  # recorded for the test to check
        return f"{type(e).__name__}: {e}"
    return None


def resume_check(model_dir: str, tp: int, rank: int, world: int, dcp_dir: str) -> dict:
    """Resume from a checkpoint another mesh wrote after its first step; take the next."""
    from arealite.api.io_struct import SaveLoadMeta
    from arealite.engine.sft.lm_engine import FSDPLMEngine

    engine = FSDPLMEngine(engine_config(model_dir, 48, tensor_parallel_size=tp))
    engine.initialize(None, None)
    engine.load(SaveLoadMeta(path=dcp_dir, weight_format="dcp", with_optim=True))
    nxt = make_batch(n=N_SEQS, seed=1)[rank_slice(N_SEQS, rank, world)]
    out = {"resumed": engine.train_lm(nxt), "resumed_weights": full_weights(engine)}
    engine.destroy()
    return out


def ppo_check(model_dir: str, tp: int, rank: int, world: int, hf_dir: str) -> dict:
    """One PPO step; then the HF export (rank 0 writes, DTensors gathered)."""
    from arealite.api.io_struct import SaveLoadMeta
    from arealite.engine.ppo.actor import FSDPPPOActor

    actor = FSDPPPOActor(ppo_config(model_dir, tp))
    actor.initialize(None, None)
    stats = actor.ppo_update(ppo_batch()[rank_slice(N_SEQS, rank, world)])
    actor.save(SaveLoadMeta(path=hf_dir, weight_format="hf"))
    out = {"ppo": stats, "ppo_weights": full_weights(actor)}
    actor.destroy()
    return out


def critic_step(model_dir: str, tp: int, rank: int, world: int) -> dict:
    """A critic's values and one value-loss step (tensor-parallel backbone, whole head)."""
    from _torchrun_fsdp import critic_batch

    from arealite.api.cli_args import PPOCriticConfig
    from arealite.engine.ppo.critic import FSDPPPOCritic

    base = engine_config(model_dir, 48)
    keys = ("path", "fsdp", "mb_spec", "optimizer")
    critic = FSDPPPOCritic(
        PPOCriticConfig(**{k: getattr(base, k) for k in keys}, tensor_parallel_size=tp)
    )
    critic.initialize(None, None)
    batch = critic_batch(0)[rank_slice(N_SEQS, rank, world)]
    batch["values"] = critic.compute_values(batch)
    out = {"values": {"all": gather_rows(batch["values"]) if world > 1 else batch["values"]}}
    out["critic"] = critic.ppo_update(batch)
    out["critic_weights"] = full_weights(critic)
    critic.destroy()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--hf-dir", required=True)
    p.add_argument("--save-dcp", default=None)
    p.add_argument("--resume-from", default=None)
    a = p.parse_args()
    from arealite.utils import distributed as du

    du.init_distributed()  # one process group for the engines one after another
    rank, world = du.rank(), du.world_size()
    out = {"world": world}
    out.update(sft_checks(a.model, a.tp, rank, world, a.save_dcp))
    out.update(ppo_check(a.model, a.tp, rank, world, a.hf_dir))
    if a.resume_from:
        out.update(resume_check(a.model, a.tp, rank, world, a.resume_from))
        out.update(critic_step(a.model, a.tp, rank, world))
    if rank == 0:
        torch.save(out, a.out)
    du.release_distributed()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
