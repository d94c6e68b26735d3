"""The analysis math on small literal stats frames, answers computed by hand."""

from __future__ import annotations

import math

import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_trt.analysis import acceptance, counters, drafting, throughput
from dflash_trt.analysis.compare import compare
from dflash_trt.analysis.load import Run
from dflash_trt.runtime.stats import COUNTERS, CYCLE_SCHEMA, EXECUTE_SCHEMA


def cycles(
    cycle_id, mode, proposed, accepted, *, session=None, owners=None, draft_ms=None, verify_ms=None,
    host_ms=None, end_ms=None, context_rows=None, emitted=None, policy=None, policy_ratio=None,
) -> pl.LazyFrame:
    """A cycles table from literal columns; emitted (unless given: a cut cycle) and bonus follow the schema's definitions."""
    n = len(cycle_id)
    columns = {
        "batch_id": [0] * n,
        "cycle_id": cycle_id,
        "session": session or list(range(n)),
        "owners": owners or [1] * n,
        "mode": mode,
        "context_rows": context_rows or [0] * n,
        "proposed": proposed,
        "accepted": accepted,
        "bonus": [m != "target" and a == p for m, p, a in zip(mode, proposed, accepted, strict=True)],
        "emitted": emitted or [a + 1 for a in accepted],
        "position": [0] * n,
        "temperature": [0.0] * n,
        "draft_ms": draft_ms or [0.0] * n,
        "verify_ms": verify_ms or [0.0] * n,
        "host_ms": host_ms or [0.0] * n,
        "end_ms": end_ms or [float(c) for c in cycle_id],
        "policy": policy or ["fixed"] * n,
        "policy_ratio": policy_ratio or [float("nan")] * n,
    }
    return pl.LazyFrame(columns, schema=CYCLE_SCHEMA)


def one(frame: pl.LazyFrame) -> dict:
    return frame.collect().row(0, named=True)


def test_tau_counts_the_bonus_and_skips_target_rows():
    """Guards against τ as mean accepted (off by one: bonus/correction left out) and against
    plain-decode rows (mode == target, always 1 token) diluting τ."""
    frame = cycles(
        cycle_id=[0, 1, 2, 3, 4],
        mode=["static", "static", "dynamic", "target", "target"],
        proposed=[3, 3, 3, 0, 0],
        accepted=[0, 3, 1, 0, 0],
    )
    # speculative rows emit 1, 4, 2 tokens -> τ = 7/3 (not 4/3 = mean accepted, not 9/5 with target rows)
    assert one(acceptance.tau(frame)) == {"rows": 3, "tau": pytest.approx(7 / 3)}


def test_policy_choices_count_rows_and_tokens_per_reason_and_mode():
    """Guards against a policy table that cannot be trusted: rows and tokens must be grouped by the
    policy's reason and the mode, and the mean ratio must skip rows where nothing was estimated (NaN,
    e.g. a prompt's prediction) instead of turning the whole mean into NaN."""
    nan = float("nan")
    frame = cycles(
        cycle_id=[0, 0, 1, 2, 3, 4],
        mode=["static", "static", "target", "target", "static", "target"],
        proposed=[3, 3, 0, 0, 3, 0],
        accepted=[2, 0, 0, 0, 3, 0],
        policy=["estimate", "estimate", "estimate", "fixed", "drain", "estimate"],
        policy_ratio=[1.5, 1.5, 0.5, nan, 0.7, 0.7],
    )
    table = drafting.policy_choices(frame).collect()
    assert table.select("policy", "mode", "rows", "emitted").rows() == [
        ("drain", "static", 1, 4), ("estimate", "static", 2, 4), ("estimate", "target", 2, 2), ("fixed", "target", 1, 1),
    ]
    assert table["mean_ratio"].to_list()[:3] == pytest.approx([0.7, 1.5, 0.6]) and table["mean_ratio"][3] is None
    assert table["row_share"].sum() == pytest.approx(1.0)


