"""Trainer throughput: packed (padding-free) micro-batches vs padded batches; weight upload.

Figures (one JSON line each, then ratios):
- train_packed / train_padded: real tokens per second (wall and process-CPU time) of full
  optimizer steps (forward, backward, clip, AdamW) on the same samples and the same model
  weights and optimizer settings, alternating in rounds (median reported). Lengths are uniform
  in [16, 512]. Packed = FSDPEngine.train_batch, `max_tokens_per_mb` tokens per micro-batch,
  attn_impl sdpa_varlen; padded = micro-batches of `max_tokens_per_mb // 512` sequences (the
  count that always fits the same token budget), right-padded to their longest row, HF sdpa
  with the padding mask. `--with-dense-mask` adds packed + sdpa with a [T, T] block mask.
- upload_disk_<model>: seconds of `upload_weights(disk)` (bucketed gather + safetensors
  shards + atomic rename) over 2 gloo ranks, and the extra resident memory rank 0 needed, for
  the tiny model and a ~50M-parameter one; `*_one_bucket` repeats the latter with a bucket
  larger than the model, i.e. the "gather everything first" baseline.
Each figure group runs in a fresh subprocess so `peak_rss_mb` belongs to it alone. One torch
thread by default: the cores are shared, and OpenMP spin-waits under contention make
multi-thread timings meaningless.

    python bench/train_throughput.py [--n-seqs 32] [--rounds 3] [--max-tokens 4096]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import psutil
import torch
from bench_io import emit

from arealite.utils.data import pad_sequences_to_tensors, trim_padding

MIN_LEN, MAX_LEN = 16, 512


def _release_free_heap() -> None:
    """Return freed heap pages to the OS so an RSS delta measures live allocations only."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


class PeakRSS:
    """Highest resident memory seen (sampled every 2 ms) while the block runs."""

    def __enter__(self):
        _release_free_heap()
        self.proc = psutil.Process()
        self.base = self.peak = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._poll, daemon=True)
        self._t.start()
        return self

    def _poll(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)

    @property
    def extra_mb(self) -> float:
        return (self.peak - self.base) / 2**20

    @property
    def peak_mb(self) -> float:
        return self.peak / 2**20


def make_samples(n: int, vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(MIN_LEN, MAX_LEN + 1, (1,), generator=g))
        prompt = length // 4
        rows.append(
            {
                "input_ids": torch.randint(3, vocab, (length,), generator=g),
                "loss_mask": torch.tensor([0] * prompt + [1] * (length - prompt)),
            }
        )
    return pad_sequences_to_tensors(rows)


def make_engine(model_dir: str, max_tokens: int | None, bucket_mb: int = 256, attn_impl=None):
    from arealite.api.cli_args import FSDPConfig, MicroBatchSpec, OptimizerConfig, TrainEngineConfig
    from arealite.engine.sft.lm_engine import FSDPLMEngine

    cfg = TrainEngineConfig(
        path=model_dir,
        fsdp=FSDPConfig(param_dtype="float32"),
        mb_spec=MicroBatchSpec(max_tokens_per_mb=max_tokens),
        optimizer=OptimizerConfig(lr=1e-5),
        weight_update_bucket_mb=bucket_mb,
        **({"attn_impl": attn_impl} if attn_impl else {}),
    )
    engine = FSDPLMEngine(cfg)
    engine.initialize(None, None)
    return engine


def padded_step(engine, batch, mb_size: int) -> None:
    """The padded baseline: same model, loss normalisation, clipping and optimizer."""
    from arealite.engine.fsdp import clip_grad_norm_
    from arealite.engine.logprobs import gather_logprobs

    total = (batch["loss_mask"][:, 1:].bool() & batch["attention_mask"][:, 1:]).sum()
    engine.optimizer.zero_grad(set_to_none=True)
    for i in range(0, batch.batch_size[0], mb_size):
        mb = trim_padding(batch[i : i + mb_size])
        ids, att = mb["input_ids"], mb["attention_mask"]
        logits = engine.model(input_ids=ids, attention_mask=att.long(), use_cache=False).logits
        logp = gather_logprobs(logits[:, :-1], ids[:, 1:])
        mask = mb["loss_mask"][:, 1:].bool() & att[:, 1:]
        (-(logp * mask).sum() / total).backward()
    clip_grad_norm_(list(engine.model.parameters()), 1.0)
    engine.optimizer.step()


