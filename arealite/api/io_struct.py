"""Plain data passed between layers: generation requests/responses, weight updates, allocation.

These are the nouns every engine agrees on, so they hold no behaviour beyond validation and small
derived properties.
"""

from __future__ import annotations

import dataclasses
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple


@dataclass
class GenerationHyperparameters:
    """Sampling settings of one rollout (SGLang semantics)."""

    n_samples: int = 1
    max_new_tokens: int = 256
    min_new_tokens: int = 0
    greedy: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # Reproducible sampling: the server's draws depend only on the request's seed and the
    # position (SGLang `sampling_seed`, vLLM `seed`); workflows derive one seed per sample from
    # this one, the data item and the policy version. None: the servers' own generators.
    seed: int | None = None

    def __post_init__(self):
        if self.seed is not None and not 0 <= self.seed < 1 << 64:
            raise ValueError(f"gconfig.seed must be in [0, 2**64) or None, got {self.seed}")
        if self.n_samples < 1:
            raise ValueError(f"gconfig.n_samples must be >= 1, got {self.n_samples}")
        if self.max_new_tokens < 0:
            raise ValueError(f"gconfig.max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= max(self.max_new_tokens, 0):
            raise ValueError(
                f"gconfig.min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], "
                f"got {self.min_new_tokens}"
            )
        if self.temperature < 0:
            raise ValueError(f"gconfig.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"gconfig.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"gconfig.top_k must be -1 (disabled) or >= 1, got {self.top_k}")

    def new(self, **kwargs) -> GenerationHyperparameters:
        """A copy with some fields replaced (e.g. `gconfig.new(n_samples=1)` per request)."""
        return dataclasses.replace(self, **kwargs)

    def to_sampling_params(self) -> dict[str, Any]:
        """The SGLang `sampling_params` dict of this config."""
        greedy = self.greedy or self.temperature == 0
        return {
            "max_new_tokens": self.max_new_tokens,
            "min_new_tokens": self.min_new_tokens,
            "temperature": 0.0 if greedy else self.temperature,
            "top_p": self.top_p,
            "top_k": 1 if greedy else self.top_k,
            "stop_token_ids": list(self.stop_token_ids),
            "ignore_eos": self.ignore_eos,
            **({} if self.seed is None or greedy else {"sampling_seed": self.seed}),
        }


@dataclass
class ModelRequest:
    """One generation request: a token-in / token-out call to an inference engine."""

    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    input_ids: list[int] = field(default_factory=list)
    gconfig: GenerationHyperparameters = field(default_factory=GenerationHyperparameters)
    metadata: dict[str, Any] = field(default_factory=dict)
    # Base64-encoded images (SGLang's `image_data`), for vision-language models.
    image_data: list[str] | None = None


StopReason = Literal["stop", "length", "abort"]


@dataclass
class ModelResponse:
    """What came back for one request; one trajectory may span several weight versions."""

    input_tokens: list[int] = field(default_factory=list)
    output_tokens: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    # Weight version that produced each output token.
    output_versions: list[int] = field(default_factory=list)
    stop_reason: StopReason = "stop"
    latency: float = float("inf")
    ttft: float = float("inf")  # time to first token

    @property
    def input_len(self) -> int:
        return len(self.input_tokens)

    @property
    def output_len(self) -> int:
        return len(self.output_tokens)


@dataclass
class PartialResponse:
    """What one request has generated so far, across the calls a pause or a weight update cut
    it into (an aborted call's tokens are kept and the rest is asked for as prompt + them)."""

    req: ModelRequest
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    stop_reason: str = "length"
    ttft: float = float("inf")
    finished: bool = False

    @property
    def done(self) -> bool:
        return self.finished or len(self.tokens) >= self.req.gconfig.max_new_tokens

    def extend(self, tokens, logprobs, versions, finish: str, start: float) -> None:
        """One call's answer (`finish` "abort" leaves the request pending)."""
        if tokens and self.ttft == float("inf"):
            self.ttft = time.perf_counter() - start
        self.tokens += tokens
        self.logprobs += logprobs
        self.versions += versions
        if finish != "abort":
            self.stop_reason, self.finished = finish, True

    def response(self, start: float) -> ModelResponse:
        return ModelResponse(
            input_tokens=list(self.req.input_ids),
            output_tokens=self.tokens,
            output_logprobs=self.logprobs,
            output_versions=self.versions,
            stop_reason=self.stop_reason,  # type: ignore[arg-type]
            latency=time.perf_counter() - start,
            ttft=self.ttft,
        )


class ParamSpec(NamedTuple):
    """One tensor of an NCCL weight broadcast: checkpoint name, shape, dtype name ("bfloat16").

    A tuple, so JSON bodies and `zip(*bucket)` see (name, shape, dtype) as before."""

    name: str
    shape: list[int]
    dtype: str

    @classmethod
    def of(cls, spec: Any) -> ParamSpec:
        """A ParamSpec from one, or from any (name, shape, dtype) triple (torch dtypes too)."""
        name, shape, dtype = (spec.name, spec.shape, spec.dtype) if hasattr(spec, "name") else spec
        return cls(str(name), [int(x) for x in shape], str(dtype).removeprefix("torch."))


@dataclass
class WeightUpdateMeta:
    """How the trainer hands new weights to inference servers.

    NCCL: trainer rank 0 broadcasts `nccl_param_specs` (buckets in send order, from
    `FSDPEngine.nccl_param_specs`) in a group of `nccl_world_size` ranks (1 + every server's
    tensor-parallel ranks, from `RemoteInferenceEngine.nccl_world_size()`), so neither side
    needs to ask the other over HTTP.

    tensor: servers on the trainer's own GPU open `tensor_payloads` (one per bucket, from
    `arealite.utils.tensor_handles`): CUDA IPC handles of the trainer's tensors, no copy.
    """

    type: Literal["disk", "nccl", "tensor"] = "disk"
    path: str | None = None
    version: int = 0
    # NCCL broadcast fields (GPU only).
    nccl_master_address: str = "127.0.0.1"
    nccl_master_port: int = 29600
    nccl_group_name: str = "arealite_weight_update"
    bucket_size_mb: int = 256
    nccl_param_specs: list[list[ParamSpec]] = field(default_factory=list)
    nccl_world_size: int | None = None
    # The group's backend: nccl between GPUs; gloo is its CPU stand-in (embedded server only).
    nccl_backend: Literal["nccl", "gloo"] = "nccl"
    tensor_payloads: list[str] = field(default_factory=list)

    @classmethod
    def from_disk(cls, path: str, version: int = 0) -> WeightUpdateMeta:
        return cls(type="disk", path=path, version=version)

    @classmethod
    def from_nccl(
        cls,
        master_address: str,
        master_port: int,
        version: int = 0,
        bucket_size_mb: int = 256,
        world_size: int | None = None,
    ) -> WeightUpdateMeta:
        return cls(
            type="nccl",
            version=version,
            nccl_master_address=master_address,
            nccl_master_port=master_port,
            bucket_size_mb=bucket_size_mb,
            nccl_world_size=world_size,
        )

    def __post_init__(self):
        if self.type not in ("disk", "nccl", "tensor"):
            raise ValueError(
                f"WeightUpdateMeta.type must be 'disk', 'nccl' or 'tensor', got {self.type!r}"
            )
        if self.type == "disk" and not self.path:
            raise ValueError("WeightUpdateMeta(type='disk') needs a path")

    def param_buckets(self) -> list[list[ParamSpec]]:
        """`nccl_param_specs` as ParamSpec buckets; ValueError when there are none."""
        if not self.nccl_param_specs:
            raise ValueError(
                "WeightUpdateMeta(type='nccl') needs nccl_param_specs: the trainer's parameter "
                "buckets as [[(name, shape, dtype), ...], ...] in broadcast order "
                "(engine.nccl_param_specs(meta.bucket_size_mb))"
            )
        return [[ParamSpec.of(s) for s in bucket] for bucket in self.nccl_param_specs]


@dataclass
class SaveLoadMeta:
    """Where and how a train engine saves or loads: HF (export, weight sync) or DCP (recovery)."""

    path: str
    weight_format: Literal["hf", "dcp"] = "hf"
    with_optim: bool = False
    tokenizer: Any = None  # a tokenizer / processor to save next to HF weights
    base_model_path: str | None = None

    def __post_init__(self):
        if self.weight_format not in ("hf", "dcp"):
            raise ValueError(
                f"SaveLoadMeta.weight_format must be 'hf' or 'dcp', got {self.weight_format!r}"
            )


@dataclass
class FinetuneSpec:
    """Sizes that fix the length of training (and so the LR schedule); `max_train_steps` (the
    config's total_train_steps) ends it early, and the schedule then spans those steps."""

    total_train_epochs: int
    dataset_size: int
    train_batch_size: int
    max_train_steps: int | None = None

    def __post_init__(self):
        if self.train_batch_size < 1:
            raise ValueError(f"train_batch_size must be >= 1, got {self.train_batch_size}")
        if self.total_train_epochs < 1:
            raise ValueError(f"total_train_epochs must be >= 1, got {self.total_train_epochs}")

    @property
    def steps_per_epoch(self) -> int:
        return max(1, self.dataset_size // self.train_batch_size)

    @property
    def total_train_steps(self) -> int:
        return min(self.total_train_epochs * self.steps_per_epoch, self.max_train_steps or 10**12)


@dataclass(frozen=True)
class ParallelStrategy:
    """Data / pipeline / tensor parallel degrees of one side of the allocation."""

    data_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    tensor_parallel_size: int = 1

    @property
    def world_size(self) -> int:
        return self.data_parallel_size * self.pipeline_parallel_size * self.tensor_parallel_size

    _PART = re.compile(r"^(?:d(\d+))?(?:p(\d+))?(?:t(\d+))?$")

    @classmethod
    def from_str(cls, s: str, whole: str = "") -> ParallelStrategy:
        m = cls._PART.match(s)
        if not s or not m or not any(m.groups()):
            raise ValueError(
                f"Bad parallel strategy {s!r} in allocation mode {whole or s!r}: expected "
                "d<N>p<N>t<N> (e.g. 'd2p1t1'; each part optional, in that order)"
            )
        d, p, t = (int(g) if g else 1 for g in m.groups())
        for name, v in (("d", d), ("p", p), ("t", t)):
            if v < 1:
                raise ValueError(
                    f"Bad parallel strategy {s!r} in {whole or s!r}: {name} must be >= 1"
                )
        return cls(d, p, t)


GEN_BACKENDS = ("sglang", "vllm", "local")  # inference servers
COLOCATED = "colocated"  # no server: the trainer ranks generate


@dataclass(frozen=True)
class AllocationMode:
    """Who runs where: `sglang.d2p1t1+d2p1t1` = 2 SGLang servers (TP 1) + 2 FSDP ranks.

    Backends: `sglang` (SGLang servers), `vllm` (vLLM servers), `local` (our embedded server).
    `colocated+d2p1t1`: no server; each trainer rank generates with its own copy of the policy
    in its own process, between updates (one device, no second set of cores to lend).
    A bare `d2p1t1` means training only (SFT). Pipeline parallelism is not used by the FSDP
    trainer, so its `p` must be 1; its `t` > 1 shards each replica over t ranks (tensor
    parallel, DTensor: engine/tensor_parallel.py), `d2t2` = 4 ranks.
    """

    gen_backend: str | None
    gen: ParallelStrategy | None
    train: ParallelStrategy

    @property
    def gen_n_servers(self) -> int:
        """One server per data-parallel replica; each spans `tensor_parallel_size` devices."""
        return self.gen.data_parallel_size if self.gen else 0

    @property
    def gen_world_size(self) -> int:
        return self.gen.world_size if self.gen else 0

    @property
    def train_world_size(self) -> int:
        return self.train.world_size

    @property
    def colocated(self) -> bool:
        """Generation inside the trainer ranks (arealite/server/colocated.py): no servers."""
        return self.gen_backend == COLOCATED

    @property
    def train_only(self) -> bool:
        return self.gen is None and not self.colocated

    @classmethod
    def from_str(cls, s: str) -> AllocationMode:
        s = s.strip()
        if "+" not in s:
            if "." in s:
                raise ValueError(
                    f"Bad allocation mode {s!r}: a generation backend needs a trainer part too, "
                    f"e.g. '{s}+d1p1t1'"
                )
            return cls(None, None, cls._train_part(s, s))
        gen_part, _, train_part = s.partition("+")
        if gen_part == COLOCATED:
            return cls(COLOCATED, None, cls._train_part(train_part, s))
        backend, dot, gen_str = gen_part.partition(".")
        if backend == COLOCATED:
            raise ValueError(
                f"Bad allocation mode {s!r}: colocated generation runs in the trainer ranks and "
                f"takes no parallel strategy of its own: '{COLOCATED}+{train_part}'"
            )
        if not dot:
            raise ValueError(
                f"Bad allocation mode {s!r}: the generation part {gen_part!r} must name a backend, "
                f"one of {', '.join(GEN_BACKENDS)} (e.g. 'sglang.d2p1t1+d2p1t1'), or be "
                f"'{COLOCATED}' (e.g. '{COLOCATED}+d1p1t1')"
            )
        if backend not in GEN_BACKENDS:
            raise ValueError(
                f"Bad allocation mode {s!r}: unknown generation backend {backend!r}; "
                f"allowed: {', '.join(GEN_BACKENDS)}"
            )
        gen = ParallelStrategy.from_str(gen_str, s)
        if gen.pipeline_parallel_size != 1:
            raise ValueError(f"Bad allocation mode {s!r}: inference servers do not use p>1")
        return cls(backend, gen, cls._train_part(train_part, s))

    @staticmethod
    def _train_part(part: str, whole: str) -> ParallelStrategy:
        train = ParallelStrategy.from_str(part, whole)
        if train.pipeline_parallel_size != 1:
            raise ValueError(
                f"Bad allocation mode {whole!r}: the FSDP trainer part {part!r} has no pipeline "
                "parallelism (p1); use d<N> or d<N>t<T> (tensor parallel)"
            )
        if train.tensor_parallel_size != 1 and whole.startswith(COLOCATED + "+"):
            raise ValueError(
                f"Bad allocation mode {whole!r}: colocated generation needs a whole policy per "
                f"rank, so its trainer part {part!r} must be t1; use d<N>"
            )
        return train