def test_tau_by_session_and_owners():
    """Guards against grouping on the wrong column or letting target rows into a group's τ."""
    frame = cycles(
        cycle_id=[0, 0, 1, 2, 3],
        session=[7, 8, 7, 8, 8],
        owners=[2, 2, 1, 1, 1],
        mode=["static", "static", "static", "static", "target"],
        proposed=[4, 4, 4, 4, 0],
        accepted=[4, 0, 2, 1, 0],
    )
    by_session = acceptance.tau_by(frame, "session").collect()
    assert by_session.to_dict(as_series=False) == {"session": [7, 8], "rows": [2, 2], "tau": [4.0, 1.5]}
    by_owners = acceptance.tau_by(frame, "owners").collect()
    assert by_owners.to_dict(as_series=False) == {"owners": [1, 2], "rows": [2, 2], "tau": [2.5, 3.0]}


def test_rolling_tau_pools_owner_rows_in_cycle_order():
    """Guards against averaging per-call means (overweights 1-owner calls) and against
    rolling in file order instead of cycle_id order."""
    frame = cycles(  # rows deliberately out of cycle order
        cycle_id=[2, 0, 0, 0, 1],
        owners=[1, 3, 3, 3, 1],
        mode=["static"] * 5,
        proposed=[4] * 5,
        accepted=[2, 0, 0, 0, 4],  # call 0: 1+1+1 over 3 rows; call 1: 5; call 2: 3
    )
    rolling = acceptance.rolling_tau(frame, window=2).collect()
    assert rolling["cycle_id"].to_list() == [0, 1, 2]
    # call 1 window: (3 + 5) / (3 + 1) = 2.0 (mean of call means would be 3.0); call 2: (5 + 3) / 2
    assert rolling["tau"].to_list() == pytest.approx([1.0, 2.0, 4.0])


def test_histogram_has_every_length_including_empty_ones():
    """Guards against missing zero bins (a plot with gaps that shifts bars) and lengths off by one."""
    frame = cycles(cycle_id=[0, 1, 2, 3], mode=["static"] * 4, proposed=[4] * 4, accepted=[0, 0, 2, 4])
    hist = acceptance.histogram(frame).collect()
    assert hist.to_dict(as_series=False) == {
        "length": [1, 2, 3, 4, 5],
        "rows": [2, 0, 1, 0, 1],
        "share": [0.5, 0.0, 0.25, 0.0, 0.25],
    }


def test_position_acceptance_with_varying_proposals():
    """Guards against the wrong denominator: rate is over all rows, rate_when_proposed only
    over rows that proposed position k (they differ when P varies)."""
    frame = cycles(cycle_id=[0, 1, 2, 3], mode=["static"] * 4, proposed=[3, 3, 2, 2], accepted=[0, 3, 2, 1])
    positions = acceptance.position_acceptance(frame).collect()
    assert positions.to_dict(as_series=False) == {
        "k": [1, 2, 3],
        "reached": [3, 2, 1],
        "proposed_rows": [4, 4, 2],
        "rate": [0.75, 0.5, 0.25],
        "rate_when_proposed": [0.75, 0.5, 0.5],
    }


def test_empty_run_gives_empty_tables_not_errors():
    """Guards against crashes (null int_range bounds) on a run with no speculative cycles."""
    frame = cycles(cycle_id=[0, 1], mode=["target", "target"], proposed=[0, 0], accepted=[0, 0])
    assert one(acceptance.tau(frame)) == {"rows": 0, "tau": None}
    assert acceptance.histogram(frame).collect().height == 0
    assert acceptance.position_acceptance(frame).collect().height == 0


def test_latency_counts_each_call_once():
    """Guards against summing phase times over owner rows: a 4-owner call repeats its
    draft_ms/verify_ms/host_ms on 4 rows and must count once."""
    frame = cycles(
        cycle_id=[0, 0, 0, 0, 1],
        owners=[4, 4, 4, 4, 1],
        mode=["static"] * 5,
        proposed=[3] * 5,
        accepted=[0] * 5,
        draft_ms=[2.0, 2.0, 2.0, 2.0, 2.0],
        verify_ms=[6.0, 6.0, 6.0, 6.0, 4.0],
        host_ms=[1.0, 1.0, 1.0, 1.0, 1.0],
    )
    latency = throughput.latency_breakdown(frame).collect()
    assert latency["phase"].to_list() == ["draft_ms", "verify_ms", "host_ms"]
    assert latency["total_ms"].to_list() == [4.0, 10.0, 2.0]  # not 10, 28, 5
    assert latency["mean_ms"].to_list() == [2.0, 5.0, 1.0]
    assert latency["share"].to_list() == [0.25, 0.625, 0.125]
    by_owners = throughput.latency_by(frame, "owners").collect()
    assert by_owners.to_dict(as_series=False) == {
        "owners": [1, 4], "calls": [1, 1], "draft_ms": [2.0, 2.0], "verify_ms": [4.0, 6.0],
        "host_ms": [1.0, 1.0], "tokens_per_call": [1.0, 4.0],
    }


