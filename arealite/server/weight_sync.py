"""SGLang's distributed weight push: the trainer broadcasts tensors straight into the server;
and its tensor push: a trainer on the same GPU hands over CUDA IPC handles of its weights.

`/init_weights_update_group` joins a process group made with the same rendezvous as the
trainer's `arealite.utils.distributed.init_custom_process_group` (trainer rank 0, server ranks
from `rank_offset`); `/update_weights_from_distributed` then receives one bucket of tensors by
broadcast from rank 0. NCCL needs CUDA; on a CPU-only server the gloo backend does the same job.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from arealite.server.protocol import BadRequest, require_object
from arealite.utils.tensor_handles import deserialize_named_tensors

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


class Unsupported(Exception):
    """Asked for something this server cannot do here (answered with HTTP 501)."""


@dataclass(frozen=True)
class GroupSpec:
    master_address: str
    master_port: int
    rank: int
    world_size: int
    group_name: str
    backend: str


def parse_group_spec(body) -> GroupSpec:
    body = require_object(body)
    addr, port = body.get("master_address"), body.get("master_port")
    if not isinstance(addr, str) or not addr:
        raise BadRequest("master_address: required (host of the trainer's rank 0)")
    if isinstance(port, str) and port.isdigit():
        port = int(port)
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise BadRequest(f"master_port: expected a TCP port, got {port!r}")
    world, offset = body.get("world_size"), body.get("rank_offset")
    if not isinstance(world, int) or world < 2:
        raise BadRequest(f"world_size: expected an integer >= 2, got {world!r}")
    if not isinstance(offset, int) or not 0 < offset < world:
        raise BadRequest(f"rank_offset: expected an integer in [1, world_size), got {offset!r}")
    backend = body.get("backend") or "nccl"
    if backend not in ("nccl", "gloo"):
        raise BadRequest(f"backend: expected 'nccl' or 'gloo', got {backend!r}")
    name = body.get("group_name") or "weight_update_group"
    if not isinstance(name, str):
        raise BadRequest(f"group_name: expected a string, got {name!r}")
    return GroupSpec(addr, port, offset, world, name, backend)


def parse_tensor_specs(body: dict) -> list[tuple[str, torch.dtype, list[int]]]:
    """names/dtypes/shapes lists, one entry per tensor (types checked by sglang_schema)."""
    names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise BadRequest("names: required, a non-empty list of parameter names")
    if not isinstance(dtypes, list) or not isinstance(shapes, list):
        raise BadRequest("dtypes, shapes: required lists, one entry per name")
    if not len(names) == len(dtypes) == len(shapes):
        raise BadRequest(
            f"names/dtypes/shapes: lengths differ ({len(names)}/{len(dtypes)}/{len(shapes)})"
        )
    specs = []
    for name, dtype, shape in zip(names, dtypes, shapes):
        key = str(dtype).removeprefix("torch.")
        if key not in _DTYPES:
            raise BadRequest(f"dtypes: {dtype!r} for {name} is not one of {sorted(_DTYPES)}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise BadRequest(f"shapes: {shape!r} for {name} is not a list of sizes")
        specs.append((name, _DTYPES[key], shape))
    return specs


class WeightGroups:
    """Process groups joined through /init_weights_update_group, by group name."""

    def __init__(self, device: torch.device):
        self.device = device
        self._groups: dict[str, object] = {}
        self._lock = threading.Lock()

    def check_backend(self, spec: GroupSpec) -> None:
        if spec.backend == "nccl" and self.device.type != "cuda":
            raise Unsupported(
                "backend: nccl needs a CUDA device and this server runs on "
                f"{self.device.type}; pass backend 'gloo' or use /update_weights_from_disk"
            )

    def join(self, spec: GroupSpec) -> str:
        """Blocks until every rank has joined (call it off the event loop)."""
        from arealite.utils.distributed import init_custom_process_group

        self.check_backend(spec)
        with self._lock:
            if spec.group_name in self._groups:
                raise BadRequest(f"group_name: {spec.group_name!r} already initialised")
        group = init_custom_process_group(
            spec.backend,
            f"tcp://{spec.master_address}:{spec.master_port}",
            spec.world_size,
            spec.rank,
            spec.group_name,
        )
        with self._lock:
            self._groups[spec.group_name] = group
        return f"joined {spec.group_name} as rank {spec.rank}/{spec.world_size} ({spec.backend})"

    def get(self, name: str):
        with self._lock:
            group = self._groups.get(name)
        if group is None:
            raise BadRequest(f"group_name: {name!r} unknown; call /init_weights_update_group first")
        return group

    def receive(self, group, specs) -> list[tuple[str, torch.Tensor]]:
        """Receive every tensor of the bucket (always all of them, to stay in lockstep)."""
        import torch.distributed as dist

        out = []
        for name, dtype, shape in specs:
            t = torch.empty(shape, dtype=dtype, device=self.device)
            dist.broadcast(t, src=0, group=group)
            out.append((name, t))
        return out

    def destroy(self, name: str) -> None:
        import torch.distributed as dist

        group = self.get(name)
        with self._lock:
            self._groups.pop(name, None)
        dist.destroy_process_group(group)


def load_tensor_payload(runner, payload: str) -> str:
    """Open the handles (RefusedPayload for anything else), copy into the served model, and
    wait for the copy: the trainer may change its tensors as soon as this answers."""
    named = deserialize_named_tensors(payload)
    message = runner.load_named_tensors(named)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    return message
