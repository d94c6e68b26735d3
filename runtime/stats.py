"""The stats schema: one row per owner per cycle, one row per ``execute()``.

This module is the single definition both the runtime (which accumulates
rows) and ``dflash_trt.analysis`` (which aggregates them) import. Units are in
the column names. τ (acceptance length) is defined once, here: the mean of
``accepted + 1`` over speculative cycle rows (the correction or bonus token
counts; ``TAU_LENGTH``). Tokens are defined once too: ``emitted`` counts the
tokens a row gave its caller, so Σ ``emitted`` is what callers received. A
cycle launched ahead (the host one cycle behind) whose tokens were all
discarded because its session had already finished is not a row at all.

Cycle table (``CYCLE_SCHEMA``), one row per owner per draft→verify cycle, or
per session per plain target-decode step:

| column | dtype | meaning |
| --- | --- | --- |
| batch_id | Int64 | index of the ``execute()`` call that ran this cycle |
| cycle_id | Int64 | index of the draft/verify call (shared by its owners) |
| session | Int64 | session id |
| owners | Int32 | owners packed into this draft/verify call (1..max_owners), rows of discarded owners included |
| mode | Utf8 | ``static`` (draft@n), ``dynamic`` (dynamic draft) or ``target`` (plain decode, no draft) |
| context_rows | Int32 | new context rows the draft consumed for this owner |
| proposed | Int32 | proposals verified: the cycle's verify length k (``Dims.verify_proposals``; P under the ``always`` policy, the policy's choice under ``adaptive``); 0 in ``target`` mode |
| accepted | Int32 | accepted proposals a (0..proposed) |
| bonus | Boolean | every verified proposal accepted (a == proposed) and the bonus token emitted |
| emitted | Int32 | tokens of this row returned to the caller: accepted + 1, less any cut at the room or after a stop token |
| position | Int64 | position of the anchor (first verified token) |
| temperature | Float32 | the session's sampling temperature (0 = greedy) |
| draft_ms | Float64 | device time of the draft alone (shared by its owners); 0 for the device loop's cycles (every backend): draft, verify and verdict run as one program and are timed as one unit, in verify_ms |
| verify_ms | Float64 | device time of target verify + verdict (shared); a loop launch's whole device time (cycle or decode step) |
| host_ms | Float64 | host time since the previous row outside this call's device time (shared) |
| end_ms | Float64 | wall-clock time the cycle ended, ms since the executor started |
| policy | Utf8 | why this row's launch was a cycle or a decode step (``runtime.policy``): ``estimate`` (the measured ratio said so), ``explore`` (a cost still unknown), ``probe`` (re-measuring the losing kind), ``drain`` (pending context full: a cycle must run), ``switch`` (a cycle in flight may leave the pending context full: one more, short enough that the next round can decode), ``fixed`` (no choice: not drafting, no block's room, a prompt's prediction, or the ``always`` policy) |
| policy_ratio | Float64 | the policy's estimate at the choice: cycle rounds' tokens per second (of the chosen verify length, or the best one for a decode step) over decode rounds' (> 1: cycling pays); NaN when not estimated |

Execute table (``EXECUTE_SCHEMA``), one row per ``execute()``: the
counters of docs/design.md §8 as per-call deltas, plus timing.
"""

from __future__ import annotations

import math
import threading
import time
from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import polars as pl

from dflash_trt.runtime.policy import FIXED

if TYPE_CHECKING:
    from dflash_trt.runtime.sessions import Session

# 2: the cycle table's policy and policy_ratio; the policy_* counters; 3: proposed is the cycle's verify length (not always P);
# 4: the loop_launches / loop_rounds counters; 5: the drafting_stopped counter; 6: the loop_device_us counter
SCHEMA_VERSION = 6
STATIC, DYNAMIC, TARGET = "static", "dynamic", "target"  # the values of the cycle table's ``mode``
TAU_LENGTH = "accepted + 1"  # τ = mean of this over speculative rows (``analysis.acceptance.TAU``)


