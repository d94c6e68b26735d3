"""Open stats Parquet files lazily, after checking they are what we expect.

The runtime writes two tables per run (``runtime/stats.py``): cycles
(``CYCLE_SCHEMA``, one row per owner per cycle) and executes
(``EXECUTE_SCHEMA``, one row per ``execute()``), named by ``stats_paths``:
``X.parquet`` and ``X.executes.parquet``. Each file carries its kind and
schema version as Parquet key-value metadata.

Only the footer is read to validate (``polars.read_parquet_metadata``/``_schema``); the
rows stay on disk until a query collects, so a multi-gigabyte log costs
nothing to open (``scan_run`` adds one streaming pass over ``cycle_id`` to
learn whether rows are in call order).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from dflash_trt.errors import StatsError
from dflash_trt.runtime.stats import (
    CYCLE_SCHEMA,
    EXECUTE_SCHEMA,
    KIND_KEY,
    SCHEMA_VERSION,
    TARGET,
    VERSION_KEY,
    stats_paths,
)

SCHEMAS: dict[str, Mapping[str, pl.DataType]] = {"cycles": CYCLE_SCHEMA, "executes": EXECUTE_SCHEMA}


@dataclass(frozen=True)
class Run:
    """One run's stats: the cycles table and, when present, the executes table.

    | field | type | meaning |
    | --- | --- | --- |
    | name | str | label in tables and plots: the run's mode (``mode_name``) unless given |
    | cycles | LazyFrame | ``CYCLE_SCHEMA`` columns, validated |
    | executes | LazyFrame or None | ``EXECUTE_SCHEMA`` columns, when the file exists |
    """

    name: str
    cycles: pl.LazyFrame
    executes: pl.LazyFrame | None = None


def executes_beside(cycles_path: str | Path) -> Path | None:
    """The executes table that belongs to a cycles file, if it exists."""
    path = stats_paths(cycles_path)[1]
    return path if path.exists() else None


def scan_run(cycles_path: str | Path, name: str | None = None) -> Run:
    """Validate and scan a cycles file and the executes file beside it."""
    cycles_path = Path(cycles_path)
    executes_path = executes_beside(cycles_path)
    cycles = scan_stats(cycles_path, "cycles")
    if in_call_order(cycles):
        cycles = cycles.set_sorted("cycle_id")
    return Run(
        name=name or mode_name(cycles),
        cycles=cycles,
        executes=None if executes_path is None else scan_stats(executes_path, "executes"),
    )


DFLASH, PLAIN = "dflash", "plain"  # run names: speculative cycles, or plain target decoding only


def mode_name(cycles: pl.LazyFrame) -> str:
    """``dflash`` when the run has a speculative cycle, else ``plain`` (one streaming pass over ``mode``)."""
    drafted = cycles.select((pl.col("mode") != TARGET).any()).collect().item()
    return DFLASH if drafted else PLAIN


def in_call_order(cycles: pl.LazyFrame) -> bool:
    """Whether ``cycle_id`` never decreases in file order (one streaming pass over one column).

    The runtime appends rows as calls complete, so this is the usual case.
    It matters for memory, not correctness: with the column flagged sorted,
    Polars groups rows by call without a hash table, so the per-call
    de-duplication (``throughput.calls``) no longer grows with the log.
    Only a checked order is flagged; a wrong flag would give wrong groups.
    """
    after_previous = pl.col("cycle_id") >= pl.col("cycle_id").shift(1)
    return bool(cycles.select(after_previous.all()).collect().item())


def scan_stats(path: str | Path, kind: str) -> pl.LazyFrame:
    """A validated lazy scan of one stats table, restricted to its schema's columns.

    Raises ``StatsError`` naming every problem at once: unreadable file,
    other table kind, other schema version, missing or mistyped columns.
    Extra columns are tolerated (and dropped) so a newer writer that only
    adds columns still reads.
    """
    path = Path(path)
    schema = SCHEMAS[kind]
    metadata, columns = _read_footer(path)
    problems = _metadata_problems(metadata, kind)
    problems += column_problems(columns, schema)
    if problems:
        msg = f"{path} is not a usable dflash-trt {kind} stats file: " + "; ".join(problems)
        raise StatsError(msg)
    return pl.scan_parquet(path).select(list(schema))


def _read_footer(path: Path) -> tuple[dict[str, str], dict[str, pl.DataType]]:
    """The Parquet footer: key-value metadata and column types, no rows."""
    if not path.is_file():
        msg = f"stats file {path} does not exist"
        raise StatsError(msg)
    try:
        return pl.read_parquet_metadata(path), dict(pl.read_parquet_schema(path))
    except (pl.exceptions.PolarsError, OSError) as error:
        msg = f"{path} is not a Parquet file ({error})"
        raise StatsError(msg) from error


def _metadata_problems(metadata: Mapping[str, str], kind: str) -> list[str]:
    """Kind and version checks on the file's key-value metadata."""
    seen_kind = metadata.get(KIND_KEY)
    seen_version = metadata.get(VERSION_KEY)
    problems = []
    if seen_kind is None:
        problems.append(f"metadata key {KIND_KEY!r} missing (expected {kind!r}; not written by runtime.stats.write_parquet?)")
    elif seen_kind != kind:
        problems.append(f"table kind: expected {kind!r}, seen {seen_kind!r}")
    if seen_version is None:
        problems.append(f"schema version: expected {SCHEMA_VERSION}, seen none ({VERSION_KEY!r} missing)")
    elif seen_version != str(SCHEMA_VERSION):
        problems.append(f"schema version: expected {SCHEMA_VERSION}, seen {seen_version}")
    return problems


def column_problems(seen: Mapping[str, pl.DataType], expected: Mapping[str, pl.DataType]) -> list[str]:
    """Missing and mistyped columns, each with its expected (and seen) dtype."""
    missing = [f"{name} ({dtype})" for name, dtype in expected.items() if name not in seen]
    mistyped = [
        f"{name} expected {dtype}, seen {seen[name]}"
        for name, dtype in expected.items()
        if name in seen and seen[name] != dtype
    ]
    problems = []
    if missing:
        problems.append("missing columns: " + ", ".join(missing))
    if mistyped:
        problems.append("mistyped columns: " + ", ".join(mistyped))
    return problems
