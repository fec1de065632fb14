"""The model side of the embedded server: a HF causal LM decoded in a continuously batched loop.

Rows are left-padded and share one KV cache (`kv_batch.new_cache`). New requests are prefilled together (a prompt
that several of them share, once), then their cache is left-padded to the running cache's
length and concatenated along the batch axis, so they join the very next decoding step;
finished rows are dropped from the cache at once.
Positions come from each row's own token count, so padding never shifts RoPE.
"""

from __future__ import annotations

import contextlib
import glob
import inspect
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from arealite.server import cpu_attention
from arealite.server.kv_batch import (
    RunningBatch,
    can_join,
    keep_rows,
    merge_batches,
    new_cache,
    repeat_rows,
    unique_prompts,
)
from arealite.server.protocol import GenerateRequest
from arealite.server.sampling import SamplingTensors, sample_next_tokens, top_logprobs
from arealite.utils.hardware import attention_dtype, resolve_dtype, sdpa_without_cudnn

logger = logging.getLogger("arealite.server")

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class Sequence:
    """One request's life inside the scheduler."""

    req: GenerateRequest
    stop_ids: frozenset[int]
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    finish_reason: dict | None = None
    weight_version: int = 0  # of the weights serving it now
    # (version, first output index it produced): the admission's, then each weight update the
    # row lived through frozen by an in-place pause; empty when there was none
    version_changes: list[tuple[int, int]] = field(default_factory=list)
    arrival: float = field(default_factory=time.monotonic)
    # OpenAI `top_logprobs`: k most likely (token, logprob) per step, computed only when k > 0
    top_logprobs: int = 0
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)

    @property
    def rid(self) -> str:
        return self.req.rid

    def new_weights(self, version: int) -> None:
        """The weights changed under this running row: its next tokens come from `version`."""
        if not self.version_changes:
            self.version_changes.append((self.weight_version, 0))
        self.version_changes.append((version, len(self.output_ids)))
        self.weight_version = version

    def version_spans(self) -> list[dict] | None:
        """Output tokens by weight version, [{"version", "start", "end"}] (vLLM's
        `weight_versions` form), or None when one version produced them all."""
        marks = self.version_changes
        if not marks:
            return None
        ends = [start for _, start in marks[1:]] + [len(self.output_ids)]
        return [
            {"version": v, "start": start, "end": end}
            for (v, start), end in zip(marks, ends)
            if end > start
        ]

    def token_versions(self) -> list[int]:
        """The weight version that produced each output token."""
        spans = self.version_spans() or [
            {"version": self.weight_version, "start": 0, "end": len(self.output_ids)}
        ]
        return [v for s in spans for v in [s["version"]] * (s["end"] - s["start"])]

    def append(self, token: int, logprob: float) -> None:
        self.output_ids.append(token)
        self.output_logprobs.append(logprob)
        p = self.req.params
        if token in self.stop_ids and len(self.output_ids) >= p.min_new_tokens:
            self.finish_reason = {"type": "stop", "matched": token}
        elif len(self.output_ids) >= p.max_new_tokens:
            self.finish_reason = {"type": "length", "length": p.max_new_tokens}


