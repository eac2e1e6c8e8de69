"""The demo report's plots: one metric over the run per (version, arm), decisions marked."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from services.report.cohorts import Row, parse_ts, series
from services.report.sources import Decision

METRIC_LABELS = {
    "edit_persistence": "edit persistence (primary horizon, accepted edits)",
    "latency_ms": "mean latency (ms)",
    "reward": "mean reward",
}


def plot_metric(rows: Sequence[Row], t0: float, metric: str, path: Path,
                decisions: Sequence[Decision] = (), bin_s: float = 20.0) -> None:
    import matplotlib  # slow to import: only when a report is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    colours: dict[str, Any] = {}
    cmap = plt.get_cmap("tab10")
    for (version, arm), pts in series(rows, t0, bin_s, metric).items():
        colour = colours.setdefault(version, cmap(len(colours) % 10))
        xs, ys = zip(*pts, strict=True)
        label = f"v{version} {arm}"
        ax.plot(xs, ys, linestyle="-" if arm == "stable" else "--", marker=".", color=colour, label=label)
    for d in decisions:
        try:
            x = (parse_ts(d.decided_at) - t0) / 60.0
        except ValueError:
            continue
        ax.axvline(x, color="green" if d.outcome == "promoted" else "red", alpha=0.4, linewidth=1)
        ax.annotate(f"v{d.candidate} {d.outcome}", (x, 1.0), xycoords=("data", "axes fraction"),
                    rotation=90, va="top", ha="right", fontsize=7)
    ax.set_xlabel("minutes since the loop started")
    ax.set_ylabel(METRIC_LABELS.get(metric, metric))
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
