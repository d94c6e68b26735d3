"""PNG plots of the collected analysis tables (matplotlib, Agg canvas).

Figures are built on ``matplotlib.figure.Figure`` with an explicit Agg
canvas, not through pyplot: no global backend switch, no GUI, no figure
registry to leak memory across calls, so this runs headless and inside
other programs. Each function takes a small, already-collected DataFrame
(the output of one analysis function) and writes one PNG. An empty table
still gives a PNG that says so, so a report always has the same files.
"""

from __future__ import annotations

from pathlib import Path

import polars as pl
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

PHASE_COLORS = {"draft_ms": "tab:orange", "verify_ms": "tab:blue", "host_ms": "tab:gray"}


def plot_histogram(histogram: pl.DataFrame, path: Path, title: str) -> Path:
    """Bars of ``acceptance.histogram``: share of cycles per acceptance length."""
    figure, axes = _figure()
    if histogram.height:
        axes.bar(histogram["length"].to_list(), histogram["share"].to_list(), color="tab:blue")
        axes.set_xticks(histogram["length"].to_list())
    _label(axes, f"{title}: acceptance length", "tokens emitted per cycle (accepted + 1)", "share of cycles")
    return _save(figure, path, empty=histogram.height == 0)


def plot_positions(positions: pl.DataFrame, path: Path, title: str) -> Path:
    """Lines of ``acceptance.position_acceptance``: P(accepted ≥ k) per draft position k."""
    figure, axes = _figure()
    if positions.height:
        k = positions["k"].to_list()
        axes.plot(k, positions["rate"].to_list(), marker="o", label="P(accepted ≥ k)")
        axes.plot(k, positions["rate_when_proposed"].to_list(), marker=".", linestyle="--", label="… | proposed ≥ k")
        axes.set_xticks(k)
        axes.set_ylim(0, 1.02)
        axes.legend()
    _label(axes, f"{title}: acceptance per position", "draft position k", "rate")
    return _save(figure, path, empty=positions.height == 0)


def plot_rolling_tau(rolling: pl.DataFrame, path: Path, title: str, window: int) -> Path:
    """Line of ``acceptance.rolling_tau`` (possibly thinned) against cycle_id."""
    figure, axes = _figure()
    if rolling.height:
        axes.plot(rolling["cycle_id"].to_list(), rolling["tau"].to_list(), linewidth=1)
    _label(axes, f"{title}: τ over the last {window} calls", "cycle_id", "τ (tokens per owner-cycle)")
    return _save(figure, path, empty=rolling.height == 0)


def plot_latency(latency: pl.DataFrame, path: Path, title: str) -> Path:
    """Stacked bars of ``throughput.latency_by(..., "owners")``: mean ms per call by phase."""
    figure, axes = _figure()
    if latency.height:
        owners = [str(value) for value in latency["owners"].to_list()]
        bottom = [0.0] * latency.height
        for phase, color in PHASE_COLORS.items():
            values = latency[phase].fill_null(0).to_list()
            axes.bar(owners, values, bottom=bottom, color=color, label=phase)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        axes.legend()
    _label(axes, f"{title}: latency per call", "owners in the call", "mean ms per call")
    return _save(figure, path, empty=latency.height == 0)


def plot_comparison(table: pl.DataFrame, path: Path) -> Path:
    """Bars of ``compare.compare``: wall tokens/s per run, speedup written on each bar."""
    figure, axes = _figure()
    names = table["name"].to_list()
    rates = table["tokens_per_s"].fill_null(0).to_list()
    bars = axes.bar(names, rates, color="tab:green")
    labels = ["–" if s is None else f"{s:.2f}×" for s in table["speedup"].to_list()]
    axes.bar_label(bars, labels=labels)
    _label(axes, "runs side by side", "run", "tokens / s (wall)")
    return _save(figure, path, empty=table.height == 0)


def _figure() -> tuple[Figure, object]:
    figure = Figure(figsize=(7, 4), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    return figure, figure.add_subplot()


def _label(axes, title: str, xlabel: str, ylabel: str) -> None:
    axes.set_title(title)
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.grid(alpha=0.3)


def _save(figure: Figure, path: Path, empty: bool) -> Path:
    if empty:
        figure.axes[0].text(0.5, 0.5, "no rows", ha="center", va="center", transform=figure.axes[0].transAxes)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png")
    return path
