"""Runs side by side, and the speedup against a baseline.

Speedup is the ratio of wall tokens per second (``throughput.throughput``:
tokens callers received over the run's span) of a run to its baseline,
usually a plain-decoding run of the same target (all ``mode == "target"``
rows), though any stats file works. ``dflash-trt run``, ``bench`` and
``demo`` print these same figures (``run_summary`` of their in-memory stats). The device
speedup uses tokens per device second instead, which leaves host overhead
out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import polars as pl

from dflash_trt.analysis.acceptance import tau
from dflash_trt.analysis.load import Run
from dflash_trt.analysis.throughput import ratio, throughput

FrameT = TypeVar("FrameT", pl.DataFrame, pl.LazyFrame)


def run_summary(run: Run) -> pl.LazyFrame:
    """One row of headline figures for a run.

    | column | dtype | meaning |
    | --- | --- | --- |
    | name | String | the run's label |
    | rows, calls, tokens, wall_s, tokens_per_s, device_s, tokens_per_device_s | | from ``throughput`` |
    | cycles | UInt32 | speculative owner-cycles (τ's denominator) |
    | tau | Float64 | τ over speculative rows (null for an autoregressive run) |
    """
    acceptance = tau(run.cycles).rename({"rows": "cycles"})
    return pl.concat([throughput(run.cycles, run.executes), acceptance], how="horizontal").select(
        pl.lit(run.name).alias("name"), pl.all()
    )


def compare(runs: Sequence[Run], baseline: Run | None = None) -> pl.LazyFrame:
    """``run_summary`` of each run (baseline first, when given) with ``with_speedups``."""
    assert runs, "compare needs at least one run"
    ordered = ([baseline] if baseline is not None else []) + list(runs)
    return with_speedups(pl.concat([run_summary(run) for run in ordered], how="vertical"))


def with_speedups(table: FrameT) -> FrameT:
    """Add speedups of each ``run_summary`` row against the FIRST row (the reference).

    Works on a LazyFrame or on already-collected rows (``report.summarize``
    collects each run once and compares the small results).

    | column | dtype | meaning |
    | --- | --- | --- |
    | ... | | ``run_summary`` columns |
    | speedup | Float64 | tokens_per_s / the reference's |
    | device_speedup | Float64 | tokens_per_device_s / the reference's |
    """
    return table.with_columns(
        ratio(pl.col("tokens_per_s"), pl.col("tokens_per_s").first()).alias("speedup"),
        ratio(pl.col("tokens_per_device_s"), pl.col("tokens_per_device_s").first()).alias("device_speedup"),
    )
