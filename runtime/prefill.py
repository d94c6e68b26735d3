"""Batched prefill as one program: joining prompts' target prefill, their draft context, their pending
taps and their first token, in one launch (row-indexed backends).

A prefill program for ``n`` prompts padded to ``T`` tokens (owner i's first ``length[i]`` real):

1. ``target_prefill_many``: tokens [n, T] at positions ``start[i]..`` of cache rows ``slot[i]`` ->
   logits [n, V] of each prompt's last real row, taps [n, T, W];
2. ``draft_context_many``: each drafting prompt's taps but its last B (``drain[i]`` rows; 0 for a
   session that does not draft) into the draft cache at ``draft_start[i]..``;
3. pending context: the context pool's row ``slot[i]`` becomes taps[i, drain[i] : drain[i] + keep[i]],
   zero past ``keep[i]`` (what ``ContextPool.store`` does, as one gather);
4. ``sample``: each prompt's token AT ``position[i]`` (its end), by its own sampling; it is also the
   device loop's anchor of row ``slot[i]`` (the token its next cycle or decode step feeds).

Only the tokens come back to the host, asynchronously (``launch`` queues their copy into pinned memory,
``read`` waits for it): the executor launches the loop's first round behind the prefill and reads the
tokens with its first verdict, so the device never waits for the host between the two. On CUDA with graphs the program is captured at
start-up for every padded shape (``shapes``): owner counts padded to ``owner_buckets(max_sessions)``,
token counts to ``widths`` (PREFILL_QUANTUM · 2^k, and max_chunk), ``n · T <= CAPTURE_TOKENS``; padded
lanes point at the scratch row (one token, nothing drained or kept: writes nobody reads). A batch beyond
those shapes, the CPU, and a loop without graphs run the same program eagerly at the batch's exact
shape. Inputs are staged in buffers allocated once at their largest (pinned twins on CUDA, stable
addresses): one upload per buffer, no allocation per launch. The drain always spans the launch's whole
width (its lengths say which rows are real), so its kernels see only the captured widths: no Triton
specialization is left to compile while serving.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dflash_trt.export import contract as c
from dflash_trt.export.sampling import Sampling
from dflash_trt.runtime.cycles import sampling_rows
from dflash_trt.runtime.device import CaptureFallback
from dflash_trt.runtime.device_loop import ANCHOR, DeviceLoop, Mirror, Mirrors, Staging, capture_graph, owner_buckets
from dflash_trt.runtime.sessions import ContextPool

# Tokens per prefill launch (the executor's batches), their padding quantum, and the largest padded
# launch captured as a CUDA graph: above it a launch's compute outweighs its ~100 kernel launches, and
# padding it to a captured shape would cost more than it saves.
PREFILL_TOKENS, PREFILL_QUANTUM, CAPTURE_TOKENS = 4096, 32, 2048
STAGING = 4  # launches whose inputs may wait on the stream at once (pinned copies reused round-robin)

START, LENGTH, SLOT, DRAFT_START, DRAIN, KEEP, TOP_K, POSITION = range(8)  # rows of the int inputs
TEMPERATURE, TOP_P = range(2)  # rows of the float inputs


@dataclass(frozen=True)
class PrefillLaunch:
    """One launched prefill program: its prompts' tokens land at ``offset`` of the host buffer once ``done``
    (a device event; None where the program ran synchronously: CPU)."""

    offset: int
    count: int
    done: object


@dataclass(frozen=True)
class Prompt:
    """One prompt of a prefill launch: its tokens, where they go, what is drained and kept, how its
    first token is chosen (the token AT ``position``)."""

    tokens: Sequence[int]
    start: int
    slot: int
    draft_start: int
    drain: int
    keep: int
    sampling: Sampling
    position: int


def widths(max_chunk: int) -> list[int]:
    """Captured token counts: PREFILL_QUANTUM · 2^k below ``max_chunk``, and ``max_chunk``.

    >>> widths(100)
    [32, 64, 100]
    """
    below = [PREFILL_QUANTUM * 2**k for k in range(32) if PREFILL_QUANTUM * 2**k < max_chunk]
    return [*below, max_chunk]


def shapes(max_sessions: int, max_chunk: int) -> list[tuple[int, int]]:
    """Every captured (owners, tokens): owner buckets of ``max_sessions`` × ``widths``, n·T <= CAPTURE_TOKENS."""
    return [(n, T) for n in owner_buckets(max_sessions) for T in widths(max_chunk) if n * T <= CAPTURE_TOKENS]


class PrefillPrograms:
    """The prefill program of one executor's loop (see the module docstring)."""

    def __init__(self, loop: DeviceLoop, context: ContextPool, max_sessions: int, drafting: bool, pad: bool | None = None) -> None:
        """``drafting``: the executor's sessions draft by default (its programs drain and keep taps;
        a batch of the other kind runs eagerly). ``pad``: run batches at the padded shapes (default:
        where they are captured, i.e. when the loop captures graphs)."""
        self.loop, self.backend, self.context = loop, loop.backend, context
        self.dims, self.device, self.drafting = loop.dims, loop.device, drafting
        self.shapes = shapes(max_sessions, self.dims.max_chunk)
        self.pad = loop.graphs if pad is None else pad
        self.captured: dict[tuple[int, int, bool], torch.cuda.CUDAGraph] = {}
        self.fallback = CaptureFallback("prefill programs")
        # Capacity: a batch holds <= PREFILL_TOKENS padded tokens, or one prompt of <= max_chunk padded to the quantum.
        n, tokens = max_sessions, max(PREFILL_TOKENS, -(-self.dims.max_chunk // PREFILL_QUANTUM) * PREFILL_QUANTUM)
        with loop.on_stream():
            # A launch's inputs: one block, one upload.
            self.inputs = Mirrors(
                self.device, tokens=((tokens,), torch.int64), ints=((8, n), torch.int64), seeds=((n, c.SEED_PARTS), torch.int64), floats=((2, n), torch.float32)
            )
            self.tokens, self.ints, self.seeds, self.floats = self.inputs.parts.values()
            self.staging = Staging(self.inputs, STAGING)
            self.chosen = torch.zeros((n,), dtype=torch.int64, device=self.device)
            # The tokens as the host reads them: one slot per session, so an execute's launches never share one.
            self.chosen_host = Mirror((max_sessions,), torch.int64, self.device)

    def prepare(self) -> int:
        """Capture the program at every padded shape now (start-up), each run on the scratch row only,
        so nothing compiles or captures while serving. Host syncs (captures). Returns the shapes."""
        if not self.loop.graphs:
            return 0
        with self.loop.on_stream(), self.backend.plain_runs():
            for n, T in self.shapes:
                if not self.loop.graphs:
                    break
                self.warm(n, T)  # the warm-up the capture needs (Triton compiles)
                graph = self.fallback.capture(f"prefill of {n} x {T} tokens", lambda n=n, T=T: self._capture(n, T))
                if graph is None:
                    self.loop.graphs = False  # one switch for the loop's captures
                else:
                    self.captured[(n, T, self.drafting)] = graph
        return len(self.captured)

    def warm(self, n: int, T: int) -> None:
        """Run the program at (n, T) with every lane padding: writes the scratch row only. Never syncs."""
        with self.loop.on_stream(), torch.no_grad():
            self._stage_padding(0, n, T)
            self._upload()
            self._program(n, T, self.drafting)

    def launch(self, prompts: Sequence[Prompt], width: int, offset: int = 0) -> PrefillLaunch:
        """Prefill ``prompts`` (each at most ``width`` tokens) in one launch; their tokens become the loop's
        anchors of their rows and are copied to host slots ``offset..`` (``read``). No host sync on CUDA."""
        n = len(prompts)
        assert offset + n <= self.chosen_host.array.shape[0], (offset, n)
        drafting = any(p.drain or p.keep for p in prompts) or self.drafting
        owners, T = self._padded(n, width) if self.pad else (n, width)
        graph = self.captured.get((owners, T, drafting))
        with self.loop.on_stream():
            self._stage(prompts, T)
            self._stage_padding(n, owners, T)
            self._upload()
            if graph is not None:
                graph.replay()
            else:
                with torch.no_grad():
                    self._program(owners, T, drafting)
            return PrefillLaunch(offset, n, self._download(offset, n))

    def read(self, launched: PrefillLaunch) -> list[int]:
        """Host sync (the launch's copy): its prompts' tokens."""
        if launched.done is not None:
            launched.done.synchronize()
            launched.done.close()
        return self.chosen_host.array[launched.offset : launched.offset + launched.count].tolist()

    def _download(self, offset: int, n: int):
        """chosen[:n] -> host slots offset.. (async on CUDA: pinned memory, then an event) -> the event, or None."""
        host = self.chosen_host
        if host.pinned is None:
            host.device[offset : offset + n].copy_(self.chosen[:n])  # the same memory as the host's view
            return None
        from dflash_trt.runtime import device

        device.copy_async(host.pinned.ptr + offset * 8, self.chosen.data_ptr(), n * 8, self.loop.stream)
        done = device.Event(timing=False)
        done.record(self.loop.stream)
        return done

    @property
    def budget(self) -> int:
        """Tokens one launch may run (``launch_tokens``): the captured shapes' limit where batches run padded
        to them (a larger batch would run eagerly, a host-bound crawl at many prompts), else PREFILL_TOKENS."""
        return CAPTURE_TOKENS if self.pad else PREFILL_TOKENS

    @property
    def most(self) -> int:
        """Prompts one launch may hold: the ``sample`` graph's rows (max_owners · (P + 1))."""
        return self.dims.max_owners * (self.dims.proposals + 1)

    def launch_tokens(self, n: int, width: int) -> int:
        """Tokens a launch of ``n`` prompts of ``width`` tokens runs: at its padded shape where batches are padded."""
        owners, T = self._pad(n, width) if self.pad else (n, width)
        return owners * T

    def _padded(self, n: int, width: int) -> tuple[int, int]:
        """The captured shape holding ``n`` prompts of ``width`` tokens, or (n, width) when none does."""
        shape = self._pad(n, width)
        return shape if shape in self.shapes else (n, width)

    def _pad(self, n: int, width: int) -> tuple[int, int]:
        """``n`` prompts of ``width`` tokens padded to the next owner bucket and captured width (captured or not)."""
        owners = next((b for b, _ in self.shapes if b >= n), n)
        return owners, next((w for w in widths(self.dims.max_chunk) if w >= width), width)

    def _stage(self, prompts: Sequence[Prompt], T: int) -> None:
        """The prompts' inputs into the host buffers (tokens as [n, T], rows past a length: zero)."""
        n = len(prompts)
        tokens = self.tokens.array[: n * T].reshape(n, T)  # a view: numpy writes, a fraction of torch's cost
        tokens[:] = 0
        for i, p in enumerate(prompts):
            tokens[i, : len(p.tokens)] = p.tokens
        columns = [(p.start, len(p.tokens), p.slot, p.draft_start, p.drain, p.keep, p.sampling.top_k, p.position) for p in prompts]
        self.ints.array[:, :n] = np.array(columns, dtype=np.int64).T
        sampling = sampling_rows([p.sampling for p in prompts], [p.position for p in prompts])
        self.seeds.array[:n] = sampling[c.SEED]
        self.floats.array[TEMPERATURE, :n] = sampling[c.TEMPERATURE]
        self.floats.array[TOP_P, :n] = sampling[c.TOP_P]

    def _stage_padding(self, first: int, owners: int, T: int) -> None:
        """Lanes ``first..owners-1``: one token at position 0 of the scratch row, nothing drained or kept, greedy."""
        if first >= owners:
            return
        self.tokens.array[first * T : owners * T] = 0
        ints = self.ints.array
        ints[:, first:owners] = 0
        ints[LENGTH, first:owners] = 1
        ints[SLOT, first:owners] = self.loop.scratch
        self.seeds.array[first:owners] = 0
        self.floats.array[TEMPERATURE, first:owners] = 0.0
        self.floats.array[TOP_P, first:owners] = 1.0

    def _upload(self) -> None:
        """The staged inputs -> device (async on CUDA; inside ``loop.on_stream``)."""
        self.staging.upload(self.loop.stream)

    def _capture(self, n: int, T: int) -> torch.cuda.CUDAGraph:
        return capture_graph(self.device, self.backend.stream.torch, self.loop.memory, lambda: self._program(n, T, self.drafting))

    def _program(self, n: int, T: int, drafting: bool) -> None:
        """The launch for ``n`` owners × ``T`` tokens over the staged device buffers. Never syncs."""
        ints = self.ints.device[:, :n]
        slots = ints[SLOT]
        tokens = self.tokens.device[: n * T].view(n, T)
        logits, taps = self.backend.prefill_many(tokens, ints[START], ints[LENGTH], slots)
        if drafting:
            self.backend.draft_context_many(taps, ints[DRAFT_START], ints[DRAIN], slots)
            self._keep(taps, ints[DRAIN], ints[KEEP], slots)
        feeds = {
            c.LOGITS: logits.contiguous(),
            c.TEMPERATURE: self.floats.device[TEMPERATURE, :n],
            c.TOP_K: ints[TOP_K],
            c.TOP_P: self.floats.device[TOP_P, :n],
            c.SEED: self.seeds.device[:n],
            c.POSITION: ints[POSITION],
        }
        self.chosen[:n].copy_(self.backend.run(c.SAMPLE, feeds, 0)[c.TOKEN])
        self.loop.ints.device[ANCHOR].index_copy_(0, slots, self.chosen[:n])  # padded lanes: the scratch row's

    def _keep(self, taps: torch.Tensor, drain: torch.Tensor, keep: torch.Tensor, slots: torch.Tensor) -> None:
        """Context pool row slots[i] = taps[i, drain[i] : drain[i] + keep[i]], zero past keep[i] (taps [n, T, W])."""
        n, T, W = taps.shape
        B = self.context.block
        offsets = torch.arange(B, device=taps.device)
        index = (drain[:, None] + offsets).clamp(max=T - 1)  # [n, B]
        rows = taps.gather(1, index[:, :, None].expand(n, B, W))  # [n, B, W]
        kept = torch.where((offsets < keep[:, None])[:, :, None], rows, torch.zeros((), dtype=rows.dtype, device=rows.device))
        self.context.taps.index_copy_(0, slots, kept.to(self.context.taps.dtype))

    def close(self) -> None:
        self.captured.clear()
        self.staging.close()
        self.inputs.close()
        self.chosen_host.close()
