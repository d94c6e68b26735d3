"""The one interface every execution backend implements.

A backend owns the two cache pools (target and draft: per layer one
``[max_sessions, kv_heads, max_context, head_dim]`` tensor for K and one for
V, allocated once at load, addresses stable for the executor's lifetime) and
runs the graphs of the export contract (``dflash_trt.export.contract``) by
name. A graph over ``n`` owners sees the ``n`` CONSECUTIVE cache rows
``first_row .. first_row + n - 1`` of its pool, bound in place (past and
present share the buffer): the executor packs owners as runs of consecutive
rows.

Arrays crossing this interface are ``torch.Tensor`` on ``backend.device``
(CPU, or CUDA memory owned by the device layer and viewed through
``__cuda_array_interface__``); outputs stay on the device, so taps returned
by a target graph can be fed to a draft graph with no host round trip.

Streams (CUDA): a backend enqueues on its own device-layer stream
(``backend.stream``, a ``streams.BackendStream``; None on CPU). ``run`` and
``copy_rows`` order themselves after the caller's current torch stream and
the caller's stream after them, with device-side waits (no host sync); a
caller that runs its own torch ops on ``backend.stream.torch`` skips the
waits.

Whole-cycle capture: a backend whose ``capturable`` is True lets a caller
record several ``run`` calls into ONE CUDA graph of its own (the executor's
per-cycle graphs): inside ``plain_runs()``, ``run`` enqueues its work
directly on the backend's stream (no CUDA graph of its own, no host sync, no
allocation outside torch's allocator or memory allocated at load).

Backends: ``torch`` (the contract's PyTorch graph modules, eager or CUDA
graphs), ``onnxruntime`` (the exact exported ONNX files; CPU provider, or the
CUDA provider bound to device-layer memory), ``tensorrt`` (engine sets from
``dflash_trt.engines``). ``open_backend(kind, ...)`` in this package builds
one by name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext

import torch

from dflash_trt.errors import EngineError
from dflash_trt.export import contract
from dflash_trt.export.contract import Dims
from dflash_trt.runtime.backends.pools import close_pools, pool_named
from dflash_trt.runtime.ownership import Ownership, ownership_of

class Backend(ABC):
    """Runs contract graphs over in-place cache pools."""

    name: str = "abstract"
    device: torch.device
    dims: Dims  # the contract dims of the graphs it runs (the executor's default)
    max_sessions: int  # rows of each pool
    pools: dict | None = None  # "target" / "draft" -> pools.CachePool (per-layer K/V views; tests and debugging read them)
    stream: object | None = None  # streams.BackendStream on CUDA
    capturable: bool = False  # run() may be recorded into a caller's CUDA graph (inside plain_runs())
    plain: bool = False  # inside plain_runs(): no CUDA graph of the backend's own
    row_indexed: bool = False  # run_at() takes the owners' rows as a device tensor (pools hold a scratch row past max_sessions)

    @classmethod
    def open(cls, *args, **kwargs) -> Backend:
        """Build from artifacts (what ``open_backend(kind, ...)`` calls); each backend documents its arguments."""
        return cls(*args, **kwargs)

    @abstractmethod
    def run(self, graph: str, feeds: Mapping[str, torch.Tensor], first_row: int) -> dict[str, torch.Tensor]:
        """Run contract graph ``graph`` (e.g. ``"target_verify_3"``).

        ``feeds``: every non-cache input of the graph, by contract name, on
        ``self.device`` with the contract's dtype and shape. The graph's
        cache inputs/outputs are bound to rows ``first_row .. first_row+n-1``
        of the pool the contract names. Returns every non-cache output by
        contract name (device tensors; valid until the next ``run`` of the
        same graph). Enqueues on the backend's stream; does not synchronize
        unless the backend cannot do otherwise (CPU; ONNX Runtime on CUDA,
        which waits for its outputs). Feeds or a ``first_row`` that disagree
        with the contract / pool are refused with ``EngineError`` before
        anything is enqueued (graphs without caches ignore ``first_row``).
        """

    def run_at(self, graph: str, feeds: Mapping[str, torch.Tensor], slots: torch.Tensor) -> dict[str, torch.Tensor]:
        """``run`` with the owners' cache rows given as a device tensor ``slots`` [n] (any rows, in any
        order; the scratch row ``max_sessions`` included), so one captured program serves every set of
        rows. Only backends with ``row_indexed``; the others bind row ranges (``run``)."""
        raise EngineError(f"the {self.name} backend binds row ranges (run); it has no row-indexed runs")

    def prefill_many(self, tokens: torch.Tensor, start: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor):
        """Batched prefill of fresh contexts, one launch (``row_indexed`` backends): tokens [n, T] (owner
        i's first lengths[i] real) at positions start[i].. of cache rows ``slots`` -> (fp32 logits [n, V]
        of each owner's last real row, taps [n, T, W]). The others prefill one session a call."""
        raise EngineError(f"the {self.name} backend prefills one session a call (target_prefill)")

    def draft_context_many(self, taps: torch.Tensor, start: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor) -> None:
        """Batched ``draft_context`` (``row_indexed`` backends): owner i's first lengths[i] rows of taps
        [n, C, W], at positions start[i].., into draft cache rows ``slots``."""
        raise EngineError(f"the {self.name} backend drains one session a call (draft_context)")

    @property
    def graph_names(self) -> tuple[str, ...]:
        """The contract graphs this backend runs: all of them, unless its artifacts lack some
        (a greedy-only engine set has no ``verify_sample_n``; the executor then refuses sampling)."""
        return contract.graph_names(self.dims.max_owners, self.dims.short_verify)

    def copy_rows(self, pool: str, source: int, destination: int, upto: int) -> None:
        """Copy cache slots ``0 .. upto-1`` of row ``source`` into row ``destination`` (clone).

        ``pool`` is "target" or "draft"; enqueued like ``run`` on the backend's
        stream (no host sync on CUDA).
        """
        target = pool_named(self.pools, pool)
        with self.stream.scope() if self.stream is not None else nullcontext():
            target.copy_rows(source, destination, upto)

    def ownership(self) -> Ownership:
        """Rows and call guard shared by every executor over this backend (``runtime.ownership``)."""
        return ownership_of(self, self.max_sessions)

    @contextmanager
    def plain_runs(self) -> Iterator[None]:
        """Within the block, ``run`` enqueues its work directly (no CUDA graph of its own: ``plain``
        is set), so a caller on ``stream.torch`` can capture several runs into one graph (see
        ``capturable``)."""
        previous, self.plain = self.plain, True
        try:
            yield
        finally:
            self.plain = previous

    def synchronize(self) -> None:
        """Wait for all work enqueued by this backend (a host sync point)."""
        if self.stream is not None:
            self.stream.synchronize()

    def close(self) -> None:
        """Release every resource the backend owns (idempotent; also what a failed construction calls).

        Host sync first (the stream): nothing enqueued may outlive what it uses. Then the
        backend's own resources (``_close_own``), the pools, the stream, in that order.
        """
        if self.stream is not None:
            self.stream.synchronize()  # host sync
        self._close_own()
        close_pools(self.pools)
        self.pools = None
        if self.stream is not None:
            self.stream.close()
            self.stream = None

    def _close_own(self) -> None:
        """Release what this backend owns besides the pools and the stream (graphs, sessions,
        contexts...): called by ``close`` after the host sync, before the pools are freed; must
        tolerate a partly built or already closed backend."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
