"""The report: every analysis of a run collected in one pass, then Markdown, CSV, PNG, JSON.

``summarize`` builds the lazy queries of the other modules and collects
them together (``pl.collect_all``, queries in parallel, each streaming its
own scan), and the result is a set of small DataFrames (``Summary``).
``write_report`` turns a Summary into files; ``headline`` is the one-line
JSON the ``report`` command prints last.

Files written to the output folder:

| file | content |
| --- | --- |
| summary.md | the Markdown report (also printed) |
| headline.json | ``headline(summary)`` |
| acceptance_histogram.png, position_acceptance.png, rolling_tau.png, latency.png | plots |
| comparison.png | only with a baseline or compared runs |
| <table>.csv | each table of the Summary, in full (e.g. τ of every session) |
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path

import polars as pl

from dflash_trt.analysis import acceptance, compare, counters, drafting, plots, throughput
from dflash_trt.analysis.load import Run
from dflash_trt.runtime.stats import STATIC, TARGET

MAX_PLOT_POINTS = 2000  # rolling τ is thinned to this many calls before plotting


@dataclass(frozen=True)
class Summary:
    """Collected analysis tables of one run (each a small DataFrame).

    | field | from |
    | --- | --- |
    | overview | ``compare.run_summary`` (one row) |
    | tau_by_session, tau_by_owners | ``acceptance.tau_by`` |
    | histogram, positions | ``acceptance.histogram``, ``acceptance.position_acceptance`` |
    | rolling_tau | ``acceptance.rolling_tau``, thinned to ≤ MAX_PLOT_POINTS rows |
    | latency, latency_by_owners | ``throughput.latency_breakdown``, ``throughput.latency_by`` |
    | modes | ``drafting.mode_share`` |
    | policy | ``drafting.policy_choices`` |
    | verify_lengths | ``drafting.verify_lengths`` |
    | counters, cross_check | ``counters.*``; None without an executes table |
    | comparison | ``compare.compare``; None without baseline or compared runs |
    """

    name: str
    window: int
    has_baseline: bool
    overview: pl.DataFrame
    tau_by_session: pl.DataFrame
    tau_by_owners: pl.DataFrame
    histogram: pl.DataFrame
    positions: pl.DataFrame
    rolling_tau: pl.DataFrame
    latency: pl.DataFrame
    latency_by_owners: pl.DataFrame
    modes: pl.DataFrame
    policy: pl.DataFrame
    verify_lengths: pl.DataFrame
    counters: pl.DataFrame | None = None
    cross_check: pl.DataFrame | None = None
    comparison: pl.DataFrame | None = None


def summarize(run: Run, baseline: Run | None = None, others: Sequence[Run] = (), window: int = 64) -> Summary:
    """Collect every table of the report for ``run`` in one ``collect_all``."""
    cycles = run.cycles
    queries = {
        "overview": compare.run_summary(run),
        "tau_by_session": acceptance.tau_by(cycles, "session"),
        "tau_by_owners": acceptance.tau_by(cycles, "owners"),
        "histogram": acceptance.histogram(cycles),
        "positions": acceptance.position_acceptance(cycles),
        "rolling_tau": _thin(acceptance.rolling_tau(cycles, window), MAX_PLOT_POINTS),
        "latency": throughput.latency_breakdown(cycles),
        "latency_by_owners": throughput.latency_by(cycles, "owners"),
        "modes": drafting.mode_share(cycles),
        "policy": drafting.policy_choices(cycles),
        "verify_lengths": drafting.verify_lengths(cycles),
    }
    if run.executes is not None:
        queries["counters"] = counters.execute_totals(run.executes)
        queries["cross_check"] = counters.cross_check(cycles, run.executes)
    if baseline is not None:
        queries["baseline"] = compare.run_summary(baseline)
    queries |= {f"other {index}": compare.run_summary(other) for index, other in enumerate(others)}
    # Common-subplan elimination would cache the shared Parquet scan, i.e.
    # materialize every column any query reads (~1 GB at 10 M rows); without
    # it each query streams its own scan (~4x less peak memory, ~1.4x the time).
    flags = pl.QueryOptFlags(comm_subplan_elim=False)
    frames = dict(zip(queries, pl.collect_all(queries.values(), optimizations=flags), strict=True))
    # A window longer than the run is the run: say so in the plot (rolling sums start at the first call).
    window = min(window, int(frames["rolling_tau"]["calls"].max() or 1))
    # Side by side from the collected rows: the main run is not summarized twice.
    rows = [frames.pop("baseline")] if baseline is not None else []
    rows += [frames["overview"], *(frames.pop(f"other {index}") for index in range(len(others)))]
    if len(rows) > 1:
        frames["comparison"] = compare.with_speedups(pl.concat(rows, how="vertical"))
    return Summary(name=run.name, window=window, has_baseline=baseline is not None, **frames)


def _thin(frame: pl.LazyFrame, max_points: int) -> pl.LazyFrame:
    """Every n-th row, and the last, so at most ~max_points remain (a plot cannot show more)."""
    step = pl.len() // max_points + 1
    index = pl.int_range(pl.len())
    return frame.filter((index % step == 0) | (index == pl.len() - 1))


def headline(summary: Summary) -> dict:
    """The headline figures as a JSON-ready dict (NaN and inf become None).

    Keys: name, rows, calls, cycles, tokens, tau, tokens_per_s,
    tokens_per_device_s, wall_s, device_s, static_share (of speculative
    rows), context_rows; with a baseline: speedup, device_speedup,
    baseline_tokens_per_s; with an executes table: executes, failed,
    counters_match. Floats are rounded (``ROUNDING``).
    """
    figures = summary.overview.row(0, named=True)
    speculative = summary.modes.filter(pl.col("mode") != TARGET)
    static_rows = speculative.filter(pl.col("mode") == STATIC)["rows"].sum()
    figures["static_share"] = static_rows / speculative["rows"].sum() if speculative.height else None
    figures["context_rows"] = summary.modes["context_rows"].sum()
    if summary.has_baseline:
        reference, this = summary.comparison.row(0, named=True), summary.comparison.row(1, named=True)
        figures["speedup"] = this["speedup"]
        figures["device_speedup"] = this["device_speedup"]
        figures["baseline_tokens_per_s"] = reference["tokens_per_s"]
    if summary.counters is not None:
        figures["executes"] = summary.counters["executes"][0]
        figures["failed"] = summary.counters["failed"][0]
        figures["counters_match"] = bool(summary.cross_check["match"].fill_null(False).all())
    return {key: _json_safe(key, value) for key, value in figures.items()}


# Decimals per headline figure (the console summaries of run / bench / demo round alike); others: 3.
ROUNDING = {"tokens_per_s": 2, "tokens_per_device_s": 2, "baseline_tokens_per_s": 2}


def _json_safe(key: str, value):
    if isinstance(value, float):
        return round(value, ROUNDING.get(key, 3)) if math.isfinite(value) else None
    return value


def write_report(summary: Summary, out_dir: Path) -> dict[str, Path]:
    """Write plots, CSV tables, summary.md and headline.json; return them by name."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = _write_plots(summary, out_dir)
    for field in fields(Summary):
        table = getattr(summary, field.name)
        if isinstance(table, pl.DataFrame):
            files[f"{field.name}.csv"] = out_dir / f"{field.name}.csv"
            table.write_csv(files[f"{field.name}.csv"])
    files["summary.md"] = out_dir / "summary.md"
    files["summary.md"].write_text(markdown(summary, files))
    files["headline.json"] = out_dir / "headline.json"
    files["headline.json"].write_text(json.dumps(headline(summary), indent=2) + "\n")
    return files


