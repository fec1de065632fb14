"""Process groups for trainer ranks: one code path for torchrun, a bare `python`, CPU and GPU.

Several engines live in one process (actor, reference, critic) and share the default process
group, so `init_distributed` is reference-counted: the first caller creates the group, the last
`release_distributed` destroys it.

Backends: gloo on CPU; on GPU `cpu:gloo,cuda:nccl`, so CPU tensors (scalar stats, checkpoint
metadata) and CUDA tensors (FSDP collectives) both have a backend.
"""

from __future__ import annotations

import contextlib
import datetime
import os

import torch
import torch.distributed as dist

from arealite.utils.network import find_free_port

_REFCOUNT = 0
_OWNED = False  # whether we created the default group (and so may destroy it)


def default_backend() -> str:
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def current_device() -> torch.device:
    """This rank's accelerator (the LOCAL_RANK-th visible GPU) or the CPU. Two ranks never
    share a GPU: NCCL refuses it, and FSDP would run out of memory or deadlock."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    n = torch.cuda.device_count()
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if local_rank() >= n or ranks > n:
        raise RuntimeError(
            f"{ranks} trainer rank(s) on this node but only {n} visible GPU(s) "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}): each rank "
            "needs its own GPU; lower the trainer's data parallelism or free GPUs (the "
            "launchers hand each rank one, after the inference servers' GPUs)"
        )
    return torch.device("cuda", local_rank())


def init_distributed(addr: str | None = None, timeout_s: float = 1800.0) -> None:
    """Join (or create) the default process group.

    - Already initialised (by us or by the caller): reuse it.
    - `addr` = "host:port": TCP rendezvous there; RANK / WORLD_SIZE from the env (default 0/1).
    - torchrun env (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set): `env://`.
    - Otherwise a 1-rank group on a free loopback port, so `python train.py` just works.
    """
    global _REFCOUNT, _OWNED
    _REFCOUNT += 1
    if dist.is_initialized():
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(current_device())
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if addr:
        init_method = f"tcp://{addr}"
    elif all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        init_method = "env://"
    else:
        if world != 1:
            raise RuntimeError(
                f"WORLD_SIZE={world} but no MASTER_ADDR/MASTER_PORT: launch with torchrun"
            )
        init_method = f"tcp://127.0.0.1:{find_free_port()}"
    dist.init_process_group(
        backend=default_backend(),
        init_method=init_method,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    _OWNED = True


def release_distributed() -> None:
    """Undo one `init_distributed`; the last release destroys a group we created."""
    global _REFCOUNT, _OWNED
    _REFCOUNT = max(0, _REFCOUNT - 1)
    if _REFCOUNT == 0 and _OWNED and dist.is_initialized():
        dist.destroy_process_group()
        _OWNED = False


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main() -> bool:
    return rank() == 0


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_reduce_sum(values: list[float]) -> list[float]:
    """Sum a few Python scalars over ranks in one collective (float64 on CPU)."""
    t = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized() and world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def all_reduce_max(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized() and world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def all_gather_int(value: int) -> list[int]:
    """Every rank's `value`, in rank order."""
    if not (dist.is_initialized() and world_size() > 1):
        return [int(value)]
    out = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size())]
    dist.all_gather(out, torch.tensor([int(value)], dtype=torch.int64))
    return [int(t.item()) for t in out]


def all_gather_objects(values: list) -> list:
    """Every rank's list `values`, concatenated in rank order (picklable items)."""
    if not (dist.is_initialized() and world_size() > 1):
        return list(values)
    out: list = [None] * world_size()
    dist.all_gather_object(out, values)
    return [v for part in out for v in part]


def raise_if_any_rank_failed(error: BaseException | None) -> None:
    """Collective: re-raise `error` here, or fail on every other rank too, so one rank's bad
    input cannot leave the rest blocked in their next collective."""
    failed = [r for r, bad in enumerate(all_gather_int(error is not None)) if bad]
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(f"rank(s) {failed} failed (see their error); stopping here too")


@contextlib.contextmanager
def _own_tcp_store():
    """torchrun sets TORCHELASTIC_USE_AGENT_STORE=True in its workers, which makes a `tcp://`
    rendezvous connect to the agent's store as a client, even on rank 0. For a group of our
    own (trainer rank 0 + inference servers) rank 0 must host the store on the group's port,
    or every member waits for a store nobody serves."""
    key = "TORCHELASTIC_USE_AGENT_STORE"
    old = os.environ.get(key)
    os.environ[key] = "False"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old


def init_custom_process_group(
    backend: str,
    init_method: str,
    world_size: int,
    rank: int,
    group_name: str,
    timeout_s: float = 600.0,
) -> dist.ProcessGroup:
    """A process group *outside* the default one (e.g. trainer rank 0 + inference servers).

    Mirrors SGLang's `init_custom_process_group` (store prefixed by `group_name`), which the
    server side of `/init_weights_update_group` uses, so both sides rendezvous identically.
    """
    from torch.distributed.distributed_c10d import (
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    timeout = datetime.timedelta(seconds=timeout_s)
    with _own_tcp_store():
        store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(
        world_size, rank, [], backend, store, group_name=group_name, timeout=timeout
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg
