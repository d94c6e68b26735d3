"""Throughput and latency: tokens per second, device time, time per phase.

``draft_ms``, ``verify_ms`` and ``host_ms`` are measured once per
draft/verify call (the device loop times a whole cycle, draft included, as
``verify_ms``: ``draft_ms`` is 0 there on every backend) and repeated on every owner row of that call, so anything
that sums time first collapses the rows to one per ``cycle_id`` (``calls``);
summing owner rows would count a 4-owner call four times. Token counts
(``emitted``) are per owner and are summed over rows as they are.

Every mode counts here, ``target`` (plain decode) included: throughput is
what the user sees, whatever produced the tokens.
"""

from __future__ import annotations

import polars as pl

from dflash_trt.runtime.stats import DYNAMIC

PHASES = ("draft_ms", "verify_ms", "host_ms")


def calls(cycles: pl.LazyFrame, *extra: pl.Expr) -> pl.LazyFrame:
    """One row per device call (cycle_id): shared columns once, tokens summed over owners; ``extra``: more
    per-call aggregations (e.g. ``pl.col("proposed").first()``), as columns after these.

    The one group-by over every row keyed by call. With ``cycle_id`` flagged
    sorted (``load.in_call_order``) Polars streams it in constant memory;
    otherwise it holds a hash table with one entry per call.

    | column | dtype | meaning |
    | --- | --- | --- |
    | cycle_id | Int64 | the call |
    | mode | String | static / dynamic / target: the draft graph the call ran |
    | owners | Int32 | owners packed into the call |
    | rows | UInt32 | owner rows seen for the call |
    | emitted | Int64 | tokens the call produced, all owners |
    | draft_ms, verify_ms, host_ms | Float64 | the call's phase times (once) |
    """
    # ``mode`` is per owner: one owner still draining its context makes the
    # whole call run the dynamic draft, while its co-owners log ``static``.
    any_dynamic = (pl.col("mode") == DYNAMIC).any()
    return cycles.group_by("cycle_id").agg(
        pl.when(any_dynamic).then(pl.lit(DYNAMIC)).otherwise(pl.col("mode").first()).alias("mode"),
        pl.col("owners").first(),
        pl.len().alias("rows"),
        pl.col("emitted").cast(pl.Int64).sum(),
        *(pl.col(phase).first() for phase in PHASES),
        *extra,
    )


def throughput(cycles: pl.LazyFrame, executes: pl.LazyFrame | None = None) -> pl.LazyFrame:
    """Tokens per wall second and per device second, one row.

    Tokens are what callers received (Σ ``emitted``, every mode). The wall
    span is the run's: from the start of its first ``execute()`` to the end of
    its last (the executes table's ``end_ms - wall_ms`` and ``end_ms``), the
    same span ``dflash-trt run`` / ``bench`` / ``demo`` print. Without an
    executes table only cycle ends are known: the span runs from the first
    cycle end to the last, and the first call's tokens (produced before the
    span began) are left out, so 2 calls of 4 tokens 10 ms apart are 400
    tokens/s, not 800. Device rate: all tokens over the de-duplicated
    draft + verify time.

    | column | dtype | meaning |
    | --- | --- | --- |
    | rows | UInt32 | owner rows, every mode |
    | calls | UInt32 | distinct cycle_id |
    | tokens | Int64 | tokens callers received (Σ emitted) |
    | wall_s | Float64 | the run's span in seconds (see above) |
    | tokens_per_s | Float64 | tokens in the span / wall_s (null if wall_s == 0) |
    | device_s | Float64 | Σ over calls of draft_ms + verify_ms, in seconds |
    | tokens_per_device_s | Float64 | tokens / device_s (null if device_s == 0) |
    """
    tokens = pl.col("emitted").cast(pl.Int64).sum()
    if executes is None:
        first_end = pl.col("end_ms").min()
        wall_s = (pl.col("end_ms").max() - first_end) / 1000
        in_span = pl.col("emitted").cast(pl.Int64).filter(pl.col("end_ms") > first_end).sum()
        wall = cycles.select(pl.len().alias("rows"), tokens.alias("tokens"), wall_s.alias("wall_s"),
                             ratio(in_span, wall_s).alias("tokens_per_s"))
    else:
        counts = cycles.select(pl.len().alias("rows"), tokens.alias("tokens"))
        span = executes.select(((pl.col("end_ms").max() - (pl.col("end_ms") - pl.col("wall_ms")).min()) / 1000).alias("wall_s"))
        wall = pl.concat([counts, span], how="horizontal").with_columns(
            ratio(pl.col("tokens"), pl.col("wall_s")).alias("tokens_per_s"))
    device = calls(cycles).select(
        pl.len().alias("calls"),
        ((pl.col("draft_ms") + pl.col("verify_ms")).sum() / 1000).alias("device_s"),
    )
    return pl.concat([wall, device], how="horizontal").select(
        "rows",
        "calls",
        "tokens",
        "wall_s",
        "tokens_per_s",
        "device_s",
        ratio(pl.col("tokens"), pl.col("device_s")).alias("tokens_per_device_s"),
    )


def latency_breakdown(cycles: pl.LazyFrame) -> pl.LazyFrame:
    """Time per phase over all calls (each call counted once).

    | column | dtype | meaning |
    | --- | --- | --- |
    | phase | String | draft_ms / verify_ms / host_ms |
    | total_ms | Float64 | Σ over calls |
    | mean_ms | Float64 | per call |
    | share | Float64 | total_ms / Σ of the three phases |
    """
    per_call = calls(cycles)
    totals = per_call.select(*(pl.col(phase).sum() for phase in PHASES)).unpivot(
        variable_name="phase", value_name="total_ms"
    )
    count = per_call.select(pl.len().alias("calls"))
    return totals.join(count, how="cross").select(
        "phase",
        "total_ms",
        ratio(pl.col("total_ms"), pl.col("calls")).alias("mean_ms"),
        ratio(pl.col("total_ms"), pl.col("total_ms").sum()).alias("share"),
    )


def latency_by(cycles: pl.LazyFrame, key: str = "owners") -> pl.LazyFrame:
    """Mean time per call for each phase, per value of a call-level key (``owners``, ``mode``).

    | column | dtype | meaning |
    | --- | --- | --- |
    | <key> | key's dtype | group |
    | calls | UInt32 | calls in the group |
    | draft_ms, verify_ms, host_ms | Float64 | mean per call |
    | tokens_per_call | Float64 | mean tokens emitted per call, all owners |
    """
    return (
        calls(cycles)
        .group_by(key)
        .agg(
            pl.len().alias("calls"),
            *(pl.col(phase).mean() for phase in PHASES),
            pl.col("emitted").mean().alias("tokens_per_call"),
        )
        .sort(key)
    )


def ratio(numerator: pl.Expr, denominator: pl.Expr) -> pl.Expr:
    """numerator / denominator, null (not inf or NaN) when the denominator is 0 or null."""
    return pl.when(denominator > 0).then(numerator / denominator)
