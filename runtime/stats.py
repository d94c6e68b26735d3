"""The stats schema: one row per owner per cycle, one row per ``execute()``.

This module is the single definition both the runtime (which accumulates
rows) and ``dflash_trt.analysis`` (which aggregates them) import. Units are in
the column names. τ (acceptance length) is defined once, here: the mean of
``emitted`` over cycle rows, i.e. accepted proposals + 1 (the correction or
bonus token counts).

Cycle table (``CYCLE_SCHEMA``), one row per owner per draft→verify cycle, or
per session per plain target-decode step:

| column | dtype | meaning |
| --- | --- | --- |
| batch_id | Int64 | index of the ``execute()`` call that ran this cycle |
| cycle_id | Int64 | index of the draft/verify call (shared by its owners) |
| session | Int64 | session id |
| owners | Int32 | owners packed into this draft/verify call (1..max_owners) |
| mode | Utf8 | ``static`` (draft@n), ``dynamic`` (dynamic draft) or ``target`` (plain decode, no draft) |
| context_rows | Int32 | new context rows the draft consumed for this owner |
| proposed | Int32 | proposals verified (P; 0 in ``target`` mode) |
| accepted | Int32 | accepted proposals a (0..proposed) |
| bonus | Boolean | every proposal accepted (a == P) and the bonus token emitted |
| emitted | Int32 | tokens this cycle produced: accepted + 1 |
| position | Int64 | position of the anchor (first verified token) |
| temperature | Float32 | the session's sampling temperature (0 = greedy) |
| draft_ms | Float64 | device time of the draft call (shared by its owners) |
| verify_ms | Float64 | device time of target verify + verdict (shared) |
| host_ms | Float64 | host time of the cycle outside device work (shared) |
| end_ms | Float64 | wall-clock time the cycle ended, ms since the executor started |

Execute table (``EXECUTE_SCHEMA``), one row per ``execute()``: the
counters of docs/design.md §8 as per-call deltas, plus timing.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import polars as pl

if TYPE_CHECKING:
    from dflash_trt.runtime.cycles import Burst
    from dflash_trt.runtime.sessions import Session

SCHEMA_VERSION = 1
STATIC, DYNAMIC, TARGET = "static", "dynamic", "target"  # the values of the cycle table's ``mode``

CYCLE_SCHEMA: dict[str, pl.DataType] = {
    "batch_id": pl.Int64(),
    "cycle_id": pl.Int64(),
    "session": pl.Int64(),
    "owners": pl.Int32(),
    "mode": pl.Utf8(),
    "context_rows": pl.Int32(),
    "proposed": pl.Int32(),
    "accepted": pl.Int32(),
    "bonus": pl.Boolean(),
    "emitted": pl.Int32(),
    "position": pl.Int64(),
    "temperature": pl.Float32(),
    "draft_ms": pl.Float64(),
    "verify_ms": pl.Float64(),
    "host_ms": pl.Float64(),
    "end_ms": pl.Float64(),
}

# The executor's counters (docs/design.md §8), as per-execute deltas.
COUNTERS = (
    "target_preamble_calls",
    "target_preamble_forwards",
    "target_verify_calls",
    "target_verify_forwards",
    "draft_forwards",
    "static_draft_forwards",
    "warmed_context_tokens",
    "cycles",
    "proposed",
    "accepted",
    "bonuses",
    "rejected",
    "pending_decode_batches",
    "pending_decode_owners",
    "target_decode_steps",
    "failed_batches",
    "hidden_rows_d2h",
    "hidden_bytes_d2h",
    "hidden_rows_d2d",
    "hidden_bytes_d2d",
)

EXECUTE_SCHEMA: dict[str, pl.DataType] = {
    "batch_id": pl.Int64(),
    "inputs": pl.Int32(),
    "target_tokens": pl.Int64(),
    "pending_decode": pl.Boolean(),
    "ok": pl.Boolean(),
    "wall_ms": pl.Float64(),
    "end_ms": pl.Float64(),
    **{name: pl.Int64() for name in COUNTERS},
}

KIND_KEY = "dflash_trt.stats"  # Parquet key-value metadata: which table
VERSION_KEY = "dflash_trt.schema_version"


class ColumnStore:
    """Column-wise accumulator for one table; rows append as dicts of scalars."""

    def __init__(self, schema: Mapping[str, pl.DataType]) -> None:
        self.schema = dict(schema)
        self.columns: dict[str, list] = {name: [] for name in self.schema}

    def append(self, **row) -> None:
        missing = self.schema.keys() - row.keys()
        extra = row.keys() - self.schema.keys()
        assert not missing and not extra, f"stats row: missing {missing}, extra {extra}"
        for name, value in row.items():
            self.columns[name].append(value)

    def __len__(self) -> int:
        return len(next(iter(self.columns.values()), []))

    def frame(self) -> pl.DataFrame:
        return pl.DataFrame(self.columns, schema=self.schema)

    def clear(self) -> None:
        for values in self.columns.values():
            values.clear()


def write_parquet(frame: pl.DataFrame, path: str | Path, kind: str) -> Path:
    """Write a stats table with its kind and schema version as file metadata."""
    assert kind in ("cycles", "executes"), kind
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    frame.write_parquet(path, metadata={KIND_KEY: kind, VERSION_KEY: str(SCHEMA_VERSION)})
    return path


def stats_paths(stem: str | Path) -> tuple[Path, Path]:
    """Where a run's two tables live: ``STEM.parquet`` and ``STEM.executes.parquet``.

    The runtime writes both through this function and ``dflash-trt report``
    finds the executes table beside the cycles file through it, so the naming
    is defined once. A stem that already ends in ``.parquet`` (a cycles path)
    has that suffix dropped first, so ``stats_paths(cycles_path)`` round-trips.
    """
    stem = Path(stem)
    if stem.suffix == ".parquet":
        stem = stem.with_suffix("")
    return stem.with_name(stem.name + ".parquet"), stem.with_name(stem.name + ".executes.parquet")


class StatsLog:
    """Column-wise stats: cycle rows as they happen, one execute row of counter deltas per call."""

    def __init__(self) -> None:
        self.cycles = ColumnStore(CYCLE_SCHEMA)
        self.executes = ColumnStore(EXECUTE_SCHEMA)
        self.origin = time.perf_counter()
        self.batch_id = 0
        self.cycle_id = 0
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.started = self.origin

    def begin(self) -> None:
        """Counters are NOT reset here: copies made by clone() between calls land in the next row."""
        self.started = time.perf_counter()
        self.cycle_started = self.started

    def count(self, rows_name: str, rows: int, row_bytes: int) -> None:
        self.counters[rows_name] += rows
        self.counters[rows_name.replace("rows", "bytes")] += rows * row_bytes

    def cycle_counters(self, n: int, proposals: int, counts: list[int], bursts: list[Burst], row_bytes: int) -> None:
        k = self.counters
        k["target_verify_calls"] += 1
        k["target_verify_forwards"] += 1
        k["draft_forwards"] += 1
        k["static_draft_forwards"] += 1
        k["warmed_context_tokens"] += sum(counts)
        k["cycles"] += n
        k["proposed"] += n * proposals
        k["accepted"] += sum(b.accepted for b in bursts)
        k["bonuses"] += sum(b.bonus for b in bursts)
        k["rejected"] += sum(not b.bonus for b in bursts)
        self.count("hidden_rows_d2d", n * (proposals + 1), row_bytes)

    def _shared(self, owners: int, mode: str, draft_ms: float, verify_ms: float) -> dict:
        end = time.perf_counter()
        host_ms = max(0.0, (end - self.cycle_started) * 1000.0 - draft_ms - verify_ms)
        self.cycle_started = end
        shared = dict(batch_id=self.batch_id, cycle_id=self.cycle_id, owners=owners, mode=mode)
        self.cycle_id += 1
        return shared | dict(draft_ms=draft_ms, verify_ms=verify_ms, host_ms=host_ms, end_ms=(end - self.origin) * 1000.0)

    def cycle_rows(self, rows: list, proposals: int, draft_ms: float, verify_ms: float) -> None:
        """rows: (session, mode, context_rows, start, burst) per owner of one call."""
        modes = {mode for _, mode, *_ in rows}
        shared = self._shared(len(rows), DYNAMIC if DYNAMIC in modes else STATIC, draft_ms, verify_ms)
        for s, mode, context_rows, start, burst in rows:
            self.cycles.append(
                **shared | dict(mode=mode),
                session=s.id,
                context_rows=context_rows,
                proposed=proposals,
                accepted=burst.accepted,
                bonus=burst.bonus,
                emitted=len(burst.tokens),
                position=start,
                temperature=s.sampling.temperature,
            )

    def target_row(self, s: Session, position: int, target_ms: float) -> None:
        """A token the target produced outside verify (after a prompt/replay or in plain decode)."""
        shared = self._shared(1, TARGET, 0.0, target_ms)
        self.cycles.append(
            **shared,
            session=s.id,
            context_rows=0,
            proposed=0,
            accepted=0,
            bonus=False,
            emitted=1,
            position=position,
            temperature=s.sampling.temperature,
        )

    def end_execute(self, inputs: int, target_tokens: int, pending_decode: bool, ok: bool) -> None:
        end = time.perf_counter()
        self.executes.append(
            batch_id=self.batch_id,
            inputs=inputs,
            target_tokens=target_tokens,
            pending_decode=pending_decode,
            ok=ok,
            wall_ms=(end - self.started) * 1000.0,
            end_ms=(end - self.origin) * 1000.0,
            **self.counters,
        )
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.batch_id += 1