def _write_plots(summary: Summary, out_dir: Path) -> dict[str, Path]:
    name = summary.name
    files = {
        "acceptance_histogram.png": plots.plot_histogram(summary.histogram, out_dir / "acceptance_histogram.png", name),
        "position_acceptance.png": plots.plot_positions(summary.positions, out_dir / "position_acceptance.png", name),
        "rolling_tau.png": plots.plot_rolling_tau(
            summary.rolling_tau, out_dir / "rolling_tau.png", name, summary.window
        ),
        "latency.png": plots.plot_latency(summary.latency_by_owners, out_dir / "latency.png", name),
    }
    if summary.comparison is not None:
        files["comparison.png"] = plots.plot_comparison(summary.comparison, out_dir / "comparison.png")
    return files


def markdown(summary: Summary, files: dict[str, Path] | None = None) -> str:
    """The Markdown report: headline, then one section per table, then the plots."""
    sections = [f"# dflash-trt report: {summary.name}", _figures_table(headline(summary))]
    sections += _section("Acceptance (speculative cycles; τ = mean tokens per owner-cycle, bonus included)",
                         summary.histogram)
    sections += _section("Per-position acceptance", summary.positions)
    sections += _section("τ by owners per call", summary.tau_by_owners)
    sections += _section("τ across sessions", _session_spread(summary.tau_by_session))
    sections += _section("Latency by phase (each call once)", summary.latency)
    if _loop_cycles_only(summary):
        sections.append(DRAFT_MS_NOTE)
    sections += _section("Latency per call by owners (mean ms)", summary.latency_by_owners)
    sections += _section("Draft modes", summary.modes)
    sections += _section("Speculation policy (why each row's launch was a cycle or a plain decode step)", summary.policy)
    sections += _section("Cycles by verify length (what each length yielded per owner-cycle and cost the device)", summary.verify_lengths)
    if summary.counters is not None:
        sections += ["## Execute counters (totals)", _figures_table(summary.counters.row(0, named=True))]
        sections += _section("Cross-check: cycles table vs counters", summary.cross_check)
    if summary.comparison is not None:
        reference = "baseline" if summary.has_baseline else "first run"
        sections += _section(f"Runs side by side (speedup vs the {reference})", summary.comparison)
    if files:
        sections.append("## Plots\n\n" + "\n".join(
            f"![{name}]({path.name})" for name, path in files.items() if name.endswith(".png")))
    return "\n\n".join(sections) + "\n"