def lane_rounds(cycles: int, decode_steps: int) -> int:
    """The lanes' rounds of a device loop's launches, from the execute table's counters: owner-cycles and plain
    decode steps (a prompt's prefill is not a round). Over the launches' rounds (``loop_rounds``): lanes per round."""
    return cycles + decode_steps

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
    "policy": pl.Utf8(),
    "policy_ratio": pl.Float64(),
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
    "policy_cycles",  # launches of drafting lanes the policy ran as cycles (per owner)
    "policy_decodes",  # ... and as plain decode steps
    "policy_verified",  # proposals those cycles verified (Σ of their verify lengths k, per owner)
    "drafting_stopped",  # sessions that stopped drafting for good: cycling lost where their drain fell due
    "loop_launches",  # programs the device loop launched (cycles and decode steps of owner groups)
    "loop_rounds",  # ... and the rounds they ran (a launch runs 1 or ``launch_rounds``)
    "loop_device_us",  # ... and their device time, µs (each launch's own events on a GPU; its wall time where it runs on the host)
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


# polars dtype -> array.array typecode: columns are typed C arrays (~100 bytes per cycle row), not lists of objects.
_TYPECODES = {pl.Int64: "q", pl.Int32: "i", pl.Float64: "d", pl.Float32: "f", pl.Boolean: "b"}


def _column(dtype: pl.DataType) -> array | list:
    code = _TYPECODES.get(type(dtype))
    return array(code) if code is not None else []  # Utf8: a list of (interned) strings


_NUMPY = {"q": np.int64, "i": np.int32, "d": np.float64, "f": np.float32, "b": np.bool_}


def _numpy(values: array) -> np.ndarray:
    return np.frombuffer(values, dtype=_NUMPY[values.typecode]).copy()  # a copy: the array keeps growing


class ColumnStore:
    """Column-wise accumulator for one table; rows append as dicts of scalars."""

    def __init__(self, schema: Mapping[str, pl.DataType]) -> None:
        self.schema = dict(schema)
        self.columns: dict[str, array | list] = {name: _column(dtype) for name, dtype in self.schema.items()}
        self._checked: set[tuple[str, ...]] = set()  # ``append_rows``' key orders found to split the schema

    def append(self, **row) -> None:
        missing = self.schema.keys() - row.keys()
        extra = row.keys() - self.schema.keys()
        assert not missing and not extra, f"stats row: missing {missing}, extra {extra}"
        for name, value in row.items():
            self.columns[name].append(value)

    def append_rows(self, count: int, shared: Mapping[str, object], **columns: Sequence) -> None:
        """``count`` rows at once: ``shared`` values repeated, ``columns`` one value per row (one
        extend per column instead of one append per value)."""
        # This runs per launch: a split of the columns checked once per pair of key orders (callers have a few),
        # every column's length by one set.
        keys = (*shared, "|", *columns)
        if keys not in self._checked:
            assert len(shared) + len(columns) == len(self.schema) and shared.keys() | columns.keys() == self.schema.keys(), (
                f"stats rows: missing {self.schema.keys() - shared.keys() - columns.keys()}, extra {(shared.keys() | columns.keys()) - self.schema.keys()}, "
                f"both shared and per row {shared.keys() & columns.keys()}"
            )
            self._checked.add(keys)
        assert set(map(len, columns.values())) <= {count}, f"stats rows: columns of another length than {count}"
        stored = self.columns
        for name, value in shared.items():
            column = stored[name]
            # A typed column repeats one typed value (C speed), not a list of Python objects converted one by one.
            column.extend(array(column.typecode, (value,)) * count if type(column) is array else [value] * count)
        for name, values in columns.items():
            column = stored[name]
            if type(column) is not array:
                column.extend(values)
            elif type(values) is list:
                column.fromlist(values)  # half what extend costs from a list
            elif isinstance(values, np.ndarray):
                column.frombytes(values.astype(_NUMPY[column.typecode], copy=False).tobytes())  # one copy, no per-value boxing
            else:
                column.extend(values)

    def extend(self, other: ColumnStore) -> None:
        for name, values in self.columns.items():
            values.extend(other.columns[name])

    def drop_first(self, count: int) -> None:
        for values in self.columns.values():
            del values[:count]

    def __len__(self) -> int:
        return len(next(iter(self.columns.values()), []))

    def frame(self) -> pl.DataFrame:
        """A copy of the rows as a DataFrame (the store keeps growing independently)."""
        data = {name: _numpy(values) if isinstance(values, array) else list(values) for name, values in self.columns.items()}
        return pl.DataFrame(data, schema=self.schema)

    def clear(self) -> None:
        for values in self.columns.values():
            del values[:]


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


@dataclass(frozen=True)
class ExecuteRows:
    """``StatsLog.execute_rows``: columns of the execute rows read, and the next batch id (the cursor)."""

    columns: dict[str, list]
    next_batch: int


DEFAULT_MAX_ROWS = 1 << 19  # per table: ~50 MB of cycle rows, ~110 MB of execute rows at most


