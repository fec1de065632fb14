"""The embedded server's decoding under continuous batching, as an asynchronous GRPO run loads
it: `ModelRunner.step` kept at about `--rows` running rows, a new group of `--samples` rows of
one long_sums prompt admitted whenever a group's worth of rows has finished, each row sampled at
T 1 until it stops. Prints tokens/s and the share of the time spent on batch surgery (rows
joining and leaving: `merge_batches`, `keep_rows`) per target size, side by side with the
baseline `copy_all`: the same cache re-copied whole on every join and leave (no spare rows;
kept rows gathered into a new buffer), as DynamicCache does.

    python bench/server_steady_decode.py MODEL_PATH [--rows 48,128,256] [--seconds 20]
        [--dtype auto] [--threads 1]
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch
from bench_io import emit, emit_machine
from server_decode_profile import requests

from arealite.server import kv_batch
from arealite.server import model_runner as runner_module
from arealite.server.model_runner import ModelRunner


class CopyAll:
    """The baseline layout, patched in: no spare rows (every join re-copies the cache) and
    leaving rows make a gathered copy of the kept ones."""

    def __enter__(self):
        self.saved = kv_batch.spare_rows, kv_batch.SlackLayer.move_rows
        kv_batch.spare_rows = lambda rows: 0
        kv_batch.SlackLayer.move_rows = CopyAll.gather_kept

    def __exit__(self, *exc):
        kv_batch.spare_rows, kv_batch.SlackLayer.move_rows = self.saved

    @staticmethod
    def gather_kept(layer, src, dst, rows):
        order = torch.arange(rows)
        order[dst] = src
        layer.batch_select_indices(order)


class SurgeryClock:
    """Seconds spent inside the runner's batch surgery (wrapped module functions)."""

    def __init__(self):
        self.seconds = 0.0
        for name in ("merge_batches", "keep_rows"):
            setattr(runner_module, name, self._timed(getattr(runner_module, name)))

    def _timed(self, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        return timed


def steady(runner: ModelRunner, clock: SurgeryClock, rows: int, samples: int, seconds: float):
    """Decode for `seconds` at about `rows` rows; (tokens, wall seconds, surgery seconds, steps,
    mean rows, mean cache columns)."""
    pool = requests(runner, 4 * rows, 320, samples)
    tokens = steps = row_sum = col_sum = 0
    clock.seconds = 0.0
    start = time.perf_counter()
    nxt = 0
    with torch.inference_mode():
        while time.perf_counter() - start < seconds:
            new = []
            while runner.num_running + len(new) + samples <= rows:
                group = pool[nxt % len(pool) : nxt % len(pool) + samples]
                new += [runner.new_sequence(s.req) for s in group]
                nxt += samples
            tokens += runner.num_running + len(new)
            runner.step(new)
            steps += 1
            row_sum += runner.num_running
            if runner.batch is not None:
                col_sum += runner.batch.attention_mask.shape[1]
    wall = time.perf_counter() - start
    runner.drop_running()
    return tokens, wall, clock.seconds, steps, row_sum / steps, col_sum / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model_path")
    p.add_argument("--rows", default="48,128,256")
    p.add_argument("--samples", type=int, default=8, help="rows per prompt (a GRPO group)")
    p.add_argument("--seconds", type=float, default=20.0, help="per row target")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the split server: 1)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    emit_machine()
    runner = ModelRunner(args.model_path, dtype=args.dtype)
    clock = SurgeryClock()
    steady(runner, clock, 16, args.samples, 2.0)  # warm-up
    for rows in (int(r) for r in args.rows.split(",")):
        rates = {}
        for layout in ("copy_all", "rows_in_place"):
            with CopyAll() if layout == "copy_all" else contextlib.nullcontext():
                tokens, wall, surgery, steps, mean_rows, mean_cols = steady(
                    runner, clock, rows, args.samples, args.seconds
                )
            rates[layout] = tokens / wall
            emit(
                "steady_decode",
                layout=layout,
                rows=rows,
                threads=args.threads,
                dtype=str(runner.dtype),
                tokens_per_s=round(tokens / wall, 1),
                ms_per_step=round(1e3 * wall / steps, 2),
                surgery_share=round(surgery / wall, 3),
                mean_rows=round(mean_rows, 1),
                mean_cache_columns=round(mean_cols, 1),
            )
        emit(
            "steady_decode_ratio",
            rows=rows,
            rows_in_place_vs_copy_all=round(rates["rows_in_place"] / rates["copy_all"], 3),
        )


if __name__ == "__main__":
    main()