DRAFT_MS_NOTE = (
    "draft_ms is 0: the device loop runs a cycle's draft, verify and verdict as one program and times "
    "them as one unit (verify_ms), on every backend; the draft alone is timed only outside the loop."
)


def _loop_cycles_only(summary: Summary) -> bool:
    """Speculative calls ran, and none timed its draft apart."""
    draft = dict(zip(summary.latency["phase"], summary.latency["total_ms"])).get("draft_ms")
    speculative = summary.modes.filter(pl.col("mode") != TARGET)["rows"].sum()
    return bool(speculative) and draft == 0


def _section(title: str, table: pl.DataFrame) -> list[str]:
    return [f"## {title}", _markdown_table(table)]


def _figures_table(figures: dict) -> str:
    """A name → value table; values as text, so integers stay integers beside floats."""
    values = [str(_json_safe(name, value)) for name, value in figures.items()]
    table = pl.DataFrame({"figure": list(figures), "value": values})
    return _markdown_table(table)


def _session_spread(tau_by_session: pl.DataFrame) -> pl.DataFrame:
    """Distribution of per-session τ (the full table is tau_by_session.csv)."""
    tau = pl.col("tau")
    return tau_by_session.select(
        pl.len().alias("sessions"),
        tau.min().alias("min"),
        tau.quantile(0.1).alias("p10"),
        tau.median().alias("median"),
        tau.quantile(0.9).alias("p90"),
        tau.max().alias("max"),
    )


def _markdown_table(table: pl.DataFrame) -> str:
    with pl.Config(
        tbl_formatting="MARKDOWN",
        tbl_hide_column_data_types=True,
        tbl_hide_dataframe_shape=True,
        tbl_rows=-1,
        tbl_cols=-1,
        tbl_width_chars=10_000,
        fmt_str_lengths=200,
        float_precision=4,
    ):
        return str(table)
