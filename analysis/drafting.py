"""How the draft ran: static (draft@n) vs dynamic draft share, context drained.

A cycle's ``mode`` says which draft graph served it: ``static`` (draft@n,
the fast path, each owner ≤ B new context rows) or ``dynamic`` (the
dynamic-shape draft that drains long contexts, e.g. right after a prompt),
or ``target`` (no draft: plain decode). A high dynamic share means the
runtime spends its time draining context instead of speculating.

A row's ``policy`` says why its launch was a cycle or a plain decode step
(``runtime.policy``): ``policy_choices`` counts them. A cycle's ``proposed``
is its verify length k (the policy's choice among the export's lengths):
``verify_lengths`` shows what each length yielded and cost the device.
"""

from __future__ import annotations

import polars as pl

from dflash_trt.analysis.acceptance import LENGTH, speculative
from dflash_trt.analysis.throughput import calls, ratio


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
    per_mode = cycles.group_by("mode").agg(
        pl.len().alias("rows"),
        pl.col("context_rows").cast(pl.Int64).sum(),
        pl.col("emitted").cast(pl.Int64).sum(),
    )
    # Counting calls from throughput.calls, not n_unique per mode: that
    # group-by streams when cycle_id is sorted, a distinct-count never does.
    calls_per_mode = calls(cycles).group_by("mode").agg(pl.len().alias("calls"))
    return (
        per_mode.join(calls_per_mode, on="mode", how="left")
        .select("mode", "rows", "calls", "context_rows", "emitted")
        .with_columns(
            (pl.col("rows") / pl.col("rows").sum()).alias("row_share"),
            (pl.col("calls") / pl.col("calls").sum()).alias("call_share"),
        )
        .sort("mode")
    )


def policy_choices(cycles: pl.LazyFrame) -> pl.LazyFrame:
    """Rows and tokens per (policy reason, mode), with the policy's mean estimated ratio.

    | column | dtype | meaning |
    | --- | --- | --- |
    | policy | String | estimate / explore / probe / drain / switch / fixed (``runtime.stats``) |
    | mode | String | static / dynamic / target |
    | rows | UInt32 | owner rows |
    | emitted | Int64 | Σ tokens produced |
    | mean_ratio | Float64 | mean estimated ratio at the choices: cycle rounds' tokens/s over decode rounds' (null where not estimated) |
    | row_share | Float64 | rows / all rows |
    """
    return (
        cycles.group_by("policy", "mode")
        .agg(pl.len().alias("rows"), pl.col("emitted").cast(pl.Int64).sum(), pl.col("policy_ratio").fill_nan(None).mean().alias("mean_ratio"))
        .with_columns((pl.col("rows") / pl.col("rows").sum()).alias("row_share"))
        .sort("policy", "mode")
    )


def verify_lengths(cycles: pl.LazyFrame) -> pl.LazyFrame:
    """Speculative cycles per verify length k: what they yielded and what they cost the device.

    Time is per call (a round's device time once, not per owner row: ``throughput.calls``), owners are the
    call's packed owners (finished lanes' discarded rows included: the device ran them too). A shorter verify
    costs fewer target rows per owner, for fewer tokens per owner-cycle: the two columns the policy trades.

    | column | dtype | meaning |
    | --- | --- | --- |
    | proposed | Int32 | verify length k |
    | calls | UInt32 | cycle calls (rounds) of that length |
    | rows | UInt32 | owner-cycles |
    | tau | Float64 | mean accepted + 1 per owner-cycle |
    | owners_per_call | Float64 | mean packed owners per call |
    | device_ms_per_call | Float64 | mean draft_ms + verify_ms per call |
    | device_us_per_owner | Float64 | Σ device ms / Σ packed owners, in µs: one owner's cycle |
    | tokens_per_device_ms | Float64 | Σ emitted / Σ device ms (null where no time was logged) |
    """
    per_call = calls(speculative(cycles), pl.col("proposed").first(), LENGTH.sum().alias("length")).with_columns(
        (pl.col("draft_ms") + pl.col("verify_ms")).alias("device_ms"),
    )
    device_ms, owners = pl.col("device_ms").sum(), pl.col("owners").cast(pl.Int64).sum()
    return (
        per_call.group_by("proposed")
        .agg(
            pl.len().alias("calls"),
            pl.col("rows").sum(),
            (pl.col("length").sum() / pl.col("rows").sum()).alias("tau"),
            owners.truediv(pl.len()).alias("owners_per_call"),
            pl.col("device_ms").mean().alias("device_ms_per_call"),
            ratio(1000.0 * device_ms, owners).alias("device_us_per_owner"),
            ratio(pl.col("emitted").sum(), device_ms).alias("tokens_per_device_ms"),
        )
        .sort("proposed")
    )
