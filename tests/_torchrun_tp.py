"""Run under torchrun by tests/test_tensor_parallel.py: one launch per mesh (d1t2 on 2 ranks,
d2t2 on 4) does every check, since starting ranks dominates the cost on CPU.

Each rank takes its uneven slice of fixed global batches (data is split over all ranks, as
at t1; the engine joins a tensor group's slices). Rank 0 writes to --out: the per-token
logprobs (gathered back into global order), one SFT and one PPO step's stats and weights,
what each weight-update path hands the servers after the PPO step, and, with --resume-from, the next SFT step of an engine resumed from a DCP checkpoint that
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
    """One PPO step; then the HF export (rank 0 writes, DTensors gathered) and the weight
    updates (disk, buckets, tensor handles, a gloo broadcast to a receiving process)."""
    from arealite.api.io_struct import SaveLoadMeta
    from arealite.engine.ppo.actor import FSDPPPOActor

    actor = FSDPPPOActor(ppo_config(model_dir, tp))
    actor.initialize(None, None)
    stats = actor.ppo_update(ppo_batch()[rank_slice(N_SEQS, rank, world)])
    actor.save(SaveLoadMeta(path=hf_dir, weight_format="hf"))
    out = {"ppo": stats, "ppo_weights": full_weights(actor)}
    out["update"] = weight_updates(actor, rank, hf_dir + "_update", broadcast=True)
    actor.destroy()
    return out


UPDATE_BUCKET_MB = 1  # several buckets for the tiny model (~11 MB of fp32 weights)


def weight_updates(actor, rank: int, disk_dir: str, broadcast: bool) -> dict:
    """What each weight-update path hands the inference servers (rank 0's view; all ranks
    call, the gathers are collectives), by checkpoint name:
    - disk: the HF checkpoint `upload_weights(from_disk)` writes, read back as a server would;
    - buckets: `full_weight_buckets` (the colocated copy and the tensor path's source), which
      every rank must hold whole and alike ("buckets_agree": plain tensors, equal everywhere);
    - tensor: the payloads of `weight_handles`, opened by the server's own deserializer;
    - distributed (broadcast=True): `upload_weights(nccl meta)` over gloo to a receiving
      process that runs the server's group join and receive (arealite/server/weight_sync.py)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from arealite.api.io_struct import WeightUpdateMeta
    from arealite.checkpoint.save_load import load_safetensors_dir
    from arealite.utils.tensor_handles import deserialize_named_tensors

    out = {}
    actor.upload_weights(WeightUpdateMeta.from_disk(disk_dir, 1))
    if rank == 0:
        out["disk"] = load_safetensors_dir(disk_dir)
    buckets, plain = {}, True
    for bucket in actor.full_weight_buckets(UPDATE_BUCKET_MB):
        plain &= not any(isinstance(t, DTensor) for t in bucket.values())
        buckets.update({k: t.detach().clone() for k, t in bucket.items()})
    out["buckets"], out["buckets_agree"] = buckets, plain
    if dist.get_world_size() > 1:
        views = [None] * dist.get_world_size()
        dist.all_gather_object(views, (plain, buckets))
        out["buckets_agree"] = all(
            ok and v.keys() == buckets.keys() and all(torch.equal(v[k], buckets[k]) for k in v)
            for ok, v in views
        )
    with actor.weight_handles(UPDATE_BUCKET_MB) as payloads:
        opened = [deserialize_named_tensors(p) for p in payloads]
        out["tensor"] = {n: t.clone() for named in opened for n, t in named}
    if broadcast:
        out["distributed"] = broadcast_to_receiver(actor, rank, disk_dir + "_received.pt")
    return out


def receive_weights(port: int, specs: list, path: str) -> None:
    """An inference server's side of the distributed update, minus HTTP: join the group as
    rank 1, receive bucket after bucket (the body each /update_weights_from_distributed
    gets), save what arrived."""
    from arealite.server.weight_sync import GroupSpec, WeightGroups, parse_tensor_specs

    groups = WeightGroups(torch.device("cpu"))
    groups.join(GroupSpec("127.0.0.1", port, 1, 2, "tp_weight_update", "gloo"))
    group, got = groups.get("tp_weight_update"), {}
    for bucket in specs:
        names, shapes, dtypes = zip(*bucket)
        body = {"names": list(names), "shapes": list(shapes), "dtypes": list(dtypes)}
        got.update(dict(groups.receive(group, parse_tensor_specs(body))))
    torch.save(got, path)


def broadcast_to_receiver(actor, rank: int, path: str) -> dict | None:
    """Rank 0 broadcasts every bucket (other ranks gather) to a spawned receiver."""
    import multiprocessing as mp

    from arealite.api.io_struct import WeightUpdateMeta
    from arealite.utils.network import find_free_port

    port = find_free_port() if rank == 0 else 0
    meta = WeightUpdateMeta.from_nccl("127.0.0.1", port, 1, UPDATE_BUCKET_MB, world_size=2)
    meta.nccl_group_name, meta.nccl_backend = "tp_weight_update", "gloo"
    if rank != 0:
        actor.upload_weights(meta)
        return None
    meta.nccl_param_specs = actor.nccl_param_specs(UPDATE_BUCKET_MB)
    receiver = mp.get_context("spawn").Process(
        target=receive_weights, args=(port, meta.nccl_param_specs, path)
    )
    receiver.start()
    actor.upload_weights(meta)
    receiver.join(timeout=300)
    assert receiver.exitcode == 0, f"weight receiver exited with {receiver.exitcode}"
    return torch.load(path)


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
