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

Execute table (``EXECUTE_SCHEMA``), one row per ``execute()``: the seed
executor's counters as per-call deltas, plus timing.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import polars as pl

SCHEMA_VERSION = 1
MODES = ("static", "dynamic", "target")

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

# The seed executor's stats_ counters, as per-execute deltas.
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
