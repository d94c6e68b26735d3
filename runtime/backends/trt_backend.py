"""The TensorRT backend: an engine set from ``dflash_trt.engines``, bound in place.

Load: ``engines.load.load_engine_set`` checks the set (files, hashes,
flavour/version, profiles and bindings against the contract, in-place cache
aliasing) and deserializes every plan: one per model (``target_model``,
``draft_model``: each model's weights once on the GPU) and one per small
graph. Every run graph gets one execution context of the engine that
computes it, set to its optimization profile (``routes.Route``;
``Flavour.execution_context``: TensorRT-RTX adds its runtime cache), without
scratch memory of its own: the contexts run one at a time on the backend's
one stream, so ONE device buffer, as large as the largest profile needs, is
every context's scratch (``SharedScratch``; its bytes per profile in
``scratch.needs``). Every plain output gets one device-layer buffer at its
largest shape for that run graph, bound ONCE, and the pools are allocated.
The weights both models read (the target's embedding and LM head: inputs
of both model engines, ``engines.shared_weights``) are read from the set's
file once, hashed on the way, copied to ONE device buffer each, and bound
once to every context of both engines.
A set without the sampled verifiers (greedy-only) loads; ``graph_names``
says what it runs.

Run: route the feeds (``picks`` and the like are views of constants made at
load), set their addresses and input shapes, bind ``past_*`` and
``present_*`` of every layer to the SAME pool rows (re-bound only when
``first_row`` changes for that context), ``execute_async_v3`` on the
backend's stream. Nothing synchronizes the host.

Optional CUDA graphs (``cuda_graphs=True``) for the run graphs of one shape: like the
torch backend, one capture per (graph, first_row) over per-graph static input
buffers (feeds are copied in on the stream), made after one real warm-up
enqueue, as TensorRT requires, in thread-local capture mode. A context that
says it cannot be captured (``is_stream_capturable``: TensorRT-RTX, e.g.
data-dependent shapes) runs eagerly instead, and so does one whose capture
fails (``device.CaptureFallback``: the first failure is logged, once per
backend). Inside ``plain_runs()`` a run is a plain ``execute_async_v3``
(``capturable`` when every context may be captured): the executor records
it into its own per-cycle graph, after a real enqueue of the same cycle.
TensorRT-RTX contexts of every run graph but the chunked ones (prefill,
draft context) specialize their kernels eagerly, so the warm-up compiles
what a capture then records (``Flavour.execution_context``). Every
TensorRT call goes through ``engines.calls.trt_call``: a refusal (False,
None) or a raise (full TensorRT's ``set_optimization_profile_async``) is an
``EngineError`` naming the engine, the run graph and the call.

This backend runs wherever TensorRT runs a plan for the GPU at hand
(TensorRT-RTX, for one, does not run on Hopper; docs/design.md §7). Without
TensorRT, or without a GPU, it refuses at construction with a typed error
saying which is missing.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from dflash_trt.engines.calls import trt_call
from dflash_trt.errors import CudaError, EngineError
from dflash_trt.export import contract as c
from dflash_trt.export.contract import Dims
from dflash_trt.runtime.backends.base import Backend
from dflash_trt.runtime.backends.graph_io import (
    check_run,
    owner_rows,
    plain_inputs,
    plain_outputs,
    pool_of,
    prefix_view,
    torch_dtype,
)
from dflash_trt.runtime.backends.pools import allocate_pools, check_sessions, pool_shapes
from dflash_trt.runtime.backends.routes import Route, RouteConstants, routes
from dflash_trt.runtime.backends.streams import BackendStream, select_device
from dflash_trt.runtime.device import CaptureFallback

# Run graphs fed many lengths (prompt chunks, context chunks): never captured, kernels specialized lazily.
CHUNKED_KINDS = (c.TARGET_PREFILL, c.DRAFT_CONTEXT)


class TensorRTBackend(Backend):
    """Contract graphs as TensorRT execution contexts over in-place pools (CUDA only)."""

    name = "tensorrt"

    def __init__(
        self,
        directory: str | Path,
        max_sessions: int | None = None,
        dims: Dims | None = None,
        device: str | torch.device = "cuda",
        flavour=None,
        cuda_graphs: bool = False,
        runtime_cache_dir: str | Path | None = None,
    ) -> None:
        from dflash_trt.engines.load import load_engine_set
        from dflash_trt.runtime import device as cuda

        self.device, self.directory = torch.device(device), Path(directory)
        _require_gpu(cuda, self.device)
        self.device = select_device(self.device)  # before TensorRT deserializes onto the current device
        self.dims, manifest_sessions = _dims_and_sessions(self.directory, dims)
        self.max_sessions = check_sessions(max_sessions or manifest_sessions)
        self.routes = routes(self.dims)
        self.runtime_cache_dir = Path(runtime_cache_dir) if runtime_cache_dir else None
        self.stream = self.pools = self.engine_set = self.scratch = self.constants = None
        self.contexts: dict[str, EngineContext] = {}  # run graph -> its context
        self.shared: dict[str, object] = {}  # shared weight -> its one device buffer
        try:
            self.engine_set = load_engine_set(self.directory, c.export_specs(self.dims), flavour)
            self._allocate(cuda, cuda_graphs)
        except BaseException:
            self.close()
            raise

    def _allocate(self, cuda, cuda_graphs: bool) -> None:
        self.stream = BackendStream()
        dtype = torch_dtype(self.dims.dtype)
        self.pools = allocate_pools(pool_shapes(self.dims, self.max_sessions, dtype), self.device, self.stream.device_stream)
        self.constants = RouteConstants(self.dims, self.device)
        self._upload_shared(cuda)
        flavour, engines = self.engine_set.flavour, self.engine_set.engines
        served = {name: route for name, route in self.routes.items() if route.graph.name in engines}  # greedy-only: no verify_sample_*
        self.scratch = SharedScratch(cuda, {name: scratch_bytes(engines[r.graph.name], r.index) for name, r in served.items()}, self.stream)
        self.fallback = CaptureFallback("the tensorrt backend")
        for name, route in served.items():
            self.contexts[name] = self._open_context(cuda, flavour, engines[route.graph.name], route, cuda_graphs)

    def _upload_shared(self, cuda) -> None:
        """One device copy of the weights both models' engines read (``engines.shared_weights``),
        read from its file once and hashed on the way."""
        from dflash_trt.engines.shared_weights import read_shared_weights

        record = self.engine_set.record.shared_weights
        if record is None:
            return
        with self.stream.scope():
            for name, tensor in read_shared_weights(self.directory, record).items():
                self.shared[name] = cuda.DeviceBuffer(tuple(tensor.shape), tensor.dtype, self.stream.device_stream)
                self.shared[name].as_tensor().copy_(tensor)

    def _open_context(self, cuda, flavour, engine, route: Route, cuda_graphs: bool) -> EngineContext:
        """One run graph's context: shared scratch, its profile, CUDA graphs where it has one shape."""
        name = route.run.name
        # Kernels specialized at the first enqueue for every run graph a CUDA graph may record
        # (TensorRT-RTX; all but the chunked ones, which see many lengths and run eagerly).
        specialize = route.run.kind not in CHUNKED_KINDS
        context, cache = flavour.execution_context(engine, self.runtime_cache_dir, name, user_memory=True, specialize=specialize)
        self.scratch.attach(name, context)
        if route.graph.profiles:
            where = f"engine {route.graph.name!r} ({name})"
            trt_call(where, "set_optimization_profile_async", context.set_optimization_profile_async, route.index, self.stream.ptr)
        graphs = cuda_graphs and not route.run.dims  # a run graph of one shape
        return EngineContext(cuda, route, context, cache, self.stream, graphs, self.fallback, self.weights_of(route))

    def weights_of(self, route: Route) -> dict[str, int]:
        """The shared weights' addresses a run graph's context binds: a model's, every one; others none."""
        return {name: buffer.ptr for name, buffer in self.shared.items()} if route.graph.kind in c.MODEL_KINDS else {}

    # ------------------------------------------------------------------ Backend

    @property
    def graph_names(self) -> tuple[str, ...]:
        return tuple(self.contexts)

    def run(self, graph: str, feeds: Mapping[str, torch.Tensor], first_row: int) -> dict[str, torch.Tensor]:
        context = self.contexts.get(graph)
        if context is None:
            raise EngineError(f"graph {graph!r} is not in this engine set (or the backend is closed); it runs {list(self.contexts)}")
        route = context.route
        sizes = check_run(route.run, feeds, first_row, self.device, self.max_sessions)
        pool = pool_of(route.run)
        routed = route.feeds(feeds, sizes, self.constants)
        with self.stream.scope():
            if pool is not None:
                context.bind_caches(first_row, self.pools[pool].interleaved(first_row, owner_rows(route.run)))
            return route.outputs(context.run(routed, route.sizes(sizes), first_row, replay=not self.plain), sizes)

    @property
    def capturable(self) -> bool:
        """A caller may capture runs into its own graph: every context must allow stream capture."""
        return bool(self.contexts) and all(context._capturable() for context in self.contexts.values())

    def _close_own(self) -> None:
        """Contexts (saving their runtime caches), engines, shared scratch, route constants, in that order."""
        flavour = self.engine_set.flavour if self.engine_set is not None else None
        for context in self.contexts.values():
            if flavour is not None and self.runtime_cache_dir is not None:
                flavour.save_runtime_cache(context.cache, self.runtime_cache_dir)
            context.close()
        self.contexts.clear()
        if self.engine_set is not None:
            self.engine_set.close()
            self.engine_set = None
        if self.scratch is not None:
            self.scratch.close()
            self.scratch = None
        for buffer in self.shared.values():
            buffer.close()
        self.shared.clear()
        self.constants = None