def _chosen(choices: Sequence | None) -> int:
    """How many rows the policy chose for (a ``Choice``; None: fixed), as ``StatsLog._choices`` counts them.
    A launch's lanes mostly share one choice: counted by identity then (``list.count`` compares a ``Choice``
    with None through its dataclass ``__eq__``, a Python call per row)."""
    if not choices:
        return 0
    first = choices[0]
    if choices.count(first) == len(choices):
        return len(choices) if first is not None else 0
    return sum(choice is not None for choice in choices)


class StatsLog:
    """Column-wise stats: cycle rows as they happen, one execute row of counter deltas per call.

    A batch's cycle rows are staged and land in ``cycles`` only when its
    execute() succeeds: a failed batch leaves one execute row (``ok`` false,
    ``failed_batches`` 1, no other counts) and no cycle rows, so τ and every
    total count only what callers received. A refused call (validation,
    ``BusyError``) leaves no row and does not advance ``batch_id``; it is
    counted in ``refused`` by API call.

    Bounded: when either table holds more than ``max_rows`` rows (None: no
    bound), the oldest batches are dropped from both tables together (down to
    3/4 of the bound) and counted in ``dropped``; so are batches that ended
    more than ``max_age_s`` seconds ago (None: no age bound), at each
    execute's end, whether or not anyone reads the log. ``drain`` hands every
    row over and empties the log. The lock makes reads safe from any thread.

    ``cycle_table`` False: the cycles table keeps no rows (the counters, and so
    the execute rows, count as before): for a process whose cycle rows nobody
    reads (a server reads the execute rows only), a row per owner and round
    is host work on the decoding thread for nothing.
    """

    def __init__(self, max_rows: int | None = DEFAULT_MAX_ROWS, max_age_s: float | None = None, cycle_table: bool = True) -> None:
        self.cycles = ColumnStore(CYCLE_SCHEMA)
        self.executes = ColumnStore(EXECUTE_SCHEMA)
        self.staged = ColumnStore(CYCLE_SCHEMA)  # the running batch's cycle rows
        self.max_rows, self.max_age_s, self.cycle_table = max_rows, max_age_s, cycle_table
        self.origin = time.perf_counter()
        self.batch_id = 0
        self.cycle_id = 0
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.carried = dict(self.counters)  # counters when the running batch began
        self.started = self.origin
        self.refused: dict[str, int] = {}  # API call -> calls refused (typed error, nothing changed)
        self.dropped = {"cycles": 0, "executes": 0}  # rows discarded by the bound
        self.lock = threading.Lock()

    def refuse(self, call: str) -> None:
        with self.lock:
            self.refused[call] = self.refused.get(call, 0) + 1

    def begin(self) -> None:
        """Counters are NOT reset here: copies made by clone() between calls land in the next row."""
        self.started = time.perf_counter()
        self.cycle_started = self.started
        self.carried = dict(self.counters)
        self.first_cycle_id = self.cycle_id
        self.staged.clear()

    def count(self, rows_name: str, rows: int, row_bytes: int) -> None:
        self.counters[rows_name] += rows
        self.counters[rows_name.replace("rows", "bytes")] += rows * row_bytes

    def cycle_counters(self, n: int, proposals: int, context_rows: int, accepted: list[int], row_bytes: int) -> None:
        """One cycle launch's counts: ``n`` owners whose tokens were kept, ``context_rows`` new context rows
        their draft consumed in all, ``accepted`` [n] their accepted counts."""
        k = self.counters
        k["target_verify_calls"] += 1
        k["target_verify_forwards"] += 1
        k["draft_forwards"] += 1
        k["static_draft_forwards"] += 1
        k["warmed_context_tokens"] += context_rows
        k["cycles"] += n
        k["proposed"] += n * proposals
        k["accepted"] += sum(accepted)
        bonuses = accepted.count(proposals)
        k["bonuses"] += bonuses
        k["rejected"] += n - bonuses
        self.count("hidden_rows_d2d", n * (proposals + 1), row_bytes)

    def _shared(self, owners: int, mode: str, draft_ms: float, verify_ms: float) -> dict:
        end = time.perf_counter()
        host_ms = max(0.0, (end - self.cycle_started) * 1000.0 - draft_ms - verify_ms)
        self.cycle_started = end
        shared = dict(batch_id=self.batch_id, cycle_id=self.cycle_id, owners=owners, mode=mode)
        self.cycle_id += 1
        return shared | dict(draft_ms=draft_ms, verify_ms=verify_ms, host_ms=host_ms, end_ms=(end - self.origin) * 1000.0)

    def cycle_rows(
        self, sessions: Sequence[Session], modes: list[str], context_rows, accepted, emitted, positions, proposals: int,
        draft_ms: float, verify_ms: float, owners: int | None = None, choices: Sequence | None = None,
    ) -> None:
        """One row per owner of one call whose tokens reached the caller, as columns (arrays or lists, one
        value per session): its ``mode``, the ``context_rows`` its draft consumed, ``accepted``, the tokens
        ``emitted`` to the caller and the anchor's ``positions``; ``owners``: the call's owners (default:
        the rows); ``choices``: per row the policy's ``Choice`` (None: fixed)."""
        if not self.cycle_table:
            chosen = _chosen(choices)
            self.counters["policy_cycles"] += chosen
            self.counters["policy_verified"] += proposals * chosen
            return
        count = len(sessions)
        policy, ratio, chosen = self._choices(choices, count, "policy_cycles")
        self.counters["policy_verified"] += proposals * chosen
        shared = self._shared(owners or count, DYNAMIC if DYNAMIC in modes else STATIC, draft_ms, verify_ms)
        del shared["mode"]  # per row
        self.staged.append_rows(
            count,
            shared | dict(proposed=proposals),
            mode=modes,
            session=[s.id for s in sessions],
            context_rows=context_rows,
            accepted=accepted,
            bonus=[a == proposals for a in accepted],
            emitted=emitted,
            position=positions,
            temperature=[s.sampling.temperature for s in sessions],
            policy=policy,
            policy_ratio=ratio,
        )

    def _choices(self, choices: Sequence | None, count: int, counter: str) -> tuple[list[str], list[float], int]:
        """The policy columns of ``count`` rows (``FIXED`` and NaN where no choice was made) and how many
        rows the policy chose for (counted in ``counter``). A launch's lanes mostly share one choice:
        then the columns are that value repeated."""
        first = choices[0] if choices else None
        if not choices or choices.count(first) == count:  # every row the same choice (an equal one: the same columns)
            chosen = count if first is not None else 0
            policy, ratio = ([FIXED] * count, [math.nan] * count) if first is None else ([first.why] * count, [float(first.ratio)] * count)
        else:
            chosen = _chosen(choices)
            policy = [FIXED if choice is None else choice.why for choice in choices]
            ratio = [math.nan if choice is None else float(choice.ratio) for choice in choices]
        self.counters[counter] += chosen
        return policy, ratio, chosen

    def target_row(self, s: Session, position: int, target_ms: float) -> None:
        """A token the target produced outside verify (after a prompt/replay or in plain decode)."""
        self.target_rows([s], [position], target_ms)

    def target_rows(self, sessions: Sequence[Session], positions: Sequence[int], target_ms: float) -> None:
        """Tokens the target produced outside verify, one row per session in turn (its token at its
        position, one call of ``target_ms`` each: a cycle id each, one owner), made at one instant: the
        first carries the host time since the previous row, the others none (no time passed between
        them); one append for them all."""
        if not self.cycle_table:
            return
        count = len(sessions)
        shared = self._shared(1, TARGET, 0.0, target_ms)  # the first row's id and host time
        first, host_ms = shared.pop("cycle_id"), shared.pop("host_ms")
        self.cycle_id += count - 1
        self.staged.append_rows(
            count,
            shared | dict(context_rows=0, proposed=0, accepted=0, bonus=False, emitted=1),
            cycle_id=range(first, first + count),
            host_ms=[host_ms] + [max(0.0, -target_ms)] * (count - 1),
            session=[s.id for s in sessions],
            position=positions,
            temperature=[s.sampling.temperature for s in sessions],
            policy=[FIXED] * count,
            policy_ratio=[math.nan] * count,
        )

    def decode_rows(
        self, sessions: list[Session], device_ms: float, owners: int | None = None, choices: Sequence | None = None,
        positions: Sequence[int] | None = None,
    ) -> None:
        """One plain decode step (``target_decode_n``) of ``sessions``: a token each, at its frontier + 1.

        ``owners``: the launch's owners (default: the sessions), finished ones whose token is discarded included;
        ``choices``: per session the policy's ``Choice`` (None: fixed); ``positions``: each step's frontier
        (default: the sessions' frontiers now)."""
        self.counters["target_decode_steps"] += len(sessions)
        if not self.cycle_table:
            self.counters["policy_decodes"] += _chosen(choices)
            return
        policy = self._choices(choices, len(sessions), "policy_decodes")[:2]
        positions = [s.frontier for s in sessions] if positions is None else list(positions)
        self._target_tokens(sessions, positions, device_ms, owners, policy)

    def _target_tokens(
        self, sessions: list[Session], positions: list[int], target_ms: float, owners: int | None = None, policy: tuple[list, list] | None = None
    ) -> None:
        """One row per session (at its position): a token of the target alone, from one launch of ``target_ms``."""
        count = len(sessions)
        shared = self._shared(owners or count, TARGET, 0.0, target_ms)
        why, ratio = policy if policy is not None else ([FIXED] * count, [math.nan] * count)
        self.staged.append_rows(
            count,
            shared | dict(context_rows=0, proposed=0, accepted=0, bonus=False, emitted=1),
            session=[s.id for s in sessions],
            position=positions,
            temperature=[s.sampling.temperature for s in sessions],
            policy=why,
            policy_ratio=ratio,
        )

    def commit(self, inputs: int, target_tokens: int, pending_decode: bool) -> None:
        """The batch succeeded: its cycle rows and one execute row land."""
        with self.lock:
            self.cycles.extend(self.staged)
            self._end_execute(inputs, target_tokens, pending_decode, True)
        self.staged.clear()

    def fail(self, inputs: int, target_tokens: int) -> None:
        """The batch failed after mutating: its cycle rows and counts are dropped, one ``ok`` false row lands."""
        self.staged.clear()
        self.counters = self.carried | {"failed_batches": self.carried["failed_batches"] + 1}
        self.cycle_id = self.first_cycle_id
        with self.lock:
            self._end_execute(inputs, target_tokens, False, False)

    def _end_execute(self, inputs: int, target_tokens: int, pending_decode: bool, ok: bool) -> None:
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
        if self.max_rows is not None and max(len(self.cycles), len(self.executes)) > self.max_rows:
            self._trim(self.max_rows * 3 // 4)
        if self.max_age_s is not None:
            self._expire((end - self.origin) * 1000.0 - self.max_age_s * 1000.0)

    def _trim(self, keep: int) -> None:
        """Drop the oldest batches (both tables, whole batches) until each table holds <= ``keep`` rows."""
        cutoff = -1  # drop every batch_id <= cutoff
        for table in (self.cycles, self.executes):
            if len(table) > keep:
                cutoff = max(cutoff, table.columns["batch_id"][len(table) - keep - 1])
        self._drop_through(cutoff)

    def _expire(self, before_ms: float) -> None:
        """Drop the batches whose execute ended before ``before_ms`` (execute rows end in order)."""
        ended = bisect_left(self.executes.columns["end_ms"], before_ms)
        if ended:
            self._drop_through(self.executes.columns["batch_id"][ended - 1])

    def _drop_through(self, cutoff: int) -> None:
        """Drop every row of the batches with batch_id <= ``cutoff`` from both tables, counted in ``dropped``."""
        for name, table in (("cycles", self.cycles), ("executes", self.executes)):
            count = bisect_right(table.columns["batch_id"], cutoff)  # batch ids never decrease
            table.drop_first(count)
            self.dropped[name] += count

    def execute_rows(self, since: int | None, columns: Sequence[str]) -> ExecuteRows:
        """Copies of ``columns`` of the execute rows with ``batch_id >= since`` (None: no rows), and the
        batch id the next execute will get: a reader keeps it as its cursor for the next call.

        Rows found by batch id, so a bound dropping old rows, or a drain, never makes a row count
        twice; rows dropped or drained before a reader reads them are not returned.
        """
        with self.lock:
            if since is None:
                return ExecuteRows({name: [] for name in columns}, self.batch_id)
            start = bisect_left(self.executes.columns["batch_id"], since)
            return ExecuteRows({name: list(self.executes.columns[name][start:]) for name in columns}, self.batch_id)

    def frames(self) -> tuple[pl.DataFrame, pl.DataFrame]:
        """(cycles, executes) as DataFrames (copies)."""
        with self.lock:
            return self.cycles.frame(), self.executes.frame()

    def drain(self) -> tuple[pl.DataFrame, pl.DataFrame]:
        """(cycles, executes) as DataFrames, and empty both tables."""
        with self.lock:
            frames = self.cycles.frame(), self.executes.frame()
            self.cycles.clear()
            self.executes.clear()
        return frames