def test_tokens_per_second_wall_and_device():
    """Guards against counting the first call's tokens over the end-to-end span (doubles a
    2-call rate), double-counting device time of multi-owner calls, and dropping target rows."""
    frame = cycles(
        cycle_id=[0, 0, 1, 2],
        owners=[2, 2, 1, 1],
        mode=["static", "static", "static", "target"],
        proposed=[3, 3, 3, 0],
        accepted=[2, 1, 3, 0],  # emitted 3 + 2 (call 0), 4 (call 1), 1 (call 2)
        draft_ms=[10.0, 10.0, 10.0, 0.0],
        verify_ms=[20.0, 20.0, 20.0, 10.0],
        end_ms=[100.0, 100.0, 150.0, 200.0],
    )
    figures = one(throughput.throughput(frame))
    assert figures["rows"] == 4 and figures["calls"] == 3 and figures["tokens"] == 10
    assert figures["wall_s"] == pytest.approx(0.1)
    assert figures["tokens_per_s"] == pytest.approx(50.0)  # (4 + 1) tokens after t=100 ms, over 0.1 s
    assert figures["device_s"] == pytest.approx(0.07)  # 30 + 30 + 10 ms, call 0 once
    assert figures["tokens_per_device_s"] == pytest.approx(10 / 0.07)


def test_tokens_are_what_callers_received_and_tau_the_whole_cycles():
    """Guards against τ shrinking when a request's last cycle is cut at its room or a stop token (the
    reference decoder's τ counts that cycle's whole a + 1) and against tokens counting the cut-off
    part, which no caller received."""
    frame = cycles(cycle_id=[0, 1, 2], mode=["target", "static", "static"], proposed=[0, 7, 7], accepted=[0, 3, 5],
                   emitted=[1, 4, 2], end_ms=[10.0, 20.0, 30.0])
    assert one(acceptance.tau(frame)) == {"rows": 2, "tau": pytest.approx((4 + 6) / 2)}
    assert one(throughput.throughput(frame))["tokens"] == 7


def test_wall_span_with_an_executes_table_is_the_run():
    """Guards against a rate that differs from the one ``dflash-trt run`` / ``bench`` print for the same
    run: with the executes table, the span is first execute start to last execute end and every token
    counts (without it, the first cycle end starts the span); device time then stays within it."""
    frame = cycles(cycle_id=[0, 1, 2], mode=["target", "static", "static"], proposed=[0, 3, 3], accepted=[0, 3, 1],
                   verify_ms=[5.0, 20.0, 20.0], end_ms=[12.0, 40.0, 70.0])
    calls = executes(wall_ms=[35.0, 32.0], end_ms=[42.0, 74.0])  # starts at 7 ms, ends at 74 ms
    figures = one(throughput.throughput(frame, calls))
    assert figures["tokens"] == 7 and figures["wall_s"] == pytest.approx(0.067)
    assert figures["tokens_per_s"] == pytest.approx(7 / 0.067)
    assert figures["device_s"] == pytest.approx(0.045) and figures["device_s"] <= figures["wall_s"]
    assert one(throughput.throughput(frame))["tokens_per_s"] == pytest.approx(6 / 0.058)


def test_single_call_rate_is_null_not_infinite():
    """Guards against inf/NaN tokens/s (invalid JSON, nonsense speedups) when no time elapsed."""
    frame = cycles(cycle_id=[0, 0], owners=[2, 2], mode=["static"] * 2, proposed=[2, 2], accepted=[1, 2])
    figures = one(throughput.throughput(frame))
    assert figures["wall_s"] == 0.0
    assert figures["tokens_per_s"] is None
    assert figures["tokens_per_device_s"] is None  # device times are all 0 here