def scratch_bytes(engine, profile: int) -> int:
    """Scratch memory one profile of an engine needs (a TensorRT without the per-profile query: the engine's largest)."""
    per_profile = getattr(engine, "get_device_memory_size_for_profile_v2", None)
    return int(per_profile(profile)) if per_profile is not None else int(engine.device_memory_size_v2)


class SharedScratch:
    """One device buffer that is every context's scratch memory (they never run at once)."""

    def __init__(self, cuda, needs: dict[str, int], stream) -> None:
        self.needs = dict(needs)  # run graph -> bytes its profile needs
        self.nbytes = max(self.needs.values(), default=0)  # the largest need: every context fits
        self.buffer = cuda.DeviceBuffer((self.nbytes,), torch.uint8, stream.device_stream)

    def attach(self, name: str, context) -> None:
        if not self.buffer.ptr:
            raise EngineError("the shared scratch buffer is closed")
        # TensorRT returns None (older) or a bool: only False (or a raise) is a refusal.
        trt_call(f"run graph {name!r} (shared scratch)", "set_device_memory", context.set_device_memory, self.buffer.ptr, self.nbytes)

    def close(self) -> None:
        self.buffer.close()


class EngineContext:
    """One run graph's execution context (its engine at its profile), its output buffers and
    (optionally) its CUDA graphs. Names and shapes are the exported graph's."""

    def __init__(self, cuda, route: Route, context, cache, stream, cuda_graphs: bool, fallback=None, weights: Mapping[str, int] | None = None) -> None:
        self.cuda, self.route, self.context, self.cache, self.stream = cuda, route, context, cache, stream
        self.fallback = fallback or CaptureFallback(f"engine {route.graph.name!r}")
        self.where = f"engine {route.graph.name!r} ({route.run.name})"
        self.spec = spec = route.graph
        self.bound_row: int | None = None  # first_row the cache addresses are set for
        self.buffers, self.outputs = self._allocate(plain_outputs(spec))
        for s in plain_outputs(spec):
            self._address(s.name, self.buffers[s.name].ptr)  # bound once: these never move
        for name, ptr in (weights or {}).items():
            self._address(name, ptr)  # the shared weights (static inputs): bound once too
        self.input_buffers: dict = {}
        self.static_inputs: dict[str, torch.Tensor] = {}  # non-empty: replay CUDA graphs
        if cuda_graphs:
            self.input_buffers, self.static_inputs = self._allocate(plain_inputs(spec))
        self.graphs: dict[int, object] = {}  # first_row -> device.CudaGraph
        self.capturable: bool | None = None  # unknown until the first run with cuda_graphs

    def _allocate(self, specs) -> tuple[dict, dict[str, torch.Tensor]]:
        """Device buffers at each binding's largest shape for this run graph, and flat torch views of them."""
        largest = self.route.max_sizes
        buffers = {s.name: self.cuda.DeviceBuffer(s.resolve(largest), torch_dtype(s.dtype), self.stream.device_stream) for s in specs}
        return buffers, {name: b.as_tensor().view(-1) for name, b in buffers.items()}

    def _address(self, name: str, ptr: int) -> None:
        trt_call(self.where, "set_tensor_address", self.context.set_tensor_address, name, ptr)

    def bind_caches(self, first_row: int, views: list[torch.Tensor]) -> None:
        """past_* and present_* of every layer -> the same pool rows (only when first_row changed)."""
        if self.bound_row == first_row:
            return
        for s, view in zip(self.spec.cache_inputs, views):
            self._shape(s.name, tuple(view.shape))  # the model's owner count N is an input dim
            self._address(s.name, view.data_ptr())
            self._address(c.present_of(s.name), view.data_ptr())  # in place: same memory
        self.bound_row = first_row

    def run(self, feeds: Mapping[str, torch.Tensor], sizes: dict[str, int], first_row: int, replay: bool = True) -> dict[str, torch.Tensor]:
        """Enqueue on the stream (current torch stream = ours); returns views of the output buffers. No host sync.

        ``replay`` False: a plain enqueue even where this context has CUDA graphs (a caller captures it).
        """
        if self.static_inputs and replay and self._capturable():
            self._replay(feeds, first_row)
        else:
            self._bind_inputs(feeds)
            self._execute()
        return {s.name: prefix_view(self.outputs[s.name], s.resolve(sizes)) for s in plain_outputs(self.spec)}

    def _bind_inputs(self, feeds: Mapping[str, torch.Tensor]) -> None:
        for s in plain_inputs(self.spec):
            tensor = feeds[s.name]
            if any(isinstance(d, str) for d in s.shape):
                self._shape(s.name, tuple(tensor.shape))
            self._address(s.name, tensor.data_ptr())

    def _shape(self, name: str, shape: tuple[int, ...]) -> None:
        trt_call(self.where, "set_input_shape", self.context.set_input_shape, name, shape)

    def _capturable(self) -> bool:
        """Whether this context may be captured on the stream; asked once (TensorRT-RTX answers,
        full TensorRT has no such query). When it may not, the graph runs eagerly."""
        if self.capturable is None:
            ask = getattr(self.context, "is_stream_capturable", None)
            self.capturable = True if ask is None else bool(trt_call(self.where, "is_stream_capturable", ask, self.stream.ptr, false_fails=False))
            if not self.capturable:
                self._drop_static_inputs()
        return self.capturable

    def _drop_static_inputs(self) -> None:
        for name in list(self.input_buffers):
            self.input_buffers.pop(name).close()
        self.static_inputs = {}

    def _execute(self) -> None:
        trt_call(self.where, "execute_async_v3", self.context.execute_async_v3, self.stream.ptr)

    def _replay(self, feeds: Mapping[str, torch.Tensor], first_row: int) -> None:
        """Static graph: copy feeds into the static inputs, launch the (graph, first_row) capture."""
        for s in plain_inputs(self.spec):
            self.static_inputs[s.name].copy_(feeds[s.name].reshape(-1))
        graph = self.graphs.get(first_row)
        if graph is None:
            for s in plain_inputs(self.spec):
                if any(isinstance(d, str) for d in s.shape):
                    self._shape(s.name, tuple(feeds[s.name].shape))
                self._address(s.name, self.input_buffers[s.name].ptr)
            self._execute()  # warm-up: TensorRT applies deferred updates (and specializes kernels) on the first enqueue
            graph = self.fallback.capture(f"{self.where} at row {first_row}", self._capture)
            if graph is None:  # eager from now on; the warm-up computed this run's outputs
                self.capturable = False
                self._drop_static_inputs()
                return
            self.graphs[first_row] = graph
        graph.launch(self.stream.device_stream)

    def _capture(self):
        """One enqueue as a CUDA graph (thread-local capture mode); a failure closes it and propagates."""
        graph = self.cuda.CudaGraph()
        try:
            with graph.capture(self.stream.device_stream, mode="thread_local"):
                self._execute()
        except BaseException:
            graph.close()
            raise
        return graph

    def close(self) -> None:
        for graph in self.graphs.values():
            graph.close()
        self.graphs.clear()
        self.context = None
        for buffer in [*self.buffers.values(), *self.input_buffers.values()]:
            buffer.close()


def _require_gpu(cuda, device: torch.device) -> None:
    if device.type != "cuda":
        raise EngineError(f"the tensorrt backend runs on CUDA devices only, got device {str(device)!r}")
    if not cuda.cuda_available():
        msg = "the tensorrt backend needs a CUDA GPU and cuda-python (none usable here); use the onnxruntime or torch backend"
        raise CudaError(msg, call="cudaGetDeviceCount")


def _dims_and_sessions(directory: Path, dims: Dims | None) -> tuple[Dims, int | None]:
    """Dims from the export manifest copied beside the plans (or the caller's, checked against it)."""
    from dflash_trt.export.manifest import MANIFEST_FILE, load_manifest

    if not (directory / MANIFEST_FILE).is_file():
        if dims is None:
            raise EngineError(f"{directory} has no {MANIFEST_FILE}: pass dims= (and max_sessions=) or rebuild with the export manifest")
        return dims, None
    manifest = load_manifest(directory, verify="none")
    if dims is not None and dims != manifest.dims():
        raise EngineError(f"dims given ({dims}) differ from {directory / MANIFEST_FILE} ({manifest.dims()})")
    return manifest.dims(), manifest.max_sessions
