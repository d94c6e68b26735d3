"""The torch backend: the contract's PyTorch graph modules, eager or replayed as CUDA graphs.

``export.graph_modules`` wraps the target and draft into one module per graph kind
that takes exactly the contract's inputs (caches = the owners' rows, updated
in place by ``EagerKernels``) and returns its outputs. This backend runs them
over its two pools.

Kernels (``kernels=``): "fast" runs the graphs with weights through
``runtime.kernels`` (q|k|v and gate|up weights fused at load, RMSNorm /
residual / SiLU-gate fused into the GEMMs, RoPE + KV write in one kernel,
attention over the valid slots only, cost flat in max_context): Triton
kernels on CUDA, their pure-torch twin on the CPU (same math; a check, not a
speed path). "exact" runs the same fused graphs with ``runtime.kernels.exact_ops``:
kernels whose rows don't depend on the batch (the row count, the query count, the
owners, the cache capacity), so a DFlash verify row and the same position decoded
alone are the same bits and DFlash's output equals plain decoding in bf16 too
(CUDA; on the CPU only under Triton's interpreter). "eager" runs
``export.graph_modules``' reference modules. "auto" (the default) is "exact" on CUDA
in bf16 and "fast" in other dtypes where the pair is supported, else "eager". An ops object
(``runtime.kernels.triton_ops.TritonOps(linear_plans=...)``, ``ExactOps(...)``) runs
the fused graphs with it. ``draft_weights="fp8"`` holds the draft's products in fp8 with a
scale per row (``runtime.kernels.quant``: half the bytes a draft launch streams; the target
verifies every token, so the output is unchanged): on the exact kernels or the CPU twin.

CPU: eager, synchronous. CUDA: everything is enqueued on the backend's
device-layer stream (``BackendStream``), and the token choice of ``sample`` /
``verify_sample_n`` (``torch.ops.dflash_trt.choose``) runs as fused Triton
passes (``runtime.kernels.sampling``, registered when the backend sets up
CUDA) instead of ~130 eager kernels. The static graphs (``target_verify_n``,
``draft_n``, ``verify_*_n``) are captured once and replayed
(``StaticGraphs``); the dynamic ones (``target_prefill``, ``draft_context``)
run eagerly (their token count varies).

Row-indexed runs (``row_indexed``: the fast path): ``run_at(graph, feeds,
slots)`` takes the owners' rows as a device tensor; the kernels read and
write the whole pools at those rows, so the device loop captures one program
per padded owner count that serves any rows. The pools hold one scratch row
past the sessions' (``max_sessions``): padded lanes of such a program write
there.

CUDA-graph choice of ``run``: one capture per (graph, first_row). The wrappers
address the owners' rows through the bound views (``rows == arange(n)``, no
rows input), so the first row is an ADDRESS baked into the capture. Static inputs
and outputs are allocated once per graph name and shared by all its
captures; captured intermediates share one private memory pool. Captures are
made lazily, on a (graph, first_row)'s first use: at most
``sum(max_sessions - n + 1)`` per cache-using kind. A device-side first row
would need a ``rows`` input in the contract.

Whole-cycle capture (``capturable`` on CUDA): inside ``plain_runs()`` every
``run`` is the eager module on the backend's stream, so the executor can
record draft → verify → verdict → bookkeeping as one CUDA graph of its own
(no host syncs, no allocation outside torch's allocator).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from contextlib import nullcontext
from pathlib import Path

import torch

from dflash_trt.errors import EngineError
from dflash_trt.export import contract as c
from dflash_trt.export.contract import Dims, GraphSpec
from dflash_trt.export.draft import DraftModel
from dflash_trt.export.graph_modules import graph_module
from dflash_trt.export.pair import load_pair
from dflash_trt.export.target import TargetModel
from dflash_trt.runtime.backends.base import Backend
from dflash_trt.runtime.backends.graph_io import check_feeds, check_run, owner_rows, plain_inputs, plain_outputs, pool_of, torch_dtype
from dflash_trt.runtime.backends.pools import allocate_pools, check_sessions, pool_shapes
from dflash_trt.runtime.backends.streams import BackendStream, select_device
from dflash_trt.runtime.kernels import OPS, fast_path, supported
from dflash_trt.runtime.kernels.modules import DRAFT_CONTEXT_MANY, PREFILL_MANY
from dflash_trt.runtime.kernels.quant import check_draft_weights

KERNELS = ("auto", "fast", "exact", "eager")
KERNEL_NOTES = {  # what the start-up line says of the kernels chosen
    "exact": " (rows independent of the batch: bf16 DFlash output equals plain decoding; kernels='fast' trades that for speed)",
    "fast": " (bf16 output may differ with the batch; kernels='exact' keeps DFlash equal to plain decoding)",
}
FUSED = ("fast", "exact")  # kernels that run the fused graphs of runtime.kernels (row-indexed programs)
LOG = logging.getLogger(__name__)


class TorchBackend(Backend):
    """Contract graphs as PyTorch modules over in-place pools (CPU or CUDA).

    The given models are moved (in place) to ``device`` and the contract dtype.
    """

    name = "torch"

    def __init__(
        self,
        target: TargetModel,
        draft: DraftModel,
        dims: Dims,
        max_sessions: int,
        device: str | torch.device = "cpu",
        cuda_graphs: bool = True,
        kernels="auto",
        draft_weights: str = "model",
    ) -> None:
        self.dims, self.max_sessions = dims, check_sessions(max_sessions)
        check_models(target, draft, dims)
        self.device = select_device(device)
        self.kernels = choose_kernels(kernels, self.device, target, draft, dims.dtype)
        self.draft_weights = draft_weights
        LOG.info("torch backend on %s, %s, kernels %s%s%s", self.device, dims.dtype, self.kernels, KERNEL_NOTES.get(self.kernels, ""),
                 ", draft weights fp8" if draft_weights == "fp8" else "")
        dtype = torch_dtype(dims.dtype)
        self.target = target.to(device=self.device, dtype=dtype).eval()
        self.draft = draft.to(device=self.device, dtype=dtype).eval()
        self.specs = c.graph_specs(dims)
        self.modules = {name: graph_module(spec, self.target, self.draft, dims) for name, spec in self.specs.items()}
        self.row_indexed = self.kernels in FUSED
        ops = None
        if self.row_indexed:
            ops = OPS[self.kernels](self.device) if isinstance(kernels, str) else kernels
        check_draft_weights_for(draft_weights, self.kernels, ops)
        if ops is not None:
            self.modules |= fast_path(self.specs, self.target, self.draft, dims, ops, draft_weights)
        self.stream = self.pools = self.graphs = None
        try:
            self._allocate(dtype, cuda_graphs)
        except BaseException:
            self.close()
            raise

    def _allocate(self, dtype: torch.dtype, cuda_graphs: bool) -> None:
        device_stream = None
        if self.device.type == "cuda":
            from dflash_trt.runtime.kernels.sampling import register_cuda_choose  # imports triton: CUDA only

            register_cuda_choose()
            self.stream = BackendStream()
            device_stream = self.stream.device_stream
            self.capturable = True
        rows = self.max_sessions + self.row_indexed  # + the scratch row of row-indexed programs
        self.pools = allocate_pools(pool_shapes(self.dims, rows, dtype), self.device, device_stream)
        if self.stream is not None and cuda_graphs:
            self.graphs = StaticGraphs(self.stream.torch, self._eager)

    @classmethod
    def from_checkpoints(
        cls, target_dir: str | Path, draft_dir: str | Path, dims: Dims | str | Path, max_sessions: int | None = None, **options
    ) -> TorchBackend:
        """Load the pair (HF layouts) in the contract's dtype, then build the backend.

        ``dims``: the contract dims, or an export directory whose manifest gives
        them (and the default ``max_sessions``), so the torch backend can run
        exactly the geometry of an artifact set.
        """
        if not isinstance(dims, Dims):
            from dflash_trt.export.manifest import load_manifest

            manifest = load_manifest(dims, verify="none")
            dims, max_sessions = manifest.dims(), max_sessions or manifest.max_sessions
        if max_sessions is None:
            raise EngineError("max_sessions is required when dims are given directly")
        target, draft = load_pair(target_dir, draft_dir, dtype=torch_dtype(dims.dtype))
        return cls(target, draft, dims, max_sessions, **options)

    open = from_checkpoints  # open_backend("torch", target_dir, draft_dir, dims_or_export_dir, ...)

    # ------------------------------------------------------------------ Backend

    def run(self, graph: str, feeds: Mapping[str, torch.Tensor], first_row: int) -> dict[str, torch.Tensor]:
        spec = self._spec(graph)
        check_run(spec, feeds, first_row, self.device, self.max_sessions)
        if self.stream is None:
            return self._eager(spec, feeds, first_row)  # CPU: finished on return
        with self.stream.scope():
            if self.graphs is not None and spec.owners is not None and not self.plain:
                return self.graphs.run(spec, feeds, first_row)
            outputs = self._eager(spec, feeds, first_row)
            self.stream.hand_over(outputs.values())
            return outputs

    def run_at(self, graph: str, feeds: Mapping[str, torch.Tensor], slots: torch.Tensor) -> dict[str, torch.Tensor]:
        """``run`` with the owners' cache rows as a device tensor ``slots`` [n] (int64; ``row_indexed``
        backends only; the scratch row ``max_sessions`` is a valid slot). Runs eagerly on the backend's
        stream (the device loop captures it); the rows are not checked on the host (no sync)."""
        spec = self._spec(graph)
        pool = pool_of(spec)
        if pool is None:
            return self.run(graph, feeds, 0)  # no cache: nothing to address
        if not self.row_indexed:
            raise EngineError(f"run_at: the {self.kernels!r} kernels of this torch backend bind row ranges; use run()")
        check_feeds(spec, feeds, self.device)
        if slots.dtype != torch.int64 or tuple(slots.shape) != (spec.owners,) or slots.device != self.device:
            msg = f"run_at({graph}): slots must be int64 [{spec.owners}] on {self.device}, got {slots.dtype} {list(slots.shape)} on {slots.device}"
            raise EngineError(msg)
        caches = self.pools[pool].interleaved(0, self.max_sessions + 1)  # whole pools, the scratch row included
        with self.stream.scope() if self.stream is not None else nullcontext(), torch.no_grad():
            results = self.modules[spec.name](*(feeds[s.name] for s in plain_inputs(spec)), *caches, rows=slots)
        names = [s.name for s in plain_outputs(spec)]
        return dict(zip(names, results[: len(names)]))

    def prefill_many(self, tokens: torch.Tensor, start: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor):
        """Batched prefill (row-indexed backends): tokens [n, T] (owner i's first lengths[i] real, the
        rest padding) at positions start[i].. of rows ``slots`` -> (fp32 logits [n, V] of each owner's
        last real row, taps [n, T, W]); K/V written for the real rows only. Eager, no host sync."""
        return self._ragged(PREFILL_MANY, "target", (tokens, start, lengths), slots)[:2]

    def draft_context_many(self, taps: torch.Tensor, start: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor) -> None:
        """Batched ``draft_context``: taps [n, C, W] of positions start[i].., owner i's first lengths[i]
        rows written into the draft cache rows ``slots``. Eager, no host sync."""
        self._ragged(DRAFT_CONTEXT_MANY, "draft", (taps, start, lengths), slots)

    def _ragged(self, name: str, pool: str, inputs: tuple, slots: torch.Tensor) -> tuple:
        if not self.row_indexed:
            raise EngineError(f"{name}: the {self.kernels!r} kernels of this torch backend have no ragged batches")
        if self.pools is None:
            raise EngineError(f"backend {self.name!r} is closed")
        caches = self.pools[pool].interleaved(0, self.max_sessions + 1)
        with self.stream.scope() if self.stream is not None else nullcontext(), torch.no_grad():
            return self.modules[name](*inputs, *caches, rows=slots)

    def _close_own(self) -> None:
        """Drop the CUDA-graph captures."""
        if self.graphs is not None:
            self.graphs.close()
            self.graphs = None

    # ------------------------------------------------------------------ internals

    def _spec(self, graph: str) -> GraphSpec:
        spec = self.specs.get(graph)
        if spec is None:
            raise EngineError(f"unknown graph {graph!r}; this backend runs {list(self.specs)}")
        if self.pools is None:
            raise EngineError(f"backend {self.name!r} is closed")
        return spec

    def _eager(self, spec: GraphSpec, feeds: Mapping[str, torch.Tensor], first_row: int) -> dict[str, torch.Tensor]:
        """Run the graph module once on the current stream; caches written in place. Never syncs (CUDA)."""
        pool = pool_of(spec)
        caches = self.pools[pool].interleaved(first_row, owner_rows(spec)) if pool else []
        with torch.no_grad():
            results = self.modules[spec.name](*(feeds[s.name] for s in plain_inputs(spec)), *caches)
        names = [s.name for s in plain_outputs(spec)]
        for view, present in zip(caches, results[len(names) :]):
            if present.data_ptr() != view.data_ptr():  # a kernel that is not in place: land it in the pool
                view.copy_(present)
        return dict(zip(names, results[: len(names)]))


class StaticGraphs:
    """CUDA graphs of the static contract graphs (see the module docstring for the keying).

    Per graph name: static input and output tensors, allocated once. Per
    (graph name, first_row): one ``torch.cuda.CUDAGraph`` that reads the
    static inputs, writes the pool rows in place and copies its outputs into
    the static outputs. All captures share one private memory pool; they are
    replayed one at a time on one stream.
    """

    def __init__(self, stream: torch.cuda.Stream, eager) -> None:
        self.stream, self.eager = stream, eager
        self.memory = torch.cuda.graph_pool_handle()
        self.inputs: dict[str, dict[str, torch.Tensor]] = {}
        self.outputs: dict[str, dict[str, torch.Tensor]] = {}
        self.captured: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}

    def run(self, spec: GraphSpec, feeds: Mapping[str, torch.Tensor], first_row: int) -> dict[str, torch.Tensor]:
        """Copy feeds into the static inputs and replay (capturing first if new). Must run on ``self.stream``.

        No host sync, except on a capture (first use of a (graph, first_row)).
        """
        inputs = self._static(self.inputs, spec, plain_inputs(spec))
        for name, tensor in inputs.items():
            tensor.copy_(feeds[name])
        key = (spec.name, first_row if pool_of(spec) is not None else 0)
        graph = self.captured.get(key)
        if graph is None:
            graph = self.captured[key] = self._capture(spec, key[1])
        graph.replay()
        return dict(self.outputs[spec.name])  # the static tensors; a fresh dict for the caller

    def _static(self, table: dict, spec: GraphSpec, specs) -> dict[str, torch.Tensor]:
        if spec.name not in table:
            table[spec.name] = {s.name: torch.zeros(s.shape, dtype=torch_dtype(s.dtype), device="cuda") for s in specs}
        return table[spec.name]

    def _capture(self, spec: GraphSpec, first_row: int) -> torch.cuda.CUDAGraph:
        inputs, outputs = self.inputs[spec.name], self._static(self.outputs, spec, plain_outputs(spec))
        # Warm-up (lazy inits, cuBLAS workspaces) outside the capture. It is a real
        # run over the same feeds: every graph is idempotent for equal inputs.
        self.eager(spec, inputs, first_row)
        graph = torch.cuda.CUDAGraph()
        # Host sync: torch.cuda.graph synchronizes the device before capturing (first use only).
        with torch.cuda.graph(graph, pool=self.memory, stream=self.stream):
            results = self.eager(spec, inputs, first_row)
            for name, tensor in results.items():
                outputs[name].copy_(tensor)
        return graph

    def close(self) -> None:
        self.captured.clear()
        self.inputs.clear()
        self.outputs.clear()


def check_models(target: TargetModel, draft: DraftModel, dims: Dims) -> None:
    """The models must have the geometry the contract's ``dims`` describe (field, both values)."""
    facts = {
        "vocab_size": target.config.vocab_size,
        "tap_width": target.tap_width,
        "block_size": draft.config.block_size,
        "target_layers": target.config.num_layers,
        "target_kv_heads": target.config.num_kv_heads,
        "target_head_dim": target.config.head_dim,
        "draft_layers": draft.config.num_layers,
        "draft_kv_heads": draft.config.num_kv_heads,
        "draft_head_dim": draft.config.head_dim,
    }
    wrong = [f"{k}: dims {getattr(dims, k)}, models {v}" for k, v in facts.items() if getattr(dims, k) != v]
    if wrong:
        raise EngineError("the models do not match the graph dims: " + "; ".join(wrong))


