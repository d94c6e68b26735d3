"""Acceptance: τ, the acceptance-length histogram, per-position acceptance.

τ is defined once, in ``runtime/stats.py``: the mean of ``accepted + 1``
(accepted proposals + 1, the correction or bonus token included) over cycle
rows. (``emitted`` is what the caller received: the last cycle of a request
may be cut at its room or a stop token, and still counts its whole length in τ,
as the reference decoder's τ does.) Only speculative rows count: ``mode == "target"`` rows are plain
decode steps with nothing proposed, and would pull τ towards 1. They still
count in throughput (``throughput.py``).

Every function takes the cycles LazyFrame (``CYCLE_SCHEMA``) and returns a
LazyFrame; nothing collects here. The heavy ones reduce the rows to the
small ``acceptance_counts`` table first, so a 10-million-row log is one
group-by, not a per-position pass.
"""

from __future__ import annotations

import polars as pl

from dflash_trt.runtime.stats import TARGET

LENGTH = pl.col("accepted").cast(pl.Int64) + 1  # a cycle's acceptance length (runtime/stats.py TAU_LENGTH)
TAU = LENGTH.mean().alias("tau")  # the definition in runtime/stats.py


def speculative(cycles: pl.LazyFrame) -> pl.LazyFrame:
    """Rows that ran a draft and a verify (``static`` or ``dynamic`` mode)."""
    return cycles.filter(pl.col("mode") != TARGET)


def tau(cycles: pl.LazyFrame) -> pl.LazyFrame:
    """Overall τ.

    | column | dtype | meaning |
    | --- | --- | --- |
    | rows | UInt32 | speculative owner-cycles |
    | tau | Float64 | mean accepted + 1 per owner-cycle (null when rows == 0) |
    """
    return speculative(cycles).select(pl.len().alias("rows"), TAU)


def tau_by(cycles: pl.LazyFrame, key: str) -> pl.LazyFrame:
    """τ per value of ``key`` (``session``, ``owners``, ``mode``...), sorted by key.

    | column | dtype | meaning |
    | --- | --- | --- |
    | <key> | key's dtype | group |
    | rows | UInt32 | speculative owner-cycles in the group |
    | tau | Float64 | mean accepted + 1 in the group |
    """
    return speculative(cycles).group_by(key).agg(pl.len().alias("rows"), TAU).sort(key)


def rolling_tau(cycles: pl.LazyFrame, window: int) -> pl.LazyFrame:
    """τ over the last ``window`` draft/verify calls, one row per call (cycle_id order).

    A call packs several owners, so the window pools their rows:
    Σ (accepted + 1) / Σ owner-rows over the calls in the window (not a mean
    of per-call means, which would overweight lightly packed calls). The first
    window-1 calls use the calls seen so far.

    | column | dtype | meaning |
    | --- | --- | --- |
    | cycle_id | Int64 | the window's last call |
    | calls | UInt32 | speculative calls up to this one (the window is min(window, calls)) |
    | tau | Float64 | pooled τ over the window |
    """
    assert window >= 1, window
    per_call = (
        speculative(cycles)
        .group_by("cycle_id")
        .agg(LENGTH.sum().alias("length"), pl.len().alias("rows"))
        .sort("cycle_id")
    )
    pooled = pl.col("length").rolling_sum(window, min_samples=1) / pl.col("rows").rolling_sum(window, min_samples=1)
    calls = pl.int_range(1, pl.len() + 1, dtype=pl.UInt32).alias("calls")
    return per_call.select("cycle_id", calls, pooled.alias("tau"))


def acceptance_counts(cycles: pl.LazyFrame) -> pl.LazyFrame:
    """Speculative rows counted by (proposed, accepted): the small table the rest derive from.

    | column | dtype | meaning |
    | --- | --- | --- |
    | proposed | Int32 | proposals verified |
    | accepted | Int32 | proposals accepted |
    | rows | UInt32 | owner-cycles with that pair |
    """
    return speculative(cycles).group_by("proposed", "accepted").agg(pl.len().alias("rows"))


def histogram(cycles: pl.LazyFrame) -> pl.LazyFrame:
    """Acceptance-length histogram, every length 1..max(proposed)+1 present (zeros too).

    | column | dtype | meaning |
    | --- | --- | --- |
    | length | Int32 | tokens emitted by the cycle (accepted + 1) |
    | rows | UInt32 | owner-cycles of that length |
    | share | Float64 | rows / all speculative rows |
    """
    counts = acceptance_counts(cycles)
    lengths = counts.select(_range_to(pl.col("proposed").max() + 1).alias("length"))
    by_length = counts.group_by((pl.col("accepted") + 1).alias("length")).agg(pl.col("rows").sum())
    return (
        lengths.join(by_length, on="length", how="left")
        .with_columns(pl.col("rows").fill_null(0).cast(pl.UInt32))
        .with_columns((pl.col("rows") / pl.col("rows").sum()).alias("share"))
        .sort("length")
    )


def position_acceptance(cycles: pl.LazyFrame) -> pl.LazyFrame:
    """Per-position acceptance for k = 1..max(proposed).

    ``rate`` is P(accepted ≥ k) over all speculative owner-cycles (vLLM's
    per-position acceptance rate); summed over k it equals τ - 1.
    ``rate_when_proposed`` conditions on the position having been proposed
    (proposed ≥ k), which differs when the proposal count varies per cycle.

    | column | dtype | meaning |
    | --- | --- | --- |
    | k | Int32 | draft position (1 = first proposal) |
    | reached | UInt32 | owner-cycles with accepted ≥ k |
    | proposed_rows | UInt32 | owner-cycles with proposed ≥ k |
    | rate | Float64 | reached / all speculative owner-cycles |
    | rate_when_proposed | Float64 | reached / proposed_rows |
    """
    counts = acceptance_counts(cycles)
    ks = counts.select(_range_to(pl.col("proposed").max()).alias("k"))
    rows = pl.col("rows")
    return (
        ks.join(counts, how="cross")
        .group_by("k")
        .agg(
            rows.filter(pl.col("accepted") >= pl.col("k")).sum().alias("reached"),
            rows.filter(pl.col("proposed") >= pl.col("k")).sum().alias("proposed_rows"),
            rows.sum().alias("total"),
        )
        .select(
            "k",
            "reached",
            "proposed_rows",
            (pl.col("reached") / pl.col("total")).alias("rate"),
            (pl.col("reached") / pl.col("proposed_rows")).alias("rate_when_proposed"),
        )
        .sort("k")
    )


def _range_to(last: pl.Expr) -> pl.Expr:
    """1..last inclusive as Int32; empty when there are no rows (last is null)."""
    return pl.int_range(1, last.fill_null(0) + 1, dtype=pl.Int32)
