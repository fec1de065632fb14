"""The memory plan: each GPU's expected peak (trainer and server), before any process starts.

An out-of-memory error after the servers and the model have loaded costs a user minutes and says
little; the same arithmetic from the model's config.json costs nothing. Per trainer rank, with
P parameters sharded over the dp x tp ranks (FSDP2 over dp, DTensor tensor parallelism over tp):
  weights    P x master bytes / (dp x tp) (actor.dtype), plus the gathered compute-dtype copies
             FSDP holds (the root's embeddings and two decoder layers, / tp) when they differ
  optimizer  AdamW's 2 states in the master dtype, / (dp x tp)
  grads      P x master bytes / (dp x tp)
  activations per micro-batch of T tokens (actor.mb_spec.max_tokens_per_mb, or the longest
             sequence): every decoder layer's saved tensors, or only its input with
             gradient checkpointing (plus one layer recomputed); at tp > 1 the heads and the
             MLP's intermediate width are split, the hidden-wide tensors are not
  logits     the [T, vocab / tp] logits and their gradient in the compute dtype, plus the fp32
             softmax chunks of arealite/engine/logprobs.py
The peak is weights + optimizer + runtime + max(activations + logits, grads + the optimizer
step's temporaries): the saved activations are freed as the gradients fill. The server holds
SGLang's `server.mem_fraction_static` (weights + KV pool), vLLM's 0.9, or the embedded server's
weights and a KV cache of `server.max_batch_size` whole sequences and their spare rows and
columns.
Checked against measured peak RSS on CPU (bench/memory_plan.py, tests/test_memory_plan.py); on a GPU the CUDA context and the
caching allocator add `RUNTIME_GIB`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

GIB = float(1 << 30)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
LOGPROB_CHUNK = 1024  # arealite/engine/logprobs.py: rows of fp32 softmax at a time
LOGPROB_BUFFERS = 5  # fp32 [chunk, vocab] buffers alive at once in its backward
RUNTIME_GIB = 1.0  # per GPU process: CUDA context, cuBLAS / NCCL workspaces, allocator slack
CPU_RUNTIME_GIB = 40 / 1024  # a CPU trainer's own growth while it builds (imports, gloo): measured
VLLM_GPU_FRACTION = 0.9  # vLLM's default gpu_memory_utilization
WARN_FRACTION = 0.9


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only model that fix its memory (an HF config.json's fields)."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    head_dim: int
    tied: bool

    @classmethod
    def from_hf_config(cls, cfg: dict) -> ModelShape:
        """From a config.json dict (a VLM's `text_config` when it has one)."""
        text = {**cfg, **cfg.get("text_config", {})}
        heads = text["num_attention_heads"]
        return cls(
            vocab=text["vocab_size"],
            hidden=text["hidden_size"],
            layers=text["num_hidden_layers"],
            heads=heads,
            kv_heads=text.get("num_key_value_heads") or heads,
            intermediate=text["intermediate_size"],
            head_dim=text.get("head_dim") or text["hidden_size"] // heads,
            tied=bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        )

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        """q/k/v (with Qwen2's biases), o, the gated MLP and two norms."""
        q, kv = self.heads * self.head_dim, self.kv_dim
        attn = self.hidden * (q + 2 * kv) + (q + 2 * kv) + q * self.hidden
        return attn + 3 * self.hidden * self.intermediate + 2 * self.hidden

    @property
    def root_params(self) -> int:
        """Embeddings, the output head (untied) and the final norm: FSDP's root unit."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.root_params

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.layers * self.kv_dim * dtype_bytes


def read_model_shape(model_dir: str) -> ModelShape:
    with open(os.path.join(model_dir, "config.json")) as f:
        return ModelShape.from_hf_config(json.load(f))


@dataclass(frozen=True)
class TrainSetup:
    """What a trainer rank's memory depends on besides the model."""

    master_bytes: int
    compute_bytes: int
    dp: int  # data-parallel ranks: the batch is split over them
    grad_ckpt: bool
    mb_tokens: int
    trainable: bool = True  # False: LoRA (adapters only: no full grads or optimizer states)
    cuda: bool = True
    head: int = 0  # output width: 0 = the vocabulary; 1 = a value head (critic, reward model)
    tp: int = 1  # tensor-parallel ranks: heads, MLP columns and the vocabulary are split


def activation_bytes(shape: ModelShape, s: TrainSetup) -> float:
    """Saved tensors of a micro-batch's forward, per token: each layer keeps its input, both
    norms' outputs, q/k/v after rotary, the attention output, the MLP's gate, up, SiLU and
    product (9 hidden + 2 kv + 4 intermediate wide); bf16 norms also keep fp32 copies."""
    cb = s.compute_bytes
    per_layer = (9 * shape.hidden + (2 * shape.kv_dim + 4 * shape.intermediate) / s.tp) * cb
    per_layer += 0 if cb >= 4 else 8 * shape.hidden
    kept = (
        shape.hidden * cb * shape.layers + 2 * per_layer
        if s.grad_ckpt
        else (per_layer * shape.layers)
    )
    return s.mb_tokens * (kept + 4 * shape.hidden * cb)


def logits_bytes(shape: ModelShape, s: TrainSetup) -> float:
    width = s.head or shape.vocab / s.tp
    chunks = LOGPROB_BUFFERS * min(LOGPROB_CHUNK, s.mb_tokens) * width * 4 if not s.head else 0
    return 2 * s.mb_tokens * width * s.compute_bytes + chunks


def trainer_terms(shape: ModelShape, s: TrainSetup) -> dict[str, float]:
    """Bytes of each term of one trainer rank (see the module docstring); 'peak' combines them."""
    p_shard = shape.params / (s.dp * s.tp)
    gathered = 0.0
    if s.dp > 1 or s.compute_bytes != s.master_bytes:
        gathered = (shape.root_params + 2 * shape.layer_params) * s.compute_bytes / s.tp
    largest = max(shape.vocab * shape.hidden, shape.layer_params) * s.master_bytes
    step_tmp = p_shard * s.master_bytes if s.cuda else 2 * largest  # foreach vs per-tensor
    t = {
        "weights": p_shard * s.master_bytes + gathered,
        "optimizer": 2 * p_shard * s.master_bytes if s.trainable else 0.0,
        "grads": p_shard * s.master_bytes if s.trainable else 0.0,
        "activations": activation_bytes(shape, s),
        "logits": logits_bytes(shape, s),
        "step_tmp": step_tmp if s.trainable else 0.0,
        "runtime": (RUNTIME_GIB if s.cuda else CPU_RUNTIME_GIB) * GIB,
    }
    t["peak"] = (
        t["weights"]
        + t["optimizer"]
        + t["runtime"]
        + max(t["activations"] + t["logits"], t["grads"] + t["step_tmp"])
    )
    return t


@dataclass(frozen=True)
class ServerSetup:
    backend: str  # local | sglang | vllm
    dtype_bytes: int
    tp: int
    seq_len: int  # prompt + answer: one sequence's KV
    max_batch_size: int
    mem_fraction: float
    device_bytes: float | None
    kv_dtype_bytes: int  # the embedded server on CPU keeps its KV in fp32 (server/cpu_attention.py)


def server_terms(shape: ModelShape, s: ServerSetup) -> dict[str, float]:
    """Bytes of one server's share of one of its GPUs: weights and KV cache ('kv' is SGLang's
    pool: what its static fraction leaves after the weights; the embedded server's: its batch
    of whole sequences with their spare rows and columns), and 'peak'."""
    weights = shape.params * s.dtype_bytes / s.tp
    if s.backend == "local":
        # a quarter more rows (>= 8) and columns (>= 32): server/kv_batch.py's spare_rows /
        # spare_columns (not imported: the launcher stays free of torch)
        kv_token = shape.kv_bytes_per_token(s.kv_dtype_bytes) / s.tp
        rows = s.max_batch_size + max(8, s.max_batch_size // 4)
        kv = rows * (s.seq_len + max(32, s.seq_len // 4)) * kv_token
        work = s.max_batch_size * shape.vocab * 4 * 2  # a decode step's fp32 logits
        t = {"weights": weights, "kv": kv, "work": work, "runtime": RUNTIME_GIB * GIB}
        t["peak"] = sum(t.values())
        return t
    fraction = VLLM_GPU_FRACTION if s.backend == "vllm" else s.mem_fraction
    static = fraction * (s.device_bytes or 0.0)
    runtime = 0.0 if s.backend == "vllm" else RUNTIME_GIB * GIB  # outside SGLang's fraction
    kv_token = shape.kv_bytes_per_token(s.dtype_bytes) / s.tp
    t = {"weights": weights, "kv": max(0.0, static - weights), "runtime": runtime}
    t["peak"] = max(static, weights) + runtime
    t["kv_tokens"] = t["kv"] / kv_token
    return t


# ----------------------------------------------------------------------------- from a config


def dtype_bytes(name: str, cuda: bool) -> int:
    """`auto` is bf16 on a GPU (capability >= 8.0 assumed) and on a CPU with native bf16."""
    if name != "auto":
        return DTYPE_BYTES[name]
    from arealite.utils.hardware import cpu_flags

    return 2 if cuda or {"avx512_bf16", "amx_bf16"} & cpu_flags() else 4


def sequence_tokens(config) -> int:
    """The longest sequence a step trains on: prompt (train_dataset.max_length; 512 assumed when
    unset) + answer (gconfig.max_new_tokens) for RL, max_length alone for SFT."""
    prompt = config.train_dataset.max_length or 512
    gconfig = getattr(config, "gconfig", None)
    return prompt + (gconfig.max_new_tokens if gconfig is not None else 0)


def train_setup(config, engine, cuda: bool) -> TrainSetup:
    """`engine` (actor, critic, model) of `config` as a TrainSetup: its micro-batch is
    mb_spec.max_tokens_per_mb (at least one whole sequence), else its rank's whole batch."""
    tp = config.allocation.train.tensor_parallel_size
    dp = config.allocation.train_world_size // tp
    seq = sequence_tokens(config)
    per_step = config.train_dataset.batch_size * getattr(
        getattr(config, "gconfig", None), "n_samples", 1
    )
    cap = engine.mb_spec.max_tokens_per_mb
    tokens = max(cap, seq) if cap else -(-per_step * seq // (dp * engine.mb_spec.n_mbs))
    return TrainSetup(
        master_bytes=dtype_bytes(engine.dtype, cuda),
        compute_bytes=dtype_bytes(engine.fsdp.param_dtype, cuda),
        dp=dp,
        grad_ckpt=engine.gradient_checkpointing,
        mb_tokens=tokens,
        trainable=engine.lora is None and engine.optimizer is not None,
        cuda=cuda,
        head=1 if engine.is_critic else 0,
        tp=tp,
    )


def trainer_plan(config, shape: ModelShape, cuda: bool) -> dict[str, float]:
    """One trainer rank: the trained model (actor / model), plus a critic's and a reference
    model's weights where the config has them (they share the rank's device)."""
    engine = getattr(config, "actor", None) or config.model
    setup = train_setup(config, engine, cuda)
    t = trainer_terms(shape, setup)
    if engine.fsdp.offload_params and cuda:  # shards, grads and states live in host memory
        gathered = (shape.root_params + 2 * shape.layer_params) * setup.compute_bytes
        t["peak"] -= t["weights"] + t["optimizer"] - gathered
        t.update(weights=gathered, optimizer=0.0, grads=0.0)
    for key in ("critic", "ref"):
        other = getattr(config, key, None)
        if other is None:
            continue
        o = trainer_terms(shape, train_setup(config, other, cuda))
        extra = o["peak"] - o["runtime"] if key == "critic" else o["weights"]
        t[key] = extra
        t["peak"] += extra
    return t


def server_setup(config, device_bytes: float | None) -> ServerSetup | None:
    alloc = config.allocation
    if getattr(config, "server", None) is None or alloc.gen is None:
        return None
    cuda = config.cluster.n_gpus_per_node > 0
    dtype = dtype_bytes(config.server.dtype, cuda)
    return ServerSetup(
        backend=alloc.gen_backend,
        dtype_bytes=dtype,
        tp=alloc.gen.tensor_parallel_size,
        seq_len=sequence_tokens(config),
        max_batch_size=config.server.max_batch_size,
        mem_fraction=config.server.mem_fraction_static,
        device_bytes=device_bytes,
        kv_dtype_bytes=dtype if cuda else DTYPE_BYTES["float32"],
    )


def colocated_setup(config, cuda: bool) -> ServerSetup:
    """A trainer rank's in-process generator (colocated+...): the embedded server's terms."""
    dtype = dtype_bytes(config.server.dtype, cuda)
    return ServerSetup(
        backend="local",
        dtype_bytes=dtype,
        tp=1,
        seq_len=sequence_tokens(config),
        max_batch_size=config.server.max_batch_size,
        mem_fraction=0.0,
        device_bytes=None,
        kv_dtype_bytes=dtype if cuda else DTYPE_BYTES["float32"],
    )


def gpu_memory_bytes(cluster) -> float | None:
    """cluster.gpu_memory_gb (GiB), else the smallest GPU nvidia-smi lists; None if unknown."""
    if cluster.gpu_memory_gb:
        return cluster.gpu_memory_gb * GIB
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        mib = [float(x) for x in out.stdout.split()]
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None
    return min(mib) * (1 << 20) if mib else None


@dataclass
class MemoryPlan:
    """Expected peaks: one trainer rank, one server GPU, and each kind of GPU of the layout."""

    shape: ModelShape
    setup: TrainSetup
    trainer: dict[str, float]
    server: dict[str, float] | None
    gpus: list[tuple[str, float]]  # (what one GPU holds, its peak); [] for a CPU run
    device_bytes: float | None
    key: str = "actor"

    def describe(self) -> str:
        s, t = self.setup, self.trainer
        n = self.shape.params
        size = f"{n / 1e9:.2f}B" if n >= 1e9 / 2 else f"{n / 1e6:.1f}M"
        lines = [
            f"memory plan (GiB): {size} parameters (vocab "
            f"{self.shape.vocab}, {self.shape.layers} layers x {self.shape.hidden})",
            f"  trainer rank (dp {s.dp}{f' x tp {s.tp}' if s.tp > 1 else ''}, micro-batch {s.mb_tokens} tokens, {s.master_bytes}"
            f"-byte master / {s.compute_bytes}-byte compute, checkpointing "
            f"{'on' if s.grad_ckpt else 'off'}): {_terms(t)}",
        ]
        if self.server is not None:
            lines.append(f"  server: {_terms(self.server)}")
        for what, peak in self.gpus:
            of = " (device memory unknown: set cluster.gpu_memory_gb)"
            if self.device_bytes:
                of = f" of {self.device_bytes / GIB:.1f} ({peak / self.device_bytes:.0%})"
            lines.append(f"  GPU with {what}: {peak / GIB:.1f}{of}")
        return "\n".join(lines)


def _terms(t: dict[str, float]) -> str:
    parts = [f"{k} {v / GIB:.2f}" for k, v in t.items() if k not in ("peak", "kv_tokens") and v]
    tokens = f" ({t['kv_tokens'] / 1e3:.0f}k KV tokens)" if "kv_tokens" in t else ""
    return f"{', '.join(parts)}{tokens} -> peak {t['peak'] / GIB:.2f}"


def plan_memory(config, shape: ModelShape, device_bytes: float | None) -> MemoryPlan:
    """The plan of `config` for a model of `shape` on GPUs of `device_bytes` each."""
    cluster, alloc = config.cluster, config.allocation
    cuda = cluster.n_gpus_per_node > 0
    key = "actor" if getattr(config, "actor", None) is not None else "model"
    trainer = trainer_plan(config, shape, cuda)
    sv = server_setup(config, device_bytes)
    server = server_terms(shape, sv) if sv is not None else None
    if alloc.colocated:  # each rank's in-process generator: weights + its batch's KV
        gen = server_terms(shape, colocated_setup(config, cuda))
        trainer["generator"] = gen["peak"] - gen["runtime"]
        trainer["peak"] += trainer["generator"]
    gpus: list[tuple[str, float]] = []
    if cuda and server is not None and cluster.share_gpus:
        gpus.append(("server + trainer rank", server["peak"] + trainer["peak"]))
    elif cuda:
        gpus += [("server", server["peak"])] if server is not None else []
        gpus.append(("trainer rank", trainer["peak"]))
    setup = train_setup(config, getattr(config, key), cuda)
    return MemoryPlan(shape, setup, trainer, server, gpus, device_bytes, key)


def knobs(plan: MemoryPlan, what: str) -> list[str]:
    """The config keys that shrink the GPU holding `what`, with the terms they act on."""
    k, t, s, out = plan.key, plan.trainer, plan.setup, []
    if "trainer" in what:
        act = (t["activations"] + t["logits"]) / GIB
        out.append(
            f"{k}.mb_spec.max_tokens_per_mb (now {s.mb_tokens} tokens: activations + "
            f"logits {act:.1f} GiB scale with it)"
        )
        if not s.grad_ckpt:
            out.append(f"{k}.gradient_checkpointing=true")
        states = (t["weights"] + t["grads"] + t["optimizer"]) / GIB
        out.append(
            f"more trainer ranks in allocation_mode or {k}.fsdp.offload_params=true "
            f"(weights + grads + optimizer {states:.1f} GiB, sharded over the ranks)"
        )
    if "server" in what and plan.server is not None:
        out.append(
            "server.mem_fraction_static (SGLang's weights + KV pool) or "
            "server.max_batch_size (the embedded server's KV cache)"
        )
    if "+" in what:
        out.append("cluster.share_gpus=false with a GPU for each side")
    out.append("cluster.gpu_memory_gb (when the GPU has more memory than assumed)")
    return out


def check_plan(plan: MemoryPlan, warn) -> None:
    """ConfigError naming the numbers and the knobs when a GPU cannot hold its processes or an
    SGLang pool has no room for one sequence; `warn(msg)` above WARN_FRACTION."""
    from arealite.api.cli_args import ConfigError

    sv = plan.server
    if sv is not None and "kv_tokens" in sv and plan.device_bytes and sv["kv"] <= 0:
        raise ConfigError(
            f"{plan.describe()}\nthe server's weights fill its static memory "
            "(no KV pool left): raise server.mem_fraction_static"
        )
    for what, peak in sorted(plan.gpus, key=lambda g: -g[1]) if plan.device_bytes else []:
        ratio = peak / plan.device_bytes
        if ratio > 1.0:
            turn = "\n  ".join(knobs(plan, what))
            raise ConfigError(
                f"{plan.describe()}\nthe GPU with {what} needs {peak / GIB:.1f} GiB "
                f"but has {plan.device_bytes / GIB:.1f}; turn:\n  {turn}"
            )
        if ratio > WARN_FRACTION:
            warn(
                f"memory plan: the GPU with {what} is expected at {ratio:.0%} of its memory "
                f"({'; '.join(knobs(plan, what)[:2])})"
            )


def check_memory(config, device_bytes: float | None = None, log=None) -> MemoryPlan | None:
    """Preflight: the plan of the trained model's config.json, logged, then checked (see
    check_plan); None (and a note) when the model directory has no readable decoder config."""
    import logging

    log = log or logging.getLogger("arealite.memory_plan")
    engine = getattr(config, "actor", None) or getattr(config, "model", None)
    try:
        shape = read_model_shape(engine.path)
    except (OSError, KeyError, TypeError, ValueError, AttributeError) as e:
        log.info(
            "memory plan skipped: no decoder sizes in %s/config.json (%s)",
            getattr(engine, "path", None),
            e,
        )
        return None
    if device_bytes is None and config.cluster.n_gpus_per_node:
        device_bytes = gpu_memory_bytes(config.cluster)
    plan = plan_memory(config, shape, device_bytes)
    warnings: list[str] = []
    check_plan(plan, warnings.append)  # a refusal carries the plan itself
    log.info("%s", plan.describe())
    for msg in warnings:
        log.warning("%s", msg)
    return plan
