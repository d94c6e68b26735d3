"""The decode loop on the device: per-row state, pinned staging, one program per owner group.

A *program* is what one launch does for ``n`` owners at consecutive rows
``first .. first+n-1`` (DESIGN §3, Speed):

- ``cycle``: ``draft_n`` → ``target_verify_n`` → tap copy into the context
  pool → ``verify_argmax_n`` / ``verify_sample_n`` → device-side update of
  the owners' anchor, draft position and frontier;
- ``decode``: ``target_decode_n`` → the target's token (the argmax, or the
  ``sample`` graph) → anchor and frontier.

Every program reads and writes only memory allocated once (this module's
row-indexed state, the context pool, the backend's pools), so after a first
eager run it is captured (thread-local mode) as ONE CUDA graph per (program,
n, first_row) when the backend is ``capturable`` and replayed from then on;
a capture that fails turns capture off for the loop, which then runs every
program eagerly (``device.CaptureFallback``: logged once). A launch ends with
an async copy of the owners' verdict record (accepted, next token,
proposals) into a pinned host buffer and an event; ``read`` waits for that
event only. Nothing else in a launch synchronizes the host, so the executor
can launch cycle k+1 before reading cycle k (``runtime.bursts``).

Row-indexed state (``R`` = pool rows, int64 unless said):

| tensor | shape | meaning |
| --- | --- | --- |
| anchor | [R] | token AT the frontier (the next cycle's anchor) |
| frontier | [R] | first position not in the target cache |
| draft | [R] | first position not in the draft cache (the context rows start here) |
| top_k | [R] | sampling |
| seed | [R, 3] | sampling (``sampling.seed_parts``); a choice's noise is keyed by its position, read on the device |
| temperature, top_p | [R] float32 | sampling |
| record | [R, P+2] | per launch: accepted, next token, proposals d_1..d_P |
| taps_out | [R, W] model dtype | a decode step's taps (committed by the host for drafting sessions) |

The host stages anchor/frontier/draft/sampling once per execute (pinned
memory, one async copy per tensor group); within an execute the device
state runs ahead of what the host has read. On CPU the same code runs
eagerly and "pinned" buffers are plain tensors.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import numpy as np
import torch

from dflash_trt.export import contract as c
from dflash_trt.export.sampling import seed_parts
from dflash_trt.runtime.backends.base import Backend
from dflash_trt.runtime.device import CaptureFallback
from dflash_trt.runtime.sessions import ContextPool

CYCLE, DECODE = "cycle", "decode"  # program kinds
ANCHOR, FRONTIER, DRAFT, TOP_K = range(4)  # rows of the int state
TEMPERATURE, TOP_P = range(2)  # rows of the float state
ACCEPTED_COLUMN, NEXT_COLUMN, PROPOSALS_COLUMN = 0, 1, 2  # columns of the record


@dataclass(frozen=True)
class Key:
    """One program: (kind, sampled, n, first_row) -> one CUDA graph."""

    kind: str
    sampled: bool
    owners: int
    first: int


class Mirror:
    """A device tensor and its host twin (pinned memory on CUDA); the upload is async.

    On CPU both are the same tensor.
    """

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        self.device = torch.zeros(shape, dtype=dtype, device=device)
        self.pinned, self.host = host_buffer(shape, dtype, device) if device.type == "cuda" else (None, self.device)

    def upload(self, stream) -> None:
        """host -> device, enqueued on ``stream`` (a device-layer Stream; no host sync)."""
        if self.pinned is not None:
            from dflash_trt.runtime.device import copy_async

            copy_async(self.device.data_ptr(), self.pinned.ptr, self.pinned.nbytes, stream)

    def close(self) -> None:
        if self.pinned is not None:
            self.pinned.close()
            self.pinned = None


def host_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> tuple[object | None, torch.Tensor]:
    """(owner, CPU tensor view): page-locked memory of the device layer for CUDA, a plain tensor for CPU."""
    if device.type != "cuda":
        return None, torch.zeros(shape, dtype=dtype)
    from dflash_trt.runtime.device import PinnedBuffer

    pinned = PinnedBuffer(shape, dtype)
    return pinned, pinned.as_tensor()


@dataclass
class Launch:
    """One launched program: where its record lands and when it finished."""

    key: Key
    slot: int
    started: object  # device Event (CUDA) or host seconds (CPU)
    ended: object


class Timeline:
    """Device busy time of launches and the device's idle gaps between consecutive ones.

    CUDA: events recorded around every launch on the backend's stream (taken from
    a pool, returned once read). CPU: host time around the synchronous launch.
    """

    def __init__(self, stream) -> None:
        self.stream = stream  # device-layer Stream, None on CPU
        self.free: list = []
        self.previous_end = None
        self.busy_ms = 0.0
        self.idle_ms = 0.0
        self.launches = 0

    def mark(self):
        if self.stream is None:
            return time.perf_counter()
        if not self.free:
            from dflash_trt.runtime.device import Event

            self.free.append(Event(timing=True))
        event = self.free.pop()
        event.record(self.stream)
        return event

    def wait(self, launch: Launch) -> None:
        """Host sync: until the launch has finished on the device."""
        if self.stream is not None:
            launch.ended.synchronize()

    def account(self, launch: Launch) -> float:
        """The launch's device ms (call after ``wait``); adds the gap since the previous launch ended."""
        if self.stream is None:
            device_ms = (launch.ended - launch.started) * 1000.0
            gap_ms = 0.0
        else:
            device_ms = launch.started.elapsed_ms(launch.ended)
            gap_ms = self.previous_end.elapsed_ms(launch.started) if self.previous_end is not None else 0.0
            if self.previous_end is not None:
                self.free.append(self.previous_end)
            self.free.append(launch.started)
        self.previous_end = launch.ended if self.stream is not None else None
        self.busy_ms += device_ms
        self.idle_ms += max(0.0, gap_ms)
        self.launches += 1
        return device_ms

    def reset(self) -> None:
        """Zero the totals (e.g. after a warm-up)."""
        self.busy_ms = self.idle_ms = 0.0
        self.launches = 0

    def end_run(self) -> None:
        """Between executes the host works: gaps are counted only within one run of launches."""
        if self.previous_end is not None:
            self.free.append(self.previous_end)
        self.previous_end = None

    def close(self) -> None:
        self.end_run()
        for event in self.free:
            event.close()
        self.free.clear()


