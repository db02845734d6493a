"""PNG plots of a run (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def _twin(path: Path, title: str, xlabel: str, xs: list[Any], rates: list[Any], p99s: list[Any]) -> Path:
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, rates, "o-", color="tab:blue", label="writes/s")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("player-score writes/s", color="tab:blue")
    ax.set_xticks(xs)
    ax.set_ylim(bottom=0)
    other = ax.twinx()
    other.plot(xs, [p if p is not None else float("nan") for p in p99s], "s--", color="tab:red", label="p99")
    other.set_ylabel("p99 latency, ms", color="tab:red")
    other.set_ylim(bottom=0)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# (sweep in summary.json, PNG, title, x axis label, x field of a point)
_SWEEPS = (
    ("masters", "sweep_masters.png", "Raw writes vs cluster masters (same 2 cores)", "masters", "masters"),
    ("routers", "sweep_routers.png", "HTTP writes vs router processes", "router processes", "router_workers"),
)


def sweeps(summary: dict[str, Any], out: Path) -> list[Path]:
    """writes/s and p99 against cluster masters and against router processes."""
    made = []
    for sweep, file, title, x_label, x in _SWEEPS:
        pts = summary.get("sweeps", {}).get(sweep)
        if pts:
            writes, p99 = [p["writes_per_s"] for p in pts], [p["p99_ms"] for p in pts]
            made.append(_twin(out / file, title, x_label, [p[x] for p in pts], writes, p99))
    return made


def latency_vs_players(scale: dict[str, Any], path: Path) -> Path:
    """p50 and p99 of each read against the board size (bench-scale's measurement points)."""
    fig, ax = plt.subplots(figsize=(6, 4))
    points = scale["points"]
    xs = [p["players"] for p in points]
    for n, op in enumerate(points[0]["latency_ms"]):
        for q, style in (("p50", "o-"), ("p99", "s--")):
            ax.plot(xs, [p["latency_ms"][op][q] for p in points], style, color=f"C{n}", label=f"{op} {q}")
    ax.set_xscale("log")
    ax.set_xlabel("players on the board")
    ax.set_ylabel("latency, ms (one caller, library)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"Read latency vs board size ({scale['shards']} shards)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
