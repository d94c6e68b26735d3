"""Runs side by side, and the speedup against a baseline.

Speedup is the ratio of wall tokens per second (``throughput.throughput``)
of a run to its baseline, usually an autoregressive run of the same target
(all ``mode == "target"`` rows), though any stats file works. The device
speedup uses tokens per device second instead, which leaves host overhead
out.
"""

from __future__ import annotations

from collections.abc import Sequence

import polars as pl

from dflash_trt.analysis.acceptance import tau
from dflash_trt.analysis.load import Run
from dflash_trt.analysis.throughput import throughput


def run_summary(run: Run) -> pl.LazyFrame:
    """One row of headline figures for a run.

    | column | dtype | meaning |
    | --- | --- | --- |
    | name | String | the run's label |
    | rows, calls, emitted, wall_s, tokens_per_s, device_s, tokens_per_device_s | | from ``throughput`` |
    | cycles | UInt32 | speculative owner-cycles (τ's denominator) |
    | tau | Float64 | τ over speculative rows (null for an autoregressive run) |
    """
    acceptance = tau(run.cycles).rename({"rows": "cycles"})
    return pl.concat([throughput(run.cycles), acceptance], how="horizontal").select(
        pl.lit(run.name).alias("name"), pl.all()
    )


def compare(runs: Sequence[Run], baseline: Run | None = None) -> pl.LazyFrame:
    """``run_summary`` of each run (baseline first, when given) with speedups.

    The reference is the baseline, or the first run when there is none.

    | column | dtype | meaning |
    | --- | --- | --- |
    | ... | | ``run_summary`` columns |
    | speedup | Float64 | tokens_per_s / the reference's |
    | device_speedup | Float64 | tokens_per_device_s / the reference's |
    """
    assert runs, "compare needs at least one run"
    ordered = ([baseline] if baseline is not None else []) + list(runs)
    table = pl.concat([run_summary(run) for run in ordered], how="vertical")
    reference = pl.col("tokens_per_s").first()
    device_reference = pl.col("tokens_per_device_s").first()
    return table.with_columns(
        _ratio(pl.col("tokens_per_s"), reference).alias("speedup"),
        _ratio(pl.col("tokens_per_device_s"), device_reference).alias("device_speedup"),
    )


def _ratio(value: pl.Expr, reference: pl.Expr) -> pl.Expr:
    """value / reference, null when the reference is null or 0."""
    return pl.when(reference > 0).then(value / reference)