def run_train(a) -> None:
    engine = make_engine(a.model, a.max_tokens)  # default attn_impl: sdpa_varlen
    # The padded baseline feeds [b, L] batches with a padding mask: plain HF sdpa.
    padded = make_engine(a.model, a.max_tokens, attn_impl="sdpa")
    batch = make_samples(a.n_seqs, engine.model.config.vocab_size)
    n_tokens = int(batch["attention_mask"].sum())
    mb_size = max(1, a.max_tokens // MAX_LEN)
    systems = {
        "train_packed": lambda: engine.train_lm(batch),
        "train_padded": lambda: padded_step(padded, batch, mb_size),
    }
    if a.with_dense_mask:  # packed, but sdpa over the whole row with a [T, T] mask
        dense = make_engine(a.model, a.max_tokens, attn_impl="sdpa")
        systems["train_packed_dense_mask"] = lambda: dense.train_lm(batch)
    for f in systems.values():  # warm-up
        f()
    times = {k: [] for k in systems}
    cpu_times = {k: [] for k in systems}
    peaks = dict.fromkeys(systems, 0.0)
    for _ in range(a.rounds):
        for name, f in systems.items():
            with PeakRSS() as mem:
                t0, c0 = time.perf_counter(), time.process_time()
                f()
                times[name].append(time.perf_counter() - t0)
                cpu_times[name].append(time.process_time() - c0)
            peaks[name] = max(peaks[name], mem.peak_mb)
    slots = int(
        sum(
            trim_padding(batch[i : i + mb_size])["attention_mask"].numel()
            for i in range(0, a.n_seqs, mb_size)
        )
    )
    for name, ts in times.items():
        sec = statistics.median(ts)
        extra = (
            {"pad_fraction": round(1 - n_tokens / slots, 3), "seqs_per_mb": mb_size}
            if "padded" in name
            else {
                "max_tokens_per_mb": a.max_tokens,
                "attn_impl": "sdpa" if "dense" in name else "sdpa_varlen",
            }
        )
        emit(
            name,
            tokens_per_s=round(n_tokens / sec, 1),
            tokens_per_cpu_s=round(n_tokens / statistics.median(cpu_times[name]), 1),
            seconds=round(sec, 3),
            n_tokens=n_tokens,
            n_seqs=a.n_seqs,
            peak_rss_mb=round(peaks[name], 1),
            **extra,
        )
    for e in (engine, padded):
        e.destroy()


def run_upload(a) -> None:
    """Under torchrun: every rank gathers, rank 0 writes and reports."""
    from arealite.utils import distributed as du

    engine = make_engine(a.model, None, bucket_mb=a.bucket_mb)
    n_params = sum(p.numel() for p in engine.model.parameters())
    from arealite.api.io_struct import WeightUpdateMeta

    meta = WeightUpdateMeta.from_disk(os.path.join(a.out_dir, a.figure))  # shared by ranks
    engine.upload_weights(meta)  # warm-up (page cache, imports)
    secs, extras = [], []
    for _ in range(a.rounds):
        with PeakRSS() as mem:
            t0 = time.perf_counter()
            engine.upload_weights(meta)
            secs.append(time.perf_counter() - t0)
        extras.append(mem.extra_mb)
    n_files = len([f for f in os.listdir(meta.path) if f.endswith(".safetensors")])
    if du.is_main():
        emit(
            a.figure,
            seconds=round(statistics.median(secs), 3),
            n_params=n_params,
            model_mb=round(n_params * 4 / 2**20, 1),
            bucket_mb=a.bucket_mb,
            n_shards=n_files,
            ranks=du.world_size(),
            extra_rss_mb=round(max(extras), 1),
            peak_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        )
    engine.destroy()


def child(args: list[str], ranks: int = 1) -> list[dict]:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    cmd = [sys.executable, __file__, *args]
    if ranks > 1:
        from arealite.utils.network import find_free_port

        run = ["-m", "torch.distributed.run", "--nproc-per-node", str(ranks)]
        cmd = [sys.executable, *run, "--master-port", str(find_free_port()), __file__, *args]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    lines = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    for x in lines:
        print(json.dumps(x), flush=True)
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n-seqs", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--child", choices=["train", "upload"])
    p.add_argument("--model")
    p.add_argument("--figure")
    p.add_argument("--out-dir")
    p.add_argument("--bucket-mb", type=int, default=64)
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads (shared cores: 1 avoids spin noise)"
    )
    p.add_argument("--upload-ranks", type=int, default=2, help="gloo ranks for upload figures")
    p.add_argument("--with-dense-mask", action="store_true", help="also packed sdpa + [T,T] mask")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    if a.child == "train":
        return run_train(a)
    if a.child == "upload":
        return run_upload(a)

    from arealite.testing.tiny_model import build_tiny_model, model_sizes

    with tempfile.TemporaryDirectory() as d:
        tiny = build_tiny_model(os.path.join(d, "tiny"))
        big = build_tiny_model(os.path.join(d, "m50"), **model_sizes(512, 12, 8, 2048, 4))
        common = ["--rounds", str(a.rounds), "--threads", str(a.threads)]
        train = child(
            [
                "--child",
                "train",
                "--model",
                tiny,
                "--n-seqs",
                str(a.n_seqs),
                "--max-tokens",
                str(a.max_tokens),
                *(["--with-dense-mask"] if a.with_dense_mask else []),
                *common,
            ]
        )
        up = []
        for fig, model, bucket in (
            ("upload_disk_tiny", tiny, 16),
            ("upload_disk_50m", big, 16),
            ("upload_disk_50m_one_bucket", big, 4096),
        ):
            up += child(
                [
                    "--child",
                    "upload",
                    "--model",
                    model,
                    "--figure",
                    fig,
                    "--bucket-mb",
                    str(bucket),
                    "--out-dir",
                    d,
                    *common,
                ],
                ranks=a.upload_ranks,
            )
    by = {x["figure"]: x for x in train + up}
    emit(
        "ratios",
        packed_over_padded_tokens_per_s=round(
            by["train_packed"]["tokens_per_s"] / by["train_padded"]["tokens_per_s"], 2
        ),
        packed_over_padded_tokens_per_cpu_s=round(
            by["train_packed"]["tokens_per_cpu_s"] / by["train_padded"]["tokens_per_cpu_s"], 2
        ),
        upload_50m_over_tiny_seconds=round(
            by["upload_disk_50m"]["seconds"] / by["upload_disk_tiny"]["seconds"], 2
        ),
        upload_50m_extra_rss_bucketed_over_one_bucket=round(
            by["upload_disk_50m"]["extra_rss_mb"]
            / max(by["upload_disk_50m_one_bucket"]["extra_rss_mb"], 1e-6),
            2,
        ),
    )


if __name__ == "__main__":
    main()