def test_speedup_against_autoregressive_baseline():
    """Guards against an inverted ratio or a speedup taken against the wrong row."""
    baseline = cycles(  # 1 token per 20 ms -> 50 tokens/s; device 10 ms per token
        cycle_id=[0, 1, 2], mode=["target"] * 3, proposed=[0] * 3, accepted=[0] * 3,
        verify_ms=[10.0] * 3, end_ms=[0.0, 20.0, 40.0],
    )
    fast = cycles(  # 8 tokens after t=0 over 40 ms -> 200 tokens/s; 12 tokens over 60 device ms
        cycle_id=[0, 1, 2], mode=["static"] * 3, proposed=[3] * 3, accepted=[3] * 3,
        verify_ms=[20.0] * 3, end_ms=[0.0, 20.0, 40.0],
    )
    table = compare([Run("fast", fast)], Run("ar", baseline)).collect()
    assert table["name"].to_list() == ["ar", "fast"]
    assert table["tokens_per_s"].to_list() == pytest.approx([50.0, 200.0])
    assert table["speedup"].to_list() == pytest.approx([1.0, 4.0])
    assert table["device_speedup"].to_list() == pytest.approx([1.0, 2.0])  # 200 / 100 tokens per device s
    assert table["tau"].to_list() == [None, 4.0]


def test_a_call_with_one_draining_owner_ran_the_dynamic_draft():
    """Guards against classifying a mixed call by whichever owner row comes first: one
    dynamic owner makes the whole call run the dynamic draft."""
    frame = cycles(
        cycle_id=[0, 0, 1],
        owners=[2, 2, 1],
        mode=["static", "dynamic", "static"],
        proposed=[3, 3, 3],
        accepted=[1, 1, 1],
        draft_ms=[5.0, 5.0, 1.0],
    )
    assert throughput.calls(frame).sort("cycle_id").collect()["mode"].to_list() == ["dynamic", "static"]
    by_mode = throughput.latency_by(frame, "mode").collect()
    assert by_mode.select("mode", "calls", "draft_ms").rows() == [("dynamic", 1, 5.0), ("static", 1, 1.0)]
    modes = drafting.mode_share(frame).collect()
    assert modes.select("mode", "rows", "calls").rows() == [("dynamic", 1, 1), ("static", 2, 1)]


def test_mode_share_and_context_rows():
    """Guards against static/dynamic shares computed over calls when rows are meant (and vice
    versa) and context rows summed per call instead of per owner."""
    frame = cycles(
        cycle_id=[0, 0, 1, 2],
        owners=[2, 2, 1, 1],
        mode=["static", "static", "dynamic", "target"],
        proposed=[3, 3, 3, 0],
        accepted=[1, 1, 1, 0],
        context_rows=[2, 3, 40, 0],
    )
    modes = drafting.mode_share(frame).collect()
    assert modes.to_dict(as_series=False) == {
        "mode": ["dynamic", "static", "target"],
        "rows": [1, 2, 1],
        "calls": [1, 1, 1],
        "context_rows": [40, 5, 0],
        "emitted": [2, 4, 1],
        "row_share": [0.25, 0.5, 0.25],
        "call_share": [1 / 3, 1 / 3, 1 / 3],
    }


def executes(**columns) -> pl.LazyFrame:
    """An executes table of two calls; unspecified counters are 0."""
    base = {name: [0, 0] for name in EXECUTE_SCHEMA}
    base |= {"ok": [True, True], "pending_decode": [False, False]}
    return pl.LazyFrame(base | columns, schema=EXECUTE_SCHEMA)


def test_execute_totals_sum_counters_and_count_failures():
    """Guards against counting ok calls as failures and dropping a counter from the totals."""
    table = executes(ok=[True, False], pending_decode=[True, False], wall_ms=[1.5, 2.5], draft_forwards=[3, 4])
    totals = one(counters.execute_totals(table))
    assert (totals["executes"], totals["failed"], totals["pending_decode_executes"]) == (2, 1, 1)
    assert totals["wall_ms"] == 4.0
    assert totals["draft_forwards"] == 7
    assert set(COUNTERS) <= set(totals)