class DeviceLoop:
    """Per-row device state, staging and the programs of one executor (see the module docstring)."""

    def __init__(self, backend: Backend, dims: c.Dims, context: ContextPool, rows: int, graphs: bool) -> None:
        """``rows``: the backend's pool rows (session rows index them); ``graphs``: capture programs where capturable."""
        self.backend, self.dims, self.context, self.rows = backend, dims, context, rows
        self.device = backend.device
        stream = getattr(backend, "stream", None)
        self.stream = stream.device_stream if stream is not None and self.device.type == "cuda" else None
        self.graphs = bool(graphs and backend.capturable and self.stream is not None)
        with self._on_stream():
            self.ints = Mirror((4, rows), torch.int64, self.device)
            self.seeds = Mirror((rows, c.SEED_PARTS), torch.int64, self.device)
            self.floats = Mirror((2, rows), torch.float32, self.device)
            self.record = torch.zeros((rows, dims.proposals + 2), dtype=torch.int64, device=self.device)
            # Two host slots: a group's cycle k+1 lands in one while the host reads cycle k from the other.
            self.reads = [host_buffer((rows, dims.proposals + 2), torch.int64, self.device) for _ in range(2)]
            self.taps_out = torch.zeros((rows, dims.tap_width), dtype=context.taps.dtype, device=self.device)
        self.captured: dict[Key, torch.cuda.CUDAGraph] = {}
        self.fallback = CaptureFallback("the device loop")
        self.memory = torch.cuda.graph_pool_handle() if self.graphs else None
        self.timeline = Timeline(self.stream)

    @contextmanager
    def _on_stream(self) -> Iterator[None]:
        """Torch work on the backend's stream, ordered after the caller's and before its later work."""
        stream = getattr(self.backend, "stream", None)
        with stream.scope() if stream is not None and self.device.type == "cuda" else nullcontext():
            yield

    @contextmanager
    def running(self) -> Iterator[None]:
        """One execute's staging, launches and reads: on the backend's stream (entered once, not per
        launch); device idle gaps are counted between the launches inside."""
        try:
            with self._on_stream():
                yield
        except BaseException:
            self.abandon()
            raise
        finally:
            self.timeline.end_run()

    # ------------------------------------------------------------------ staging

    def stage(self, rows: list[tuple[int, int, int, int, object]]) -> None:
        """(row, anchor, frontier, draft, sampling) per owner of this execute -> device (async; inside ``running``)."""
        index = [row for row, *_ in rows]
        samplings = [sampling for *_, sampling in rows]
        self.ints.host[:, index] = torch.tensor([[a, f, d, s.top_k] for _, a, f, d, s in rows], dtype=torch.int64).T
        self.seeds.host[index] = torch.tensor([seed_parts(s.seed) for s in samplings], dtype=torch.int64)
        self.floats.host[:, index] = torch.tensor([[s.temperature, s.top_p] for s in samplings], dtype=torch.float32).T
        for mirror in (self.ints, self.seeds, self.floats):
            mirror.upload(self.stream)

    # ------------------------------------------------------------------ launches

    def launch(self, key: Key, slot: int) -> Launch:
        """Run one program (replay its graph; the first time: eagerly, then capture it) and queue its
        record's copy to the host (inside ``running``). No host sync, except around a capture (first use)."""
        started = self.timeline.mark()
        graph = self.captured.get(key)
        if graph is not None:
            graph.replay()
        elif self.graphs:
            with self.backend.plain_runs():
                self._program(key)  # a real cycle, and the warm-up the capture needs
                graph = self.fallback.capture(f"{key.kind} program for {key.owners} owners at row {key.first}", lambda: self._capture(key))
            if graph is None:
                self.graphs = False  # eager from now on (logged once by the fallback)
            else:
                self.captured[key] = graph
        else:
            self._program(key)
        self._download(key, slot)
        return Launch(key, slot, started, self.timeline.mark())

    def read(self, launch: Launch) -> tuple[np.ndarray, float]:
        """Host sync (the launch's end event): its record rows [n, P+2] and its device ms."""
        self.timeline.wait(launch)
        first, n = launch.key.first, launch.key.owners
        record = self.reads[launch.slot][1][first : first + n].numpy().copy()
        return record, self.timeline.account(launch)

    def _download(self, key: Key, slot: int) -> None:
        """The owners' record rows -> host slot ``slot`` (async on CUDA: pinned memory, no host sync)."""
        pinned, host = self.reads[slot]
        if pinned is None:
            rows = slice(key.first, key.first + key.owners)
            host[rows] = self.record[rows]
            return
        from dflash_trt.runtime.device import copy_async

        row = pinned.nbytes // self.rows
        source = self.record.data_ptr() + key.first * row
        copy_async(pinned.ptr + key.first * row, source, key.owners * row, self.stream)

    def _capture(self, key: Key) -> torch.cuda.CUDAGraph:
        """One program as a CUDA graph, captured in thread-local mode: CUDA calls of other
        threads (a server's, a logger's) stay legal meanwhile and cannot invalidate it. The
        capture is always ended, also when the program fails inside it, and the stream
        restored; the failure propagates (``launch`` falls back to eager)."""
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize(self.device)  # host sync: first use of a program key only
        with torch.cuda.stream(self.backend.stream.torch):
            graph.capture_begin(pool=self.memory, capture_error_mode="thread_local")
            try:
                self._program(key)
            finally:
                graph.capture_end()
        return graph

    # ------------------------------------------------------------------ programs

    def _program(self, key: Key) -> None:
        with torch.no_grad():
            (self._cycle if key.kind == CYCLE else self._decode)(key)

    def _state(self, key: Key) -> tuple[slice, torch.Tensor, torch.Tensor]:
        rows = slice(key.first, key.first + key.owners)
        ints = self.ints.device
        return rows, ints[ANCHOR, rows], ints[FRONTIER, rows]

    def _cycle(self, key: Key) -> None:
        """draft_n → target_verify_n → taps → verdict → anchors/positions, all on the device."""
        n, first, P = key.owners, key.first, self.dims.proposals
        rows, anchor, start = self._state(key)
        ctx_start = self.ints.device[DRAFT, rows]
        context = self.context.view(first, n)  # [n, B, W]
        feeds = {c.CTX_TAPS: context, c.CTX_START: ctx_start, c.CTX_COUNT: start - ctx_start, c.ANCHOR: anchor}
        proposals = self.backend.run(c.graph_name(c.DRAFT, n), feeds, first)[c.PROPOSALS]  # [n, P]
        candidates = torch.cat([anchor[:, None], proposals], dim=1)  # [n, P+1]
        verify = self.backend.run(c.graph_name(c.TARGET_VERIFY, n), {c.TOKENS: candidates, c.START: start}, first)
        # Next context = taps of verify rows 0..a; rows past a are padding the static draft overwrites.
        context[:, : P + 1].copy_(verify[c.TAPS])
        feeds = {c.LOGITS: verify[c.LOGITS], c.CANDIDATES: candidates}
        kind = c.VERIFY_ARGMAX
        if key.sampled:
            kind = c.VERIFY_SAMPLE
            feeds |= self._sampling(rows, start)
        verdict = self.backend.run(c.graph_name(kind, n), feeds, first)
        accepted, token = verdict[c.ACCEPTED], verdict[c.NEXT_TOKEN]
        self.record[rows, PROPOSALS_COLUMN:].copy_(proposals)
        ctx_start.copy_(start)  # the draft now holds the context before this cycle's anchor
        self._advance(rows, start, accepted, token)

    def _decode(self, key: Key) -> None:
        """target_decode_n → the target's token → anchors/positions, all on the device."""
        n, first = key.owners, key.first
        rows, anchor, start = self._state(key)
        out = self.backend.run(c.graph_name(c.TARGET_DECODE, n), {c.TOKENS: anchor.view(n, 1), c.START: start}, first)
        logits = out[c.LOGITS]  # [n, V]
        if key.sampled:
            token = self.backend.run(c.SAMPLE, self._sampling(rows, start) | {c.LOGITS: logits}, first)[c.TOKEN]
        else:
            token = logits.argmax(dim=-1)  # the sampler's choice at temperature 0
        self.taps_out[rows].copy_(out[c.TAPS][:, 0])
        self._advance(rows, start, torch.zeros_like(token), token)

    def _advance(self, rows: slice, start: torch.Tensor, accepted: torch.Tensor, token: torch.Tensor) -> None:
        """Record the verdict; frontier += accepted + 1 (in place: ``start`` is the frontier's view); anchor = token."""
        self.record[rows, ACCEPTED_COLUMN].copy_(accepted)
        self.record[rows, NEXT_COLUMN].copy_(token)
        start.add_(accepted + 1)
        self.ints.device[ANCHOR, rows].copy_(token)

    def _sampling(self, rows: slice, start: torch.Tensor) -> dict[str, torch.Tensor]:
        """The owners' sampling feeds; their first choice is the token AT start + 1."""
        return {
            c.TEMPERATURE: self.floats.device[TEMPERATURE, rows],
            c.TOP_K: self.ints.device[TOP_K, rows],
            c.TOP_P: self.floats.device[TOP_P, rows],
            c.SEED: self.seeds.device[rows],
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
        for mirror in (self.ints, self.seeds, self.floats):
            mirror.close()
        for pinned, _ in self.reads:
            if pinned is not None:
                pinned.close()
