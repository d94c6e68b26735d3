"""How the draft ran: static (draft@n) vs dynamic draft share, context drained.

A cycle's ``mode`` says which draft graph served it: ``static`` (draft@n,
the fast path, each owner ≤ B new context rows) or ``dynamic`` (the
dynamic-shape draft that drains long contexts, e.g. right after a prompt),
or ``target`` (no draft: plain decode). A high dynamic share means the
runtime spends its time draining context instead of speculating.
"""

from __future__ import annotations

import polars as pl


def mode_share(cycles: pl.LazyFrame) -> pl.LazyFrame:
    """Rows, calls, context rows and tokens per mode, with shares.

    | column | dtype | meaning |
    | --- | --- | --- |
    | mode | String | static / dynamic / target |
    | rows | UInt32 | owner rows |
    | calls | UInt32 | distinct cycle_id |
    | context_rows | Int64 | Σ context rows the draft consumed (drained) |
    | emitted | Int64 | Σ tokens produced |
    | row_share | Float64 | rows / all rows |
    | call_share | Float64 | calls / all calls |
    """
    return (
        cycles.group_by("mode")
        .agg(
            pl.len().alias("rows"),
            pl.col("cycle_id").n_unique().cast(pl.UInt32).alias("calls"),
            pl.col("context_rows").cast(pl.Int64).sum(),
            pl.col("emitted").cast(pl.Int64).sum(),
        )
        .with_columns(
            (pl.col("rows") / pl.col("rows").sum()).alias("row_share"),
            (pl.col("calls") / pl.col("calls").sum()).alias("call_share"),
        )
        .sort("mode")
    )
