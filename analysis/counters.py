"""The per-execute table (``EXECUTE_SCHEMA``): totals and a cross-check.

Each row holds one ``execute()`` call's counter deltas (docs/design.md
§8), so totals are column sums. The runtime counts
proposals, acceptances and cycles twice, once per owner row in the cycles
table and once in these counters; ``cross_check`` compares them, so a
logging bug (a dropped or duplicated row) shows up in the report instead of
silently skewing τ.
"""

from __future__ import annotations

import polars as pl

from dflash_trt.analysis.acceptance import speculative
from dflash_trt.runtime.stats import COUNTERS


def execute_totals(executes: pl.LazyFrame) -> pl.LazyFrame:
    """One row: call counts, failures, timing and every counter summed.

    | column | dtype | meaning |
    | --- | --- | --- |
    | executes | UInt32 | execute() calls |
    | failed | UInt32 | calls with ok == false |
    | pending_decode_executes | UInt32 | calls that skipped the target step |
    | inputs | Int64 | Σ inputs |
    | target_tokens | Int64 | Σ tokens run through the target outside verify |
    | wall_ms | Float64 | Σ wall time inside execute() |
    | <counter> | Int64 | Σ of each ``COUNTERS`` field |
    """
    return executes.select(
        pl.len().alias("executes"),
        (~pl.col("ok")).sum().cast(pl.UInt32).alias("failed"),
        pl.col("pending_decode").sum().cast(pl.UInt32).alias("pending_decode_executes"),
        pl.col("inputs").cast(pl.Int64).sum(),
        pl.col("target_tokens").sum(),
        pl.col("wall_ms").sum(),
        *(pl.col(name).sum() for name in COUNTERS),
    )


def cross_check(cycles: pl.LazyFrame, executes: pl.LazyFrame) -> pl.LazyFrame:
    """Speculative totals from both tables, side by side.

    | column | dtype | meaning |
    | --- | --- | --- |
    | quantity | String | cycles / proposed / accepted / bonuses |
    | cycles_table | Int64 | from the cycles table (speculative rows) |
    | executes_table | Int64 | from the counters |
    | match | Boolean | equal |
    """
    spec = speculative(cycles)
    from_cycles = spec.select(
        pl.len().cast(pl.Int64).alias("cycles"),
        pl.col("proposed").cast(pl.Int64).sum(),
        pl.col("accepted").cast(pl.Int64).sum(),
        pl.col("bonus").cast(pl.Int64).sum().alias("bonuses"),
    ).unpivot(variable_name="quantity", value_name="cycles_table")
    from_counters = executes.select(
        *(pl.col(name).sum() for name in ("cycles", "proposed", "accepted", "bonuses"))
    ).unpivot(variable_name="quantity", value_name="executes_table")
    return from_cycles.join(from_counters, on="quantity", how="left", maintain_order="left").with_columns(
        (pl.col("cycles_table") == pl.col("executes_table")).alias("match")
    )