def check_draft_weights_for(draft_weights: str, kernels: str, ops) -> None:
    """``draft_weights`` in ``kernels.quant.DRAFT_WEIGHTS`` (``check_draft_weights``); "fp8" needs ops with fp8
    products (``fp8_linear``): the exact kernels (CUDA, or Triton's interpreter) or the fast path's torch twin (the CPU)."""
    if check_draft_weights(draft_weights) == "fp8" and not getattr(ops, "fp8_linear", False):
        raise EngineError(f"draft_weights='fp8' runs on the exact kernels (CUDA: kernels='exact', the bf16 default) or the fast "
                          f"path's torch twin (the CPU: kernels='fast'), got kernels={kernels!r}"
                          f"{'' if ops is None else ' (' + type(ops).__name__ + ')'}")


def choose_kernels(kernels, device: torch.device, target: TargetModel, draft: DraftModel, dtype: str) -> str:
    """"fast", "exact" or "eager" for ``kernels`` in KERNELS. "auto", on CUDA where the pair is supported: "exact"
    in bf16 (the fast kernels' reduction orders follow the batch, so bf16 DFlash output drifts from plain decoding
    on some prompts: benchmarks/RESULTS.md "exact by default"), "fast" in other dtypes; elsewhere "eager".

    Anything else with a ``linear`` method is an ops object (e.g. ``TritonOps`` with measured GEMV
    plans) for the fused graphs; its ``kind`` attribute names it ("fast" when it has none).
    """
    if not isinstance(kernels, str) and callable(getattr(kernels, "linear", None)):
        kernels = getattr(kernels, "kind", "fast")
    elif kernels not in KERNELS:
        raise EngineError(f"kernels must be one of {list(KERNELS)} or an ops object, got {kernels!r}")
    reason = supported(target, draft)
    if kernels == "auto":
        if device.type != "cuda" or reason is not None:
            return "eager"
        return "exact" if dtype == "bfloat16" else "fast"
    if kernels in FUSED and reason is not None:
        raise EngineError(f"kernels={kernels!r} cannot run this pair: {reason}")
    if kernels == "exact" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise EngineError(f"kernels='exact' runs Triton kernels: it needs a CUDA device (or Triton's interpreter, TRITON_INTERPRET=1), got device {device}")
    return kernels