def test_cross_check_flags_a_mismatch():
    """Guards against a cross-check that cannot fail: a lost accepted count must show as False."""
    frame = cycles(cycle_id=[0, 1, 2], mode=["static", "dynamic", "target"], proposed=[3, 3, 0], accepted=[3, 1, 0])
    table = executes(cycles=[1, 1], proposed=[3, 3], accepted=[3, 0], bonuses=[1, 0])
    check = counters.cross_check(frame, table).collect()
    assert check.to_dict(as_series=False) == {
        "quantity": ["cycles", "proposed", "accepted", "bonuses"],
        "cycles_table": [2, 6, 4, 1],
        "executes_table": [2, 6, 3, 1],
        "match": [True, True, False, True],
    }


row_strategy = st.integers(2, 7).flatmap(lambda p: st.tuples(st.just(p), st.integers(0, p)))


@settings(max_examples=25, deadline=None)
@given(st.lists(row_strategy, min_size=1, max_size=40))
def test_tables_agree_with_tau(rows):
    """Guards against the histogram, per-position rates and τ drifting apart: Σ length·share = τ
    and Σ_k P(accepted ≥ k) = τ - 1 for any rows."""
    proposed, accepted = (list(column) for column in zip(*rows, strict=True))
    frame = cycles(cycle_id=list(range(len(rows))), mode=["static"] * len(rows), proposed=proposed, accepted=accepted)
    tau = one(acceptance.tau(frame))["tau"]
    hist = acceptance.histogram(frame).collect()
    rates = acceptance.position_acceptance(frame).collect()["rate"]
    assert math.isclose((hist["length"] * hist["share"]).sum(), tau, rel_tol=1e-12)
    assert math.isclose(rates.sum(), tau - 1, rel_tol=1e-12, abs_tol=1e-12)
    assert hist.height == max(proposed) + 1 and rates.len() == max(proposed)


call_strategy = st.tuples(
    st.sampled_from([3, 7, 15]),  # the call's verify length
    st.integers(1, 4),  # packed owners, finished ones included
    st.floats(0.05, 2.0),  # the call's device ms
    st.lists(st.integers(0, 15), min_size=1, max_size=4),  # its rows' accepted counts (clipped to k, to the owners)
    st.booleans(),  # a plain decode step follows (a target row, outside every length)
)


@settings(max_examples=40, deadline=None)
@given(st.lists(call_strategy, min_size=1, max_size=12))
def test_verify_lengths_agree_with_brute_force(calls):
    """Guards against a verify-length table that sums a call's device time once per owner row (a 4-owner
    call counted four times), lets plain decode steps into a length's τ or cost, or divides the device time
    by the rows seen instead of the owners the device ran (a finished owner's row is discarded, not free)."""
    columns = {name: [] for name in ("cycle_id", "mode", "proposed", "accepted", "owners", "verify_ms")}
    expected: dict[int, dict] = {}
    call_id = 0
    for k, owners, ms, accepted, decode_after in calls:
        accepted = [min(a, k) for a in accepted][:owners]
        for a in accepted:
            for name, value in zip(columns, (call_id, "static", k, a, owners, ms), strict=True):
                columns[name].append(value)
        e = expected.setdefault(k, {"calls": 0, "rows": 0, "length": 0, "owners": 0, "ms": 0.0})
        e["calls"] += 1
        e["rows"] += len(accepted)
        e["length"] += sum(a + 1 for a in accepted)
        e["owners"] += owners
        e["ms"] += ms
        call_id += 1
        if decode_after:
            for name, value in zip(columns, (call_id, "target", 0, 0, 3, 9.0), strict=True):
                columns[name].append(value)
            call_id += 1
    table = drafting.verify_lengths(cycles(**columns)).collect()
    assert table["proposed"].to_list() == sorted(expected)
    for row in table.iter_rows(named=True):
        e = expected[row["proposed"]]
        assert (row["calls"], row["rows"]) == (e["calls"], e["rows"])
        assert row["tau"] == pytest.approx(e["length"] / e["rows"])
        assert row["owners_per_call"] == pytest.approx(e["owners"] / e["calls"])
        assert row["device_ms_per_call"] == pytest.approx(e["ms"] / e["calls"])
        assert row["device_us_per_owner"] == pytest.approx(1000.0 * e["ms"] / e["owners"])
        assert row["tokens_per_device_ms"] == pytest.approx(e["length"] / e["ms"])  # emitted = accepted + 1 here