def server_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto`: bf16 where `device` multiplies it natively, else fp32 (never fp16 silently); a
    bf16 checkpoint on an AVX2-only CPU is served in fp32, ~50x faster than emulated bf16."""
    return DTYPES[resolve_dtype(name, device.type, "server")]


class ModelRunner:
    """Owns the model, the tokenizer and the running batch. Not thread-safe: one caller thread."""

    # transformers auto class that loads the served checkpoint (VLMRunner overrides it).
    auto_model_class = "AutoModelForCausalLM"
    accepts_images = False

    def __init__(self, model_path: str, dtype: str = "auto", device: str | None = None, seed=0):
        import transformers
        from transformers import AutoTokenizer

        self.model_path = model_path
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = server_dtype(dtype, self.device)
        # bf16 on CPU: attention and the KV cache in fp32, the rest bf16 (server.cpu_attention).
        self.kv_dtype = attention_dtype(self.dtype, self.device.type)
        attn = {} if self.kv_dtype == self.dtype else {"attn_implementation": cpu_attention.NAME}
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        auto_cls = getattr(transformers, self.auto_model_class)
        self.model = auto_cls.from_pretrained(model_path, dtype=self.dtype, **attn)
        self.model.to(self.device).eval()
        # transformers renamed the forward's `past_key_values` to `cache` (the old name warns).
        forward_args = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in forward_args else "past_key_values"
        text_config = self.model.config.get_text_config()
        self.vocab_size = self.model.get_input_embeddings().num_embeddings
        self.max_positions = int(getattr(text_config, "max_position_embeddings", 0) or 1 << 20)
        self.eos_ids = self._eos_ids()
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.batch: RunningBatch | None = None
        self._mergeable: bool | None = None

    def _eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        for src in (self.model.generation_config, self.model.config):
            eos = getattr(src, "eos_token_id", None)
            ids.update([eos] if isinstance(eos, int) else (eos or []))
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return frozenset(ids)

    # ---- requests -------------------------------------------------------------------------
    def new_sequence(self, req: GenerateRequest) -> Sequence:
        stop = set(req.params.stop_token_ids)
        if not req.params.ignore_eos:
            stop |= self.eos_ids
        return Sequence(req=req, stop_ids=frozenset(stop))

    @property
    def num_running(self) -> int:
        return 0 if self.batch is None else len(self.batch.seqs)

    @property
    def running(self) -> list[Sequence]:
        return [] if self.batch is None else list(self.batch.seqs)

    @property
    def can_join_running(self) -> bool:
        """Whether new rows may enter a running batch (plain full-attention caches only)."""
        return self.batch is None or bool(self._mergeable)

    # ---- one scheduler step ---------------------------------------------------------------
    def step(self, new: list[Sequence]) -> list[Sequence]:
        """Decode one token for every running row, prefill `new`; return the rows that finished."""
        if self.batch is not None:
            self._decode(self.batch)
        if new:
            joined = self._prefill(new)
            self.batch = joined if self.batch is None else merge_batches(self.batch, joined)
        return self._drop(lambda s: s.finish_reason is not None)

    def drop_running(self) -> list[Sequence]:
        """Forget the running batch (its KV cache with it); returns its sequences."""
        seqs = [] if self.batch is None else list(self.batch.seqs)
        self.batch = None
        return seqs

    def abort(self, hit: Callable[[Sequence], bool], message: str) -> list[Sequence]:
        """Remove the running rows `hit` selects, marking them finished by abort."""
        if self.batch is not None:
            for s in self.batch.seqs:
                if hit(s):
                    s.finish_reason = {"type": "abort", "message": message}
        return self._drop(lambda s: s.finish_reason is not None)

    def _forward(
        self, batch: RunningBatch, input_ids: torch.Tensor, position_ids: torch.Tensor, **extra
    ):
        with self._attention_kernels():
            out = self.model(
                input_ids=input_ids,
                attention_mask=batch.attention_mask,
                position_ids=position_ids,
                **{self._cache_arg: batch.cache},
                use_cache=True,
                logits_to_keep=1,
                **extra,
            )
        return out.logits[:, -1, :]

    def _attention_kernels(self):
        """On CUDA, SDPA without cuDNN: its per-shape graph build cost ~50 ms a decoding step on
        an H200 (docs/results.md, GPU: the long regime), 10x the step itself."""
        return sdpa_without_cudnn() if self.device.type == "cuda" else contextlib.nullcontext()

    def _prefill_inputs(
        self, seqs: list[Sequence], ids: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """Position ids of the left-padded prompts, the position of each row's next token, and
        extra model kwargs. Text: positions count real tokens, so padding never shifts RoPE."""
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        return positions, mask.sum(-1), {}

    def _prefill(self, seqs: list[Sequence]) -> RunningBatch:
        """Prefill `seqs` as one left-padded batch. Rows with the same prompt (a GRPO group's
        samples) are computed once and their cache rows copied: a group of 8 costs one prompt's
        prefill, which is most of a short rollout's compute."""
        shareable = self._mergeable and not self.accepts_images  # plain text caches only
        unique, row_of = unique_prompts(seqs) if shareable else (seqs, None)
        lens = [len(s.req.input_ids) for s in unique]
        width = max(lens)
        ids = torch.full((len(unique), width), 0, dtype=torch.long)
        mask = torch.zeros((len(unique), width), dtype=torch.long)
        for i, s in enumerate(unique):
            ids[i, width - lens[i] :] = torch.tensor(s.req.input_ids)
            mask[i, width - lens[i] :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions, next_positions, extra = self._prefill_inputs(unique, ids, mask)
        batch = RunningBatch(
            seqs=unique,
            cache=new_cache(self.model.config, self.kv_dtype),
            attention_mask=mask,
            positions=next_positions,
            last_tokens=ids[:, -1],
        )
        logits = self._forward(batch, ids, positions, **extra)
        if self._mergeable is None:
            self._mergeable = can_join(batch.cache)
        if row_of is not None:
            row_of = row_of.to(self.device)
            batch, logits = repeat_rows(batch, seqs, row_of), logits[row_of]
        self._sample(batch, logits)
        return batch

    def _decode(self, batch: RunningBatch) -> None:
        ones = batch.attention_mask.new_ones((len(batch.seqs), 1))
        batch.attention_mask = torch.cat([batch.attention_mask, ones], dim=1)
        logits = self._forward(batch, batch.last_tokens[:, None], batch.positions[:, None])
        batch.positions = batch.positions + 1
        self._sample(batch, logits)

    def _sample(self, batch: RunningBatch, logits: torch.Tensor) -> None:
        if batch.sampling is None:
            batch.sampling = SamplingTensors.build(
                [s.req.params for s in batch.seqs], logits.shape[-1], self.device
            )
        positions = None
        if batch.sampling.any_seeded:  # seeded draws depend on the position being sampled
            positions = [len(s.req.input_ids) + len(s.output_ids) for s in batch.seqs]
        tokens, logprobs = sample_next_tokens(
            logits, batch.sampling, self.generator, self._banned(batch.seqs, logits), positions
        )
        batch.last_tokens = tokens
        ks = [s.top_logprobs for s in batch.seqs]
        for row, pairs in top_logprobs(logits, batch.sampling.temperature, ks).items():
            batch.seqs[row].output_top_logprobs.append(pairs)
        for s, t, lp in zip(batch.seqs, tokens.tolist(), logprobs.tolist()):
            s.append(t, lp)

    def _banned(self, seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor | None:
        """Stop tokens may not be drawn before a row's min_new_tokens (SGLang semantics)."""
        rows = [
            (i, list(s.stop_ids))
            for i, s in enumerate(seqs)
            if s.stop_ids and len(s.output_ids) < s.req.params.min_new_tokens
        ]
        if not rows:
            return None
        banned = torch.zeros(logits.shape, dtype=torch.bool)
        for i, ids in rows:
            banned[i, [t for t in ids if t < logits.shape[-1]]] = True
        return banned.to(logits.device)

    # ---- batch surgery --------------------------------------------------------------------
    def _drop(self, finished) -> list[Sequence]:
        """Take the rows `finished` selects out of the running batch and return them."""
        batch = self.batch
        if batch is None:
            return []
        done = [s for s in batch.seqs if finished(s)]
        if not done:
            return []
        if len(done) == len(batch.seqs):
            self.batch = None
            return done
        keep_list = [i for i, s in enumerate(batch.seqs) if not finished(s)]
        self.batch = keep_rows(batch, keep_list, trim_padding=bool(self._mergeable))
        return done

    # ---- weights --------------------------------------------------------------------------
    def load_weights_from_disk(self, path: str) -> str:
        """Copy a same-architecture checkpoint into the live parameters (no re-allocation).
        The scheduler calls this between steps, with no row running or the running ones frozen."""
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        state = self._read_safetensors(files) if files else None
        if state is None:
            state = self._read_with_transformers(path)
        self._copy_into_model(state)
        return f"loaded {len(state)} tensors from {path}"

    def load_named_tensors(self, tensors: list[tuple[str, torch.Tensor]]) -> str:
        """A partial update (one bucket of a distributed push): names and shapes must match."""
        own = self.model.state_dict()
        bad = [
            f"{n} {list(t.shape)}" for n, t in tensors if n not in own or own[n].shape != t.shape
        ]
        if bad:
            raise ValueError(f"names/shapes not in the served model: {', '.join(bad[:5])}")
        self._copy_into_model(dict(tensors))
        return f"loaded {len(tensors)} tensors"

    def _copy_into_model(self, state: dict[str, torch.Tensor]) -> None:
        """In place, so parameter storage (and anything holding it) stays valid."""
        own = self.model.state_dict()
        with torch.no_grad():
            for name, tensor in state.items():
                own[name].copy_(tensor)

    def _read_safetensors(self, files: list[str]) -> dict[str, torch.Tensor] | None:
        """The checkpoint's tensors when their names and shapes match ours; None otherwise."""
        from safetensors.torch import load_file

        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(f))
        return state if self._matches(state) else None

    def _read_with_transformers(self, path: str) -> dict[str, torch.Tensor]:
        """Fallback for renamed keys / .bin checkpoints: let transformers do the mapping."""
        import transformers

        auto_cls = getattr(transformers, self.auto_model_class)
        other = auto_cls.from_pretrained(path, dtype=self.dtype)
        state = other.state_dict()
        if not self._matches(state):
            raise ValueError(f"checkpoint at {path} does not match the served architecture")
        return state

    def _matches(self, state: dict[str, torch.Tensor]) -> bool:
        own = self.model.state_dict()
        if any(k not in own or own[k].shape != v.shape for k, v in state.items()):
            return False
        present = {own[k].data_ptr() for k in state}
        # A key may be absent only when it is tied to one that is present (e.g. lm_head).
        return all(own[k].data_ptr() in present for k in own.keys() - state.keys())
