"""A PNG of a run's learning curves (reward, accuracy, loss), written next to its logs.

A glance at one picture answers "did it learn?" without starting TensorBoard. Uses matplotlib's
object API with the Agg canvas, so it never touches the global backend of the caller.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence

# Panel title -> regex of the keys it shows. "/min" and "/max" companions are left out.
DEFAULT_PANELS: dict[str, str] = {
    "reward": r"reward",
    "accuracy": r"(^|/|_)acc(uracy)?($|/|_)",
    "loss": r"loss",
}
MAX_CURVES_PER_PANEL = 6


def read_metrics_jsonl(path: str) -> list[dict]:
    """The records of a metrics.jsonl (one JSON object per line; blank/torn lines skipped)."""
    records = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line torn by a crash mid-write
    return records


def select_curves(records: Sequence[Mapping], pattern: str) -> dict[str, tuple[list, list]]:
    """key -> (steps, values) for numeric keys matching `pattern` (not their /min, /max)."""
    keys = sorted(
        {
            k
            for r in records
            for k, v in r.items()
            if k != "step"
            and re.search(pattern, k, re.IGNORECASE)
            and not re.search(r"/(min|max)$", k)
            and isinstance(v, (int, float))
        }
    )
    curves = {}
    for k in keys[:MAX_CURVES_PER_PANEL]:
        pts = [
            (r["step"], float(r[k]))
            for r in records
            if isinstance(r.get(k), (int, float)) and math.isfinite(r[k])
        ]
        if pts:
            curves[k] = ([p[0] for p in pts], [p[1] for p in pts])
    return curves


def plot_curves(
    records: Iterable[Mapping], out_path: str, panels: Mapping[str, str] | None = None
) -> str | None:
    """Write one subplot per panel that has matching keys; returns `out_path`, or None if
    no key matched (nothing to plot)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    records = [r for r in records if "step" in r]
    panels = panels or DEFAULT_PANELS
    chosen = {t: c for t, p in panels.items() if (c := select_curves(records, p))}
    if not chosen:
        return None
    fig = Figure(figsize=(6.5, 3.0 * len(chosen)))
    FigureCanvasAgg(fig)
    for i, (title, curves) in enumerate(chosen.items()):
        ax = fig.add_subplot(len(chosen), 1, i + 1)
        for key, (steps, values) in curves.items():
            ax.plot(steps, values, label=key, linewidth=1.2)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)
    return out_path
