"""The decode loop on the device: per-row state, pinned staging, one program per owner group.

A *program* is what one launch does for ``n`` owners at consecutive rows
``first .. first+n-1`` (docs/design.md §5, "The loop on the device"):

- ``cycle``: ``draft_n`` → ``target_verify_n`` → tap copy into the context
  pool → ``verify_argmax_n`` / ``verify_sample_n`` → device-side update of
  the owners' anchor, draft position and frontier; a cycle of verify length
  ``k`` (``Key.proposals``, one of ``Dims.verify_proposals``) verifies the
  first k of the draft's P proposals (``target_verify_{n}_p{k}``...);
- ``decode``: ``target_decode_n`` → the target's token (the argmax, or the
  ``sample`` graph) → the tap into the context pool at the owner's pending
  count (``frontier - draft``, while below B) → anchor and frontier. A
  drafting session can so decode plainly between cycles (``runtime.policy``)
  without losing its draft's context: its next cycle consumes those rows.

Every program reads and writes only memory allocated once (this module's
row-indexed state, the context pool, the backend's pools), so it is captured
(thread-local mode) as ONE CUDA graph when the backend is ``capturable`` and
replayed from then on; a capture that fails turns capture off for the loop,
which then runs every program eagerly (``device.CaptureFallback``: logged once).
How a program finds its owners' rows depends on the backend:

- row-indexed backends (``Backend.row_indexed``: the torch fast path) take the
  rows as a device tensor (``slots``, one per owner, uploaded before each
  launch), so one program per (kind, sampled, padded owner count) serves any
  set of rows. Owner counts are padded to ``owner_buckets``; padded lanes
  point at a scratch row past the sessions' rows, whose positions the Triton
  glue never moves and the torch glue resets after every round: their writes
  land nowhere anyone reads. Every program
  is captured at start-up (``prepare``), none in steady state. Their gathers and
  scatters around the graphs run as ``kernels.loop_ops``' three Triton kernels
  (``glue``; the torch ops of ``_cycle`` / ``_decode`` are the reference they
  are checked against, and what every other backend runs);
- the others bind ``n`` consecutive rows ``first .. first+n-1``: one program
  per (kind, sampled, n, first), captured on first use.

A program may run its kind several times back to back (``Key.rounds``: 1 or
``most_rounds``), each round reading the state the last one left: the host
then plans, launches and reads once per ``rounds`` rounds
(``runtime.launches``).

A launch ends with an async copy of the owners' verdict records (accepted,
next token, proposals; one per round) into a pinned host ring entry and an
event; ``read`` waits for that event only. Nothing else in a launch synchronizes the host, so
the executor can launch cycle k+1 before reading cycle k
(``runtime.launches``).

Row-indexed state (``R`` = pool rows, int64 unless said):

| tensor | shape | meaning |
| --- | --- | --- |
| anchor | [R] | token AT the frontier (the next cycle's anchor) |
| frontier | [R] | first position not in the target cache |
| draft | [R] | first position not in the draft cache (the context rows start here) |
| top_k | [R] | sampling |
| seed | [R, 3] | sampling (``sampling.seed_parts``); a choice's noise is keyed by its position, read on the device |
| temperature, top_p | [R] float32 | sampling |
| record | [rounds, n, P+2] per owner count n | per launch and round: accepted, next token, proposals d_1..d_P |

``R`` counts the scratch row on row-indexed backends. The host stages
anchor/frontier/draft/sampling once per execute (pinned
memory, one async copy per tensor group); within an execute the device
state runs ahead of what the host has read, so owners joining a running
execute are staged on their own (``stage_more``: their columns only,
scattered on the device). On CPU the same code runs
eagerly and "pinned" buffers are plain tensors.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from dflash_trt.errors import InputError
from dflash_trt.export import contract as c
from dflash_trt.export.sampling import choose_op
from dflash_trt.runtime.backends.base import Backend
from dflash_trt.runtime.cycles import sampling_row, sampling_rows
from dflash_trt.runtime.device import CaptureFallback
from dflash_trt.runtime.sessions import ContextPool
from dflash_trt.runtime.timing import Timeline

CYCLE, DECODE = "cycle", "decode"  # program kinds
GLUES = ("auto", "triton", "torch")  # ``DeviceLoop(glue=)``
ANCHOR, FRONTIER, DRAFT, TOP_K = range(4)  # rows of the int state
TEMPERATURE, TOP_P = range(2)  # rows of the float state
ACCEPTED_COLUMN, NEXT_COLUMN, PROPOSALS_COLUMN = 0, 1, 2  # columns of the record
STAGING_DEPTH = 4  # ``stage_more`` uploads that may wait on the stream at once (``Staging``)


def owner_buckets(max_owners: int) -> tuple[int, ...]:
    """The padded owner counts of row-indexed programs: powers of two below ``max_owners``, and it.

    >>> owner_buckets(6)
    (1, 2, 4, 6)
    """
    buckets, n = [], 1
    while n < max_owners:
        buckets.append(n)
        n *= 2
    return (*buckets, max_owners)


@functools.cache
def padded(owners: int, max_owners: int) -> int:
    """The smallest bucket holding ``owners`` lanes (cached: asked a few times per launch, of a few values)."""
    assert 1 <= owners <= max_owners, (owners, max_owners)
    return next(b for b in owner_buckets(max_owners) if b >= owners)


@dataclass(frozen=True)
class Key:
    """One program -> one CUDA graph: (kind, sampled, n, first row, verify length, rounds); ``first`` is None
    when the rows are a device input (row-indexed backends; ``n`` is then a padded count); ``proposals``: the
    proposals a cycle verifies (one of ``Dims.verify_proposals``; 0 for a decode step); ``rounds``: how many
    times the program runs its kind, each round after the last."""

    kind: str
    sampled: bool
    owners: int
    first: int | None
    proposals: int = 0
    rounds: int = 1


def describe(key: Key) -> str:
    """A program, for messages: its kind, owner count, (row-bound) first row and (a cycle's) verify length."""
    where = "" if key.first is None else f" at row {key.first}"
    verifying = f", verifying {key.proposals} proposals" if key.proposals else ""
    return f"{key.kind} program for {key.owners} owners{where}{verifying}" + (f", {key.rounds} rounds" if key.rounds > 1 else "")


class MirrorPart(NamedTuple):
    """One tensor of a ``Mirrors`` block: the device view, its host twin, the twin as numpy (same memory)."""

    device: torch.Tensor
    host: torch.Tensor
    array: np.ndarray


class Mirrors:
    """Device tensors and their host twins (pinned memory on CUDA) in one block: one device allocation, one
    pinned twin, ONE async upload for them all. What a launch reads together is staged together: each copy
    is a CUDA call, and in a busy serving process each one costs the serving thread tens of microseconds of
    host time.

    ``parts``: name -> (shape, dtype); each part starts 16-byte aligned. On CPU both sides are the same memory.
    """

    ALIGN = 16

    def __init__(self, device: torch.device, **parts: tuple[tuple[int, ...], torch.dtype]) -> None:
        offsets, total = {}, 0
        for name, (shape, dtype) in parts.items():
            total = -(-total // self.ALIGN) * self.ALIGN
            offsets[name] = total
            total += math.prod(shape) * dtype.itemsize
        self.block = torch.zeros((total,), dtype=torch.uint8, device=device)
        self.pinned, self.host_block = host_buffer((total,), torch.uint8, device) if device.type == "cuda" else (None, self.block)
        self.parts: dict[str, MirrorPart] = {}
        for name, (shape, dtype) in parts.items():
            span = slice(offsets[name], offsets[name] + math.prod(shape) * dtype.itemsize)
            host = self.host_block[span].view(dtype).view(shape)
            self.parts[name] = MirrorPart(self.block[span].view(dtype).view(shape), host, host.numpy())

    def upload(self, stream) -> None:
        """Every part host -> device in one copy, enqueued on ``stream`` (a device-layer Stream; no host sync)."""
        if self.pinned is not None:
            from dflash_trt.runtime.device import copy_async

            copy_async(self.block.data_ptr(), self.pinned.ptr, self.pinned.nbytes, stream)

    def close(self) -> None:
        if self.pinned is not None:
            self.pinned.close()
            self.pinned = None


class Mirror(Mirrors):
    """One device tensor and its host twin (pinned memory on CUDA): ``Mirrors`` of a single part, whose
    views are ``device``, ``host`` and ``array``; ``pinned.ptr`` is the twin's first byte."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(device, value=(shape, dtype))
        self.device, self.host, self.array = self.parts["value"]


class Staging:
    """Uploads of a ``Mirrors`` block whose host side is rewritten before earlier uploads ran.

    An async copy reads its pinned source when the stream reaches it, not when it is queued: launches
    queued back to back (the prefills of one execute, no host sync between them) would each upload the
    last one's inputs. Each upload therefore copies the host twin into the next of ``depth`` pinned
    buffers and queues the copy from there; a buffer is rewritten only after its previous copy ran (its
    event), a wait that needs ``depth`` launches queued ahead. On CPU the twin is the device memory: nothing
    to do."""

    def __init__(self, mirrors: Mirrors, depth: int) -> None:
        self.mirrors, self.next = mirrors, 0
        self.buffers, self.events = [], [None] * depth
        if mirrors.pinned is not None:
            from dflash_trt.runtime.device import PinnedBuffer

            self.buffers = [PinnedBuffer((mirrors.pinned.nbytes,), torch.uint8) for _ in range(depth)]
        self.twin, self.arrays = mirrors.host_block.numpy(), [buffer.numpy() for buffer in self.buffers]

    def upload(self, stream) -> None:
        """The host twin -> device, queued on ``stream`` from a pinned copy no queued upload still reads."""
        if not self.buffers:
            return
        from dflash_trt.runtime import device

        k, self.next = self.next, (self.next + 1) % len(self.buffers)
        if self.events[k] is not None:
            self.events[k].synchronize()  # host wait: only with ``depth`` uploads queued ahead of this one
        else:
            self.events[k] = device.Event(timing=False)
        source = self.buffers[k]
        self.arrays[k][:] = self.twin
        device.copy_async(self.mirrors.block.data_ptr(), source.ptr, source.nbytes, stream)
        self.events[k].record(stream)

    def close(self) -> None:
        for event in self.events:
            if event is not None:
                event.close()
        for buffer in self.buffers:
            buffer.close()
        self.buffers, self.events = [], [None] * len(self.events)


# Up to this many owners' sampling columns are written one value at a time (``put_sampling``): a request joining
# a running execute stages one or two rows, and five arrays built for them cost a serving thread ~20 µs.
FEW_SAMPLINGS = 4


def check_glue(glue: str, backend: Backend, field: str = "glue") -> None:
    """``glue`` names one of ``GLUES`` and, when ``"triton"``, one ``backend``'s loop can run: its programs take
    their rows as slots (row-indexed) and its device runs Triton (CUDA, or the CPU under Triton's interpreter).
    InputError naming ``field`` otherwise."""
    if glue not in GLUES:
        raise InputError(f"{field} must be one of {GLUES}, got {glue!r}")
    if glue != "triton":
        return
    if not getattr(backend, "row_indexed", False):
        raise InputError(f"{field}='triton' needs a row-indexed backend (the torch backend's fast or exact kernels), got the {backend.name} backend")
    if backend.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise InputError(f"{field}='triton' runs Triton kernels: it needs a CUDA device (or Triton's interpreter, TRITON_INTERPRET=1), "
                         f"got device {backend.device}")


def put_sampling(ints: np.ndarray, seeds: np.ndarray, floats: np.ndarray, at, samplings: list) -> None:
    """Owners' sampling columns into a state block's host arrays (ints [4, R], seeds [R, S], floats [2, R]) at
    columns ``at`` (rows, or a slice), from the sample graph's feeds (``cycles.sampling_rows``: one builder);
    a few owners' as single values of the same types (``sampling_row``)."""
    if len(samplings) <= FEW_SAMPLINGS:
        rows = range(at.start, at.start + len(samplings)) if isinstance(at, slice) else at
        for row, s in zip(rows, samplings):
            ints[TOP_K, row], seeds[row], floats[TEMPERATURE, row], floats[TOP_P, row] = sampling_row(s)
        return
    sampling = sampling_rows(samplings, [0] * len(samplings))
    ints[TOP_K, at] = sampling[c.TOP_K]
    seeds[at] = sampling[c.SEED]
    floats[TEMPERATURE, at] = sampling[c.TEMPERATURE]
    floats[TOP_P, at] = sampling[c.TOP_P]


def host_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> tuple[object | None, torch.Tensor]:
    """(owner, CPU tensor view): page-locked memory of the device layer for CUDA, a plain tensor for CPU."""
    if device.type != "cuda":
        return None, torch.zeros(shape, dtype=dtype)
    from dflash_trt.runtime.device import PinnedBuffer

    pinned = PinnedBuffer(shape, dtype)
    return pinned, pinned.as_tensor()


def capture_graph(device: torch.device, stream: torch.cuda.Stream, pool, work) -> torch.cuda.CUDAGraph:
    """``work()`` as a CUDA graph on ``stream`` (intermediates in the graph pool ``pool``), captured in
    thread-local mode: CUDA calls of other threads (a server's, a logger's) stay legal meanwhile and
    cannot invalidate it. The capture is always ended, also when the work fails inside it, and the
    stream restored; the failure propagates (the caller falls back to eager)."""
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize(device)  # host sync: before a capture only
    with torch.cuda.stream(stream):
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            work()
        finally:
            graph.capture_end()
    return graph


@dataclass
class Launch:
    """One launched program: its live owners, the ring entry its record lands in, when it finished."""

    key: Key
    owners: int
    entry: int
    started: object  # device Event (CUDA) or host seconds (CPU)
    ended: object


class RowRange:
    """A program's owners as ``n`` consecutive rows: views of the row-indexed state."""

    def __init__(self, first: int, n: int) -> None:
        self.first, self.n, self.index = first, n, slice(first, first + n)

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor[self.index]

    def put(self, tensor: torch.Tensor, values: torch.Tensor) -> None:
        view = tensor[self.index]
        if view.data_ptr() != values.data_ptr():  # values taken as this view were written in place
            view.copy_(values)

    def run(self, backend: Backend, graph: str, feeds: dict) -> dict:
        return backend.run(graph, feeds, self.first)

    def ids(self, device: torch.device) -> torch.Tensor:
        """The rows as a device tensor [n] (a kernel, so it is captured with the program)."""
        return torch.arange(self.first, self.first + self.n, device=device)


class RowSlots:
    """A program's owners as a device tensor of rows (``slots`` [n]): gathers and scatters."""

    def __init__(self, slots: torch.Tensor) -> None:
        self.slots, self.n = slots, slots.shape[0]

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.index_select(0, self.slots)

    def put(self, tensor: torch.Tensor, values: torch.Tensor) -> None:
        tensor.index_copy_(0, self.slots, values.to(tensor.dtype))

    def run(self, backend: Backend, graph: str, feeds: dict) -> dict:
        return backend.run_at(graph, feeds, self.slots)

    def ids(self, device: torch.device) -> torch.Tensor:
        return self.slots


class DeviceLoop:
    """Per-row device state, staging and the programs of one executor (see the module docstring)."""

    def __init__(
        self, backend: Backend, dims: c.Dims, context: ContextPool, rows: int, graphs: bool, rounds: int = 1, lag: int = 1, glue: str = "auto"
    ) -> None:
        """``rows``: the sessions' rows (a scratch row follows on row-indexed backends: the context pool
        and the backend's pools hold it); ``graphs``: capture programs where capturable; ``rounds``: the
        most rounds a launch runs (``most_rounds``); ``lag``: the launches a session keeps queued beyond
        the one read (``runtime.launches``); ``glue``: how row-indexed programs read and write their owners'
        state around their graphs, ``"triton"`` (``kernels.loop_ops``: three launches) or ``"torch"`` (~20
        small torch ops), the same state either way; ``"auto"``: Triton on CUDA."""
        check_glue(glue, backend)
        self.backend, self.dims, self.context = backend, dims, context
        self.device = backend.device
        self.row_indexed = bool(getattr(backend, "row_indexed", False))
        self.scratch = rows if self.row_indexed else None
        self.rows = rows + self.row_indexed
        stream = getattr(backend, "stream", None)
        self.stream = stream.device_stream if stream is not None and self.device.type == "cuda" else None
        self.graphs = bool(graphs and backend.capturable and self.stream is not None)
        self.most_rounds = rounds
        width, max_owners, most = dims.proposals + 2, dims.max_owners, self.most_rounds
        # At most lag + 1 launches per session are unread at once (the one read, the lag queued): ring entries never collide.
        self.ring = (lag + 1) * rows + 2
        self.next_entry = 0
        with self.on_stream():
            # The per-row state staged once per execute: one block, one upload.
            self.state = Mirrors(
                self.device, ints=((4, self.rows), torch.int64), seeds=((self.rows, c.SEED_PARTS), torch.int64), floats=((2, self.rows), torch.float32)
            )
            self.ints, self.seeds, self.floats = self.state.parts.values()
            self.floats.device[TOP_P].fill_(1.0)  # the scratch row samples like a greedy session
            self.records = {n: torch.zeros((most, n, width), dtype=torch.int64, device=self.device) for n in range(1, max_owners + 1)}
            # Per ring entry, one launch's records [rounds, n, P+2] (n: its padded owner count) from the first element.
            self.reads = host_buffer((self.ring, most * max_owners * width), torch.int64, self.device)
            self.read_rows = self.reads[1].numpy()  # the same memory as numpy: a read copies without a torch op
            # Row-indexed programs read their rows from here (one tensor per padded count, stable addresses).
            self.slots = {n: torch.full((n,), self.scratch or 0, dtype=torch.int64, device=self.device) for n in owner_buckets(max_owners)}
            self.staged_slots = Mirror((self.ring, max_owners), torch.int64, self.device) if self.row_indexed else None
            # Owners joining a running execute (``stage_more``): their rows and columns, scattered on the device.
            self.joining = Mirrors(
                self.device, rows=((self.rows,), torch.int64), ints=((4, self.rows), torch.int64),
                seeds=((self.rows, c.SEED_PARTS), torch.int64), floats=((2, self.rows), torch.float32),
            )
            self.joining_staging = Staging(self.joining, STAGING_DEPTH)
        self.staged_sampling: list = [None] * self.rows  # per row: the Sampling its columns hold (``stage``)
        self.glue = self._glue(glue)
        self.captured: dict[Key, torch.cuda.CUDAGraph] = {}
        self.fallback = CaptureFallback("the device loop")
        self.memory = torch.cuda.graph_pool_handle() if self.graphs else None
        self.timeline = Timeline(self.stream)

    def _glue(self, glue: str):
        """``LoopOps`` over this loop's state where the Triton glue runs (row-indexed programs), else None."""
        if glue == "auto":
            glue = "triton" if self.row_indexed and self.device.type == "cuda" else "torch"
        if glue == "torch":
            return None
        from dflash_trt.runtime.kernels.loop_ops import LoopOps  # imports triton

        return LoopOps(self.ints.device, self.floats.device, self.seeds.device, self.context.taps)

    @contextmanager
    def on_stream(self) -> Iterator[None]:
        """Torch work on the backend's stream, ordered after the caller's and before its later work."""
        stream = getattr(self.backend, "stream", None)
        with stream.scope() if stream is not None and self.device.type == "cuda" else nullcontext():
            yield

    @contextmanager
    def running(self) -> Iterator[None]:
        """One execute's staging, launches and reads: on the backend's stream (entered once, not per
        launch); device idle gaps are counted between the launches inside."""
        try:
            with self.on_stream():
                yield
        except BaseException:
            self.abandon()
            raise
        finally:
            self.timeline.end_run()

    # ------------------------------------------------------------------ start-up

    def programs(self, sampled: tuple[bool, ...]) -> list[Key]:
        """Every program a row-indexed loop can launch (none to list otherwise: keys follow the rows)."""
        if not self.row_indexed:
            return []
        programs = [(CYCLE, k) for k in self.dims.verify_proposals] + [(DECODE, 0)]
        rounds, buckets = sorted({1, self.most_rounds}), owner_buckets(self.dims.max_owners)
        return [Key(kind, s, n, None, k, r) for kind, k in programs for s in sampled for n in buckets for r in rounds]

    def prepare(self, keys: list[Key]) -> None:
        """Capture ``keys`` now (start-up), each run on the scratch row only: no capture, and no kernel
        specialization of these programs, is left for steady state. Host syncs (captures)."""
        if not self.graphs:
            return
        with self.on_stream(), self.backend.plain_runs():
            for key in keys:
                if key not in self.captured and self.graphs:
                    self.slots[key.owners].fill_(self.scratch)
                    self._program(key)  # the warm-up the capture needs (lazy inits, Triton compiles)
                    self._keep(key, self.fallback.capture(describe(key), lambda: self._capture(key)))

    # ------------------------------------------------------------------ staging

    def stage(self, rows: list[int], anchors: list[int], frontiers: list[int], drafts: list[int], samplings: list) -> None:
        """Per owner of this execute (columns, one value per owner): its row, anchor, frontier, draft
        position and sampling -> device (async; inside ``running``).

        A row's sampling columns are rebuilt only when its ``Sampling`` is not the one staged there last
        (a value, never changed in place: the same object means the same columns); nothing else writes them."""
        ints, floats, staged = self.ints.array, self.floats.array, self.staged_sampling
        ints[:TOP_K, rows] = np.array([anchors, frontiers, drafts], dtype=np.int64)  # ANCHOR, FRONTIER, DRAFT
        fresh = [(row, s) for row, s in zip(rows, samplings) if staged[row] is not s]
        if fresh:
            put_sampling(ints, self.seeds.array, floats, [row for row, _ in fresh], [s for _, s in fresh])
            for row, s in fresh:
                staged[row] = s
        self.state.upload(self.stream)

    def stage_more(self, rows: list[int], anchors: list[int], frontiers: list[int], drafts: list[int], samplings: list) -> None:
        """``stage`` for owners joining a running execute (inside ``running``, stream-ordered before their
        first launch). The state block cannot go up whole: the device's columns of the owners running are
        ahead of the host's. These owners' columns go up in a block of their own and are scattered into the
        state on the device (a few small kernels). The host's twin of the state keeps its old sampling
        columns for these rows, so the next ``stage`` rebuilds theirs."""
        n, joining = len(rows), self.joining.parts
        joining["rows"].array[:n] = rows
        ints = joining["ints"].array
        ints[:TOP_K, :n] = np.array([anchors, frontiers, drafts], dtype=np.int64)  # ANCHOR, FRONTIER, DRAFT
        put_sampling(ints, joining["seeds"].array, joining["floats"].array, slice(0, n), samplings)
        for row in rows:
            self.staged_sampling[row] = None
        self.joining_staging.upload(self.stream)
        at = joining["rows"].device[:n]
        self.ints.device.index_copy_(1, at, joining["ints"].device[:, :n])
        self.seeds.device.index_copy_(0, at, joining["seeds"].device[:n])
        self.floats.device.index_copy_(1, at, joining["floats"].device[:, :n])

    def move_draft(self, row: int, position: int) -> None:
        """Row ``row``'s draft position on the device (stream-ordered after its launches so far, before its next),
        and in the host's twin: a running owner whose pending context the host drained (``Executor._end``)."""
        self.ints.array[DRAFT, row] = position
        self.ints.device[DRAFT, row] = position

    # ------------------------------------------------------------------ launches

    def launch(self, kind: str, sampled: bool, rows: list[int], proposals: int = 0, rounds: int = 1) -> Launch:
        """Run one program over the owners at ``rows`` (consecutive on row-bound backends), a cycle
        verifying ``proposals`` (default P; 0 for a decode step), ``rounds`` times (1 or ``most_rounds``):
        replay its graph (capturing first if new), then queue its records' copy to the host (inside
        ``running``). No host sync, except around a capture (first use, row-bound backends only)."""
        if kind == CYCLE and not proposals:
            proposals = self.dims.proposals
        assert kind == DECODE and not proposals or proposals in self.dims.verify_proposals, (kind, proposals)
        assert rounds in (1, self.most_rounds), (rounds, self.most_rounds)
        entry, self.next_entry = self.next_entry, (self.next_entry + 1) % self.ring
        key = self._key(kind, sampled, rows, entry, proposals, rounds)
        started = self.timeline.mark()
        graph = self.captured.get(key)
        if graph is not None:
            graph.replay()
        elif self.graphs:
            with self.backend.plain_runs():
                self._program(key)  # a real cycle, and the warm-up the capture needs
                self._keep(key, self.fallback.capture(describe(key), lambda: self._capture(key)))
        else:
            self._program(key)
        self._download(key, len(rows), entry)
        return Launch(key, len(rows), entry, started, self.timeline.mark())

    def _key(self, kind: str, sampled: bool, rows: list[int], entry: int, proposals: int, rounds: int) -> Key:
        """The program of these rows; on row-indexed backends also enqueues the upload of its slots."""
        if not self.row_indexed:
            assert rows == list(range(rows[0], rows[0] + len(rows))), f"rows must be consecutive, got {rows}"
            return Key(kind, sampled, len(rows), rows[0], proposals, rounds)
        n = padded(len(rows), self.dims.max_owners)
        staged = self.staged_slots.array[entry]
        staged[: len(rows)] = rows
        staged[len(rows) : n] = self.scratch
        if self.staged_slots.pinned is None:
            self.slots[n].copy_(self.staged_slots.host[entry, :n])
        else:
            from dflash_trt.runtime.device import copy_async

            copy_async(self.slots[n].data_ptr(), self.staged_slots.pinned.ptr + entry * staged.nbytes, n * 8, self.stream)
        return Key(kind, sampled, n, None, proposals, rounds)

    def read(self, launch: Launch) -> tuple[np.ndarray, float]:
        """Host sync (the launch's end event): its live owners' records [rounds, n, P+2] and its device ms."""
        self.timeline.wait(launch)
        key, width = launch.key, self.dims.proposals + 2
        entry = self.read_rows[launch.entry, : key.rounds * key.owners * width].reshape(key.rounds, key.owners, width)
        return entry[:, : launch.owners].copy(), self.timeline.account(launch)

    def _download(self, key: Key, owners: int, entry: int) -> None:
        """The launch's records [rounds, n, P+2] -> host ring entry ``entry`` (async on CUDA: pinned memory, no host
        sync), in one copy: up to the last round's last live owner (the padded lanes' rows of earlier rounds ride along)."""
        pinned, host = self.reads
        records = self.records[key.owners][: key.rounds]  # [rounds, n, P+2], contiguous
        rows = (key.rounds - 1) * key.owners + owners
        if pinned is None:
            host[entry, : rows * records.shape[2]] = records.reshape(-1)[: rows * records.shape[2]]
            return
        from dflash_trt.runtime.device import copy_async

        row = records.shape[2] * records.element_size()
        copy_async(pinned.ptr + entry * host[0].numel() * records.element_size(), records.data_ptr(), rows * row, self.stream)

    def _capture(self, key: Key) -> torch.cuda.CUDAGraph:
        return capture_graph(self.device, self.backend.stream.torch, self.memory, lambda: self._program(key))

    def _keep(self, key: Key, graph: torch.cuda.CUDAGraph | None) -> None:
        """A captured program is replayed from now on; a capture that failed (None) turns capture off
        for the loop: every program runs eagerly (``CaptureFallback`` logged it once)."""
        if graph is None:
            self.graphs = False
        else:
            self.captured[key] = graph

    # ------------------------------------------------------------------ programs

    def _program(self, key: Key) -> None:
        rows = RowRange(key.first, key.owners) if key.first is not None else RowSlots(self.slots[key.owners])
        if self.glue is not None:
            run = self._glued_cycle if key.kind == CYCLE else self._glued_decode
        else:
            run = self._cycle if key.kind == CYCLE else self._decode
        with torch.no_grad():
            for record in self.records[key.owners][: key.rounds]:
                run(key, rows, record)
                if self.row_indexed and self.glue is None:
                    self.ints.device[:, self.scratch] = 0  # padded lanes' state: back to an empty row (the Triton glue never moves it)

    def _cycle(self, key: Key, rows: RowRange | RowSlots, record: torch.Tensor) -> None:
        """draft_n → target_verify_n (the first k = ``key.proposals`` proposals) → taps → verdict →
        anchors/positions, all on the device; the verdict into ``record`` [n, P+2]."""
        n, k = rows.n, key.proposals or self.dims.proposals
        anchor, start = rows.take(self.ints.device[ANCHOR]), rows.take(self.ints.device[FRONTIER])
        ctx_start = rows.take(self.ints.device[DRAFT])
        context = rows.take(self.context.taps)  # [n, B, W]
        feeds = {c.CTX_TAPS: context, c.CTX_START: ctx_start, c.CTX_COUNT: start - ctx_start, c.ANCHOR: anchor}
        proposals = rows.run(self.backend, c.graph_name(c.DRAFT, n), feeds)[c.PROPOSALS]  # [n, P]
        candidates = torch.cat([anchor[:, None], proposals[:, :k]], dim=1)  # [n, k+1]
        verify = rows.run(self.backend, c.verify_graph(self.dims, c.TARGET_VERIFY, n, k), {c.TOKENS: candidates, c.START: start})
        # Next context = taps of verify rows 0..a; rows past a are padding the static draft overwrites.
        context[:, : k + 1].copy_(verify[c.TAPS])
        rows.put(self.context.taps, context)
        feeds = {c.LOGITS: verify[c.LOGITS], c.CANDIDATES: candidates}
        kind = c.VERIFY_ARGMAX
        if key.sampled:
            kind = c.VERIFY_SAMPLE
            feeds |= self._sampling(rows, start)
        verdict = rows.run(self.backend, c.verify_graph(self.dims, kind, n, k), feeds)
        accepted, token = verdict[c.ACCEPTED], verdict[c.NEXT_TOKEN]
        record[:, PROPOSALS_COLUMN:].copy_(proposals)
        rows.put(self.ints.device[DRAFT], start)  # the draft now holds the context before this cycle's anchor
        self._advance(rows, start, accepted, token, record)

    def _decode(self, key: Key, rows: RowRange | RowSlots, record: torch.Tensor) -> None:
        """target_decode_n → the target's token → anchors/positions, all on the device; the token into ``record``."""
        n = rows.n
        anchor, start = rows.take(self.ints.device[ANCHOR]), rows.take(self.ints.device[FRONTIER])
        out = rows.run(self.backend, c.graph_name(c.TARGET_DECODE, n), {c.TOKENS: anchor.view(n, 1), c.START: start})
        logits = out[c.LOGITS]  # [n, V]
        if key.sampled:
            token = rows.run(self.backend, c.SAMPLE, self._sampling(rows, start) | {c.LOGITS: logits})[c.TOKEN]
        else:
            token = logits.argmax(dim=-1)  # the sampler's choice at temperature 0
        self._keep_tap(rows, start, out[c.TAPS][:, 0])
        self._advance(rows, start, torch.zeros_like(token), token, record)

    def _glued_cycle(self, key: Key, rows: RowSlots, record: torch.Tensor) -> None:
        """``_cycle`` with ``kernels.loop_ops`` around the graphs: gather, the draft, the verify, the target's
        choices (the argmax, or ``choose_op`` per verify row: what the torch backend's ``verify_sample`` runs,
        the only row-indexed backend's), commit (the verdict in it)."""
        n, k = rows.n, key.proposals or self.dims.proposals
        got = self.glue.gather(rows.slots, context=True, sampled_rows=(k + 1) if key.sampled else 0)
        anchor, start = got["anchor"], got["start"]
        feeds = {c.CTX_TAPS: got["context"], c.CTX_START: got["draft"], c.CTX_COUNT: got["pending"], c.ANCHOR: anchor}
        proposals = rows.run(self.backend, c.graph_name(c.DRAFT, n), feeds)[c.PROPOSALS]  # [n, P]
        candidates = torch.cat([anchor[:, None], proposals[:, :k]], dim=1)  # [n, k+1]
        verify = rows.run(self.backend, c.verify_graph(self.dims, c.TARGET_VERIFY, n, k), {c.TOKENS: candidates, c.START: start})
        logits = verify[c.LOGITS]  # [n, k+1, V]
        if key.sampled:
            choices = choose_op(logits.reshape(n * (k + 1), -1), *(got[name] for name in self.glue.FEEDS)).view(n, k + 1)
        else:
            choices = logits.argmax(dim=-1)
        self.glue.commit_cycle(rows.slots, got["state"], verify[c.TAPS], choices, proposals, record)

    def _glued_decode(self, key: Key, rows: RowSlots, record: torch.Tensor) -> None:
        """``_decode`` with ``kernels.loop_ops`` around the target's decode graph and its choice."""
        n = rows.n
        got = self.glue.gather(rows.slots, context=False, sampled_rows=1 if key.sampled else 0)
        out = rows.run(self.backend, c.graph_name(c.TARGET_DECODE, n), {c.TOKENS: got["anchor"].view(n, 1), c.START: got["start"]})
        logits = out[c.LOGITS]  # [n, V]
        token = choose_op(logits, *(got[name] for name in self.glue.FEEDS)) if key.sampled else logits.argmax(dim=-1)
        self.glue.commit_decode(rows.slots, got["state"], out[c.TAPS][:, 0], token, record)

    def _keep_tap(self, rows: RowRange | RowSlots, start: torch.Tensor, tap: torch.Tensor) -> None:
        """A decode step's tap [n, W] becomes pending context: row ``start - draft`` (the owner's pending
        count) of its context-pool row, on the device, so a drafting session decodes plainly up to B - pending
        steps with no host work and its next cycle's draft consumes them. An owner whose pending rows are
        full (B) keeps them unchanged: the executor never decodes one (a full lane drains first, and a session
        at the context's end was drained to fit: ``Executor._assign``; ``Executor._read_decodes`` asserts it);
        sessions that do not draft (draft == frontier) write row 0, which nothing reads."""
        B, width = self.dims.block_size, self.context.taps.shape[-1]
        pending = start - rows.take(self.ints.device[DRAFT])  # [n]
        index = rows.ids(self.device) * B + pending.clamp(0, B - 1)  # [n] rows of the flattened pool
        flat = self.context.taps.view(-1, width)  # [R * B, W]
        kept = torch.where((pending < B)[:, None], tap.to(flat.dtype), flat.index_select(0, index))
        flat.index_copy_(0, index, kept)

    def _advance(self, rows: RowRange | RowSlots, start: torch.Tensor, accepted: torch.Tensor, token: torch.Tensor, record: torch.Tensor) -> None:
        """Record the verdict; frontier = start + accepted + 1; anchor = token."""
        record[:, ACCEPTED_COLUMN].copy_(accepted)
        record[:, NEXT_COLUMN].copy_(token)
        rows.put(self.ints.device[FRONTIER], start + accepted + 1)
        rows.put(self.ints.device[ANCHOR], token)

    def _sampling(self, rows: RowRange | RowSlots, start: torch.Tensor) -> dict[str, torch.Tensor]:
        """The owners' sampling feeds; their first choice is the token AT start + 1."""
        return {
            c.TEMPERATURE: rows.take(self.floats.device[TEMPERATURE]),
            c.TOP_K: rows.take(self.ints.device[TOP_K]),
            c.TOP_P: rows.take(self.floats.device[TOP_P]),
            c.SEED: rows.take(self.seeds.device),
            c.POSITION: start + 1,
        }

    # ------------------------------------------------------------------ lifetime

    def abandon(self) -> None:
        """After a failure mid-run: wait for the stream (host sync), forget unread launches' events."""
        if self.stream is not None:
            self.stream.synchronize()
        self.timeline.end_run()

    def close(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()  # host sync: pinned memory must outlive the copies into it
        self.captured.clear()
        self.timeline.close()
        self.joining_staging.close()
        for mirror in (self.state, self.staged_slots, self.joining):
            if mirror is not None:
                mirror.close()
        if self.reads[0] is not None:
            self.reads[0].close()
