"""Server counters rendered as Prometheus text (a handful of series; no client library needed)."""

from __future__ import annotations

import threading
import time
from collections import Counter

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


# Single-valued metrics of /metrics: (name after "arealite_", type, help, attribute).
SCALAR_METRICS = [
    ("prompt_tokens_total", "counter", "Prompt tokens of finished requests.", "prompt_tokens"),
    ("generation_tokens_total", "counter", "Tokens generated.", "generation_tokens"),
    ("decode_steps_total", "counter", "Batched forward steps.", "decode_steps"),
    (
        "busy_seconds_total",
        "counter",
        "Seconds spent in batched steps (busy / wall time: the occupancy).",
        "busy_seconds",
    ),
    ("running_requests", "gauge", "Requests in the decoding batch.", "running"),
    ("waiting_requests", "gauge", "Requests queued for admission.", "waiting"),
    ("batch_size", "gauge", "Rows in the latest step.", "last_batch_size"),
    ("max_batch_size", "gauge", "Largest step batch seen.", "max_batch_size"),
    ("weight_version", "gauge", "Version of the served weights.", "weight_version"),
    ("paused", "gauge", "1 while generation is paused.", "paused"),
    ("start_time_seconds", "gauge", "Unix time the server started.", "started"),
]


class ServerMetrics:
    """Updated by the scheduler thread, read by the HTTP thread; one lock guards both."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests = Counter()  # finish type -> count
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.decode_steps = 0
        self.running = 0
        self.waiting = 0
        self.last_batch_size = 0
        self.max_batch_size = 0
        self.batch_hist = [0] * (len(BATCH_BUCKETS) + 1)
        self.batch_sum = 0
        self.busy_seconds = 0.0  # time inside batched steps: busy / wall is the occupancy
        self.weight_version = 0
        self.paused = False
        self.started = time.time()

    def on_step(self, batch_size: int, new_tokens: int, seconds: float = 0.0) -> None:
        with self._lock:
            self.decode_steps += 1
            self.busy_seconds += seconds
            self.generation_tokens += new_tokens
            self.last_batch_size = batch_size
            self.max_batch_size = max(self.max_batch_size, batch_size)
            self.batch_sum += batch_size
            i = next(
                (i for i, b in enumerate(BATCH_BUCKETS) if batch_size <= b), len(BATCH_BUCKETS)
            )
            self.batch_hist[i] += 1

    def on_finish(self, finish_type: str, prompt_tokens: int) -> None:
        with self._lock:
            self.requests[finish_type] += 1
            self.prompt_tokens += prompt_tokens

    def set_queue(self, running: int, waiting: int) -> None:
        with self._lock:
            self.running, self.waiting = running, waiting

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "generation_tokens": self.generation_tokens,
                "running": self.running,
                "waiting": self.waiting,
                "decode_steps": self.decode_steps,
                "max_batch_size": self.max_batch_size,
                "batch_rows": self.batch_sum,
                "busy_seconds": self.busy_seconds,
            }

    def render(self) -> str:
        """Prometheus text exposition format, version 0.0.4."""
        with self._lock:
            lines: list[str] = []

            def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]):
                lines.append(f"# HELP arealite_{name} {help_}")
                lines.append(f"# TYPE arealite_{name} {kind}")
                lines.extend(f"arealite_{name}{labels} {value}" for labels, value in samples)

            finish_types = ("stop", "length", "abort")
            metric(
                "requests_total",
                "counter",
                "Finished /generate requests by finish reason.",
                [(f'{{finish_reason="{t}"}}', self.requests[t]) for t in finish_types],
            )
            for name, kind, help_, attr in SCALAR_METRICS:
                value = getattr(self, attr)
                metric(name, kind, help_, [("", int(value) if isinstance(value, bool) else value)])
            lines.extend(self._batch_histogram())
            return "\n".join(lines) + "\n"

    def _batch_histogram(self) -> list[str]:
        """The step batch-size histogram (cumulative buckets, sum, count)."""
        cumulative, buckets = 0, []
        for bound, count in zip((*BATCH_BUCKETS, "+Inf"), self.batch_hist):
            cumulative += count
            buckets.append((f'_bucket{{le="{bound}"}}', cumulative))
        buckets += [("_sum", self.batch_sum), ("_count", self.decode_steps)]
        return [
            "# HELP arealite_step_batch_size Rows per batched step.",
            "# TYPE arealite_step_batch_size histogram",
            *(f"arealite_step_batch_size{suffix} {v}" for suffix, v in buckets),
        ]
