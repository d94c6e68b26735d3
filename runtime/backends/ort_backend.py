"""The ONNX Runtime backend: the exact exported ONNX files, IO bound to our memory.

One ``InferenceSession`` per exported graph (created at load, or on first use
with ``lazy=True``): the two model networks serve every target / draft run
graph through ``routes.Route``, so each model's weights are loaded once. Each
run graph has its own ``IOBinding`` on its exported graph's session, bound by
raw pointer (a run binds again only what moved: a binding outlives a run):

- cache inputs ``past_*`` AND outputs ``present_*`` -> the same pool rows
  (``CachePool.interleaved(first_row, n)``): the graph's ``TensorScatter``
  writes the new slots in place, nothing is copied back;
- other inputs -> the caller's feed tensors (no copy);
- other outputs -> tensors preallocated once per run graph at their largest
  shape; a dynamic output is bound to a prefix of its buffer.

The first run of each graph checks that ONNX Runtime really wrote every bound
output where it was bound (``OrtValue.data_ptr``); if it ever allocated its
own output instead, the result is copied into place and ``copied_outputs``
counts it (ONNX Runtime 1.32 CPU writes in place: the tests check the pools).

Intra-op threads spin while a run lasts and stop when it returns (``spinning=True``:
they keep spinning between runs, ONNX Runtime's default, which starves other work
on the same cores). On the CPU torch is only the executor's glue here (views, a few
copies): ``torch_threads`` sets torch's intra-op threads while the backend is open
(process-wide, ``torch.set_num_threads``; what it was comes back at close). The CLI's
commands open it with 1: a copy large enough for torch's OpenMP pool (a prefill chunk's
taps, ~1 MB) left that pool's threads spinning on the cores ONNX Runtime's next run
computes on (the main job's DFlash prefill +~40 ms of ~450).

CPU provider by default. ``device="cuda"`` uses the CUDA provider alone
(CPU fallback only for ORT's own shape subgraphs, onnxruntime-gpu needed) on the backend's
device-layer stream (``user_compute_stream``), with the pools in
device-layer memory. ONNX Runtime synchronizes its bound outputs before
``run_with_iobinding`` returns, so a CUDA ``run`` here is a host sync point.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from dflash_trt.checks import is_int
from dflash_trt.errors import EngineError
from dflash_trt.export import contract as c
from dflash_trt.export.contract import ONNX_ELEMENT_TYPES, Dims, GraphSpec, TensorSpec
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

OPTIMIZATION_LEVELS = ("disable", "basic", "extended", "all")
# ONNX Runtime's CPU provider runs the graphs in these dtypes; bf16 lacks CPU kernels for their ops
# (Mul, Expand: NOT_IMPLEMENTED at the first run).
CPU_DTYPES = ("float32", "float16")
_SHORT = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def check_dtype(dtype: str, device: str | torch.device) -> None:
    """Refuse (EngineError) graphs of a dtype the provider of ``device`` cannot run, before any session loads."""
    if torch.device(device).type == "cpu" and dtype not in CPU_DTYPES:
        name = _SHORT.get(dtype, dtype)
        msg = (f"ONNX Runtime's CPU provider cannot run a {name} export (no {name} kernels for its ops); "
               f"export with --dtype fp32 (dflash-trt export's default for --backend onnxruntime), or run it on a GPU "
               f"(--device cuda with onnxruntime-gpu)")
        raise EngineError(msg)


class OrtBackend(Backend):
    """Contract graphs as ONNX Runtime sessions over in-place pools (CPU or CUDA provider)."""

    name = "onnxruntime"

    def __init__(
        self,
        graph_files: Mapping[str, str | Path],
        dims: Dims,
        max_sessions: int,
        device: str | torch.device = "cpu",
        threads: int | None = None,
        optimization: str = "all",
        lazy: bool = False,
        spinning: bool = False,
        torch_threads: int | None = None,
    ) -> None:
        import onnxruntime

        self._torch_threads = None  # torch's intra-op threads before ``torch_threads`` (restored at close)
        check_dtype(dims.dtype, device)
        self.ort, self.device = onnxruntime, torch.device(device)  # index filled in by _allocate
        self.dims, self.max_sessions = dims, check_sessions(max_sessions)
        self.routes = routes(dims)
        self.files = _graph_files(c.export_specs(dims), graph_files)
        self.options = _session_options(onnxruntime, threads, optimization, self.device, spinning)
        self.stream = self.pools = self.constants = None
        self.models: dict[str, object] = {}  # exported graph -> its InferenceSession
        self.sessions: dict[str, GraphSession] = {}  # run graph -> its binding on that session
        self.views: dict[tuple[str, int, int], list[torch.Tensor]] = {}  # (pool, first row, rows) -> cache views
        self.copied_outputs = 0  # outputs ONNX Runtime did not write in place (copied by us)
        try:
            self._set_torch_threads(torch_threads)
            self._allocate(lazy)
        except BaseException:
            self.close()
            raise

    def _set_torch_threads(self, threads: int | None) -> None:
        """``torch_threads`` (CPU only; None: torch as it is): set now, what it was kept for ``close``."""
        if threads is not None and (not is_int(threads) or threads < 1):
            raise EngineError(f"torch_threads must be an int >= 1 or None, got {threads!r}")
        if threads is None or self.device.type != "cpu":
            return
        self._torch_threads = torch.get_num_threads()
        torch.set_num_threads(threads)

    def _allocate(self, lazy: bool) -> None:
        if self.device.type == "cuda":
            _require_cuda_provider(self.ort)
            if hasattr(self.ort, "preload_dlls"):
                # onnxruntime-gpu finds CUDA/cuDNN in the nvidia-* wheels torch ships with.
                self.ort.preload_dlls()
            self.device = select_device(self.device)
            self.stream = BackendStream()
        device_stream = self.stream.device_stream if self.stream is not None else None
        self.pools = allocate_pools(pool_shapes(self.dims, self.max_sessions, torch_dtype(self.dims.dtype)), self.device, device_stream)
        self.constants = RouteConstants(self.dims, self.device)
        if not lazy:
            for name in self.routes:
                self._session(name)

    @classmethod
    def from_export(cls, directory: str | Path, max_sessions: int | None = None, verify: str = "hash", **options) -> OrtBackend:
        """Open an export directory through its manifest (graph files, dims, max sessions).

        ``verify``: the manifest loader's check level (``none`` / ``io`` / ``hash``). The default
        checks every file's sha256 (remembered per file version: ``export.identity.verified_sha256``).
        """
        from dflash_trt.export.manifest import load_manifest

        manifest = load_manifest(directory, verify=verify)
        files = {name: Path(directory) / graph.file for name, graph in manifest.graphs.items()}
        return cls(files, manifest.dims(), max_sessions or manifest.max_sessions, **options)

    open = from_export  # open_backend("onnxruntime", export_dir, ...)

    # ------------------------------------------------------------------ Backend

    def run(self, graph: str, feeds: Mapping[str, torch.Tensor], first_row: int) -> dict[str, torch.Tensor]:
        session = self._session(graph)
        route = session.route
        sizes = check_run(route.run, feeds, first_row, self.device, self.max_sessions)
        pool = pool_of(route.run)
        caches = self._views(pool, first_row, owner_rows(route.run)) if pool else []
        routed = route.feeds(feeds, sizes, self.constants)
        if self.stream is None:
            return route.outputs(self._run(session, routed, caches, route.sizes(sizes)), sizes)
        with self.stream.scope():
            # Host sync: ONNX Runtime's run blocks until its outputs are done anyway; waiting
            # for our stream here (which waits for the caller's) also orders the feeds for a
            # provider that ignores user_compute_stream.
            self.stream.torch.synchronize()
            return route.outputs(self._run(session, routed, caches, route.sizes(sizes)), sizes)

    def _close_own(self) -> None:
        """Drop the bindings, the cache row views, the InferenceSessions and the route constants; torch's
        threads as they were before ``torch_threads``."""
        self.sessions.clear()
        self.views.clear()
        self.models.clear()
        self.constants = None
        if self._torch_threads is not None:
            torch.set_num_threads(self._torch_threads)
            self._torch_threads = None

    # ------------------------------------------------------------------ internals

    def _views(self, pool: str, first: int, n: int) -> list[torch.Tensor]:
        """The cache row views a graph over rows ``first .. first+n-1`` binds, in binding order: made once
        per (pool, first row, rows) and the same list after (the pools never move), which its session's
        binding recognises by identity."""
        key = (pool, first, n)
        views = self.views.get(key)
        if views is None:
            views = self.views[key] = self.pools[pool].interleaved(first, n)
        return views

    def _session(self, graph: str) -> GraphSession:
        session = self.sessions.get(graph)
        if session is not None:
            return session
        route = self.routes.get(graph)
        if route is None:
            raise EngineError(f"unknown graph {graph!r}; this backend runs {list(self.routes)}")
        if self.pools is None:
            raise EngineError(f"backend {self.name!r} is closed")
        self.sessions[graph] = session = GraphSession(route, self._model(route.graph), self.device)
        return session

    def _model(self, graph: GraphSpec):
        """The InferenceSession of exported graph ``graph`` (made once, shared by its run graphs)."""
        if graph.name not in self.models:
            path, providers = self.files[graph.name], _providers(self.device, self.stream)
            try:
                session = self.ort.InferenceSession(str(path), sess_options=self.options, providers=providers)
            except Exception as error:  # ORT raises its own exception types (Fail, InvalidGraph, ...)
                raise EngineError(f"graph {graph.name!r}: ONNX Runtime cannot load {path}: {error}") from error
            _check_session_io(graph, session, path)
            self.models[graph.name] = session
        return self.models[graph.name]

    def _run(self, session: GraphSession, feeds, caches: list[torch.Tensor], sizes: dict[str, int]) -> dict[str, torch.Tensor]:
        outputs = session.bind(feeds, caches, sizes)
        session.session.run_with_iobinding(session.binding)
        if not session.verified:
            self.copied_outputs += session.land_outputs(outputs, caches)
        return {s.name: outputs[s.name] for s in session.outputs}


class GraphSession:
    """One run graph: its exported graph's session, its own IO binding and preallocated plain outputs."""

    def __init__(self, route: Route, session, device: torch.device) -> None:
        self.route, self.spec, self.session, self.device = route, route.graph, session, device
        self.binding = self.session.io_binding()
        largest = route.max_sizes
        self.buffers = {s.name: torch.zeros(s.resolve(largest), dtype=torch_dtype(s.dtype), device=device) for s in plain_outputs(self.spec)}
        self.verified = False
        self.ort_device = "cuda" if device.type == "cuda" else "cpu"
        self.device_id = device.index or 0
        self.inputs, self.outputs = plain_inputs(self.spec), plain_outputs(self.spec)
        self.caches = [(past, _present(past)) for past in self.spec.cache_inputs]
        # A binding outlives a run, so what it holds is not bound again (~5 µs a tensor): per plain input
        # and output its (address, shape), and the cache views list last bound (``OrtBackend._views``).
        self.bound: dict[str, tuple[int, tuple[int, ...]]] = {}
        self.bound_caches: list[torch.Tensor] | None = None

    def bind(self, feeds, caches: list[torch.Tensor], sizes: dict[str, int]) -> dict[str, torch.Tensor]:
        """Bind every input and output by pointer (unless bound there already); returns the output tensors
        by name (views of our memory)."""
        for s in self.inputs:
            self._bind(self.binding.bind_input, s, feeds[s.name])
        outputs = {}
        for s in self.outputs:
            shape = s.resolve(sizes)
            outputs[s.name] = prefix_view(self.buffers[s.name].view(-1), shape)
            self._bind(self.binding.bind_output, s, outputs[s.name])
        if caches is not self.bound_caches:
            self.bound_caches = None  # until every cache is bound
            for (past, present), view in zip(self.caches, caches):
                self._bind(self.binding.bind_input, past, view)
                self._bind(self.binding.bind_output, present, view)  # same memory: written in place
            self.bound_caches = caches
        return outputs

    def _bind(self, bind, s: TensorSpec, tensor: torch.Tensor) -> None:
        where = (tensor.data_ptr(), tuple(tensor.shape))
        if self.bound.get(s.name) != where:
            bind(s.name, self.ort_device, self.device_id, ONNX_ELEMENT_TYPES[s.dtype], list(where[1]), where[0])
            self.bound[s.name] = where

    def land_outputs(self, outputs: dict[str, torch.Tensor], caches: list[torch.Tensor]) -> int:
        """After a first run: did ORT write each output at its bound address? Copy any that it did not."""
        bound = dict(outputs) | {present.name: view for (_, present), view in zip(self.caches, caches)}
        copied = 0
        for name, value in zip(self.session.get_outputs(), self.binding.get_outputs()):
            target = bound[name.name]
            if value.data_ptr() != target.data_ptr():
                target.copy_(torch.from_numpy(value.numpy()).view(target.shape))
                copied += 1
        self.verified = copied == 0  # keep checking while ORT does not write in place
        return copied


def _present(past: TensorSpec) -> TensorSpec:
    return TensorSpec(c.present_of(past.name), past.shape, past.dtype)



def _check_session_io(spec: GraphSpec, session, path: Path) -> None:
    """The ONNX file must declare exactly the contract's binding names."""
    inputs = sorted(i.name for i in session.get_inputs())
    outputs = sorted(o.name for o in session.get_outputs())
    if inputs != sorted(spec.input_names) or outputs != sorted(spec.output_names):
        msg = (
            f"graph {spec.name!r}: {path} declares inputs {inputs} and outputs {outputs}; "
            f"the contract says inputs {sorted(spec.input_names)} and outputs {sorted(spec.output_names)}"
        )
        raise EngineError(msg)


def _graph_files(specs: Mapping[str, GraphSpec], files: Mapping[str, str | Path]) -> dict[str, Path]:
    missing = sorted(set(specs) - set(files))
    if missing:
        raise EngineError(f"no ONNX file for graphs {missing} (given: {sorted(files)})")
    absent = sorted(name for name in specs if not Path(files[name]).is_file())
    if absent:
        raise EngineError(f"ONNX files missing for graphs {absent}: {[str(files[n]) for n in absent]}")
    return {name: Path(files[name]) for name in specs}


def _session_options(ort, threads: int | None, optimization: str, device: torch.device, spinning: bool):
    if optimization not in OPTIMIZATION_LEVELS:
        raise EngineError(f"optimization must be one of {OPTIMIZATION_LEVELS}, got {optimization!r}")
    if threads is not None and (not is_int(threads) or threads < 0):
        raise EngineError(f"threads must be an int >= 0 (0 = ONNX Runtime's default), got {threads!r}")
    levels = ort.GraphOptimizationLevel
    options = ort.SessionOptions()
    options.graph_optimization_level = {
        "disable": levels.ORT_DISABLE_ALL,
        "basic": levels.ORT_ENABLE_BASIC,
        "extended": levels.ORT_ENABLE_EXTENDED,
        "all": levels.ORT_ENABLE_ALL,
    }[optimization]
    options.intra_op_num_threads = threads or 0
    options.inter_op_num_threads = 1  # graphs run sequentially; parallelism is inside ops
    options.log_severity_level = 3  # errors only: every refusal is raised as EngineError
    # Intra-op threads spin inside a run: a graph of ~300 small nodes otherwise wakes its
    # workers once per node (2 cores: a decode step ~20%, a cycle ~15% faster spinning). At the
    # end of a run they stop unless ``spinning``: idle spinners between runs starve the
    # caller's own torch work on the same cores (seen: 76 s -> 2 s on 2 cores) and the
    # other graphs' sessions (a cycle runs three, each with its own pool).
    options.add_session_config_entry("session.intra_op.allow_spinning", "1")
    options.add_session_config_entry("session.force_spinning_stop", "0" if spinning else "1")
    # On CUDA, ORT keeps its small int64 shape subgraphs (positions, lengths) on
    # the CPU provider by design (seen on an H200 with onnxruntime-gpu 1.31:
    # disabling the fallback refuses target_prefill), so the fallback stays on;
    # the caches and every bound tensor still live in device memory.
    return options


def _providers(device: torch.device, stream) -> list:
    if device.type != "cuda":
        return ["CPUExecutionProvider"]
    # use_tf32 defaults to on in the CUDA provider: fp32 graphs then drift ~1e-3 from the
    # CPU provider (seen on an H200) and greedy ties flip. Exact fp32 is the contract.
    options = {
        "device_id": str(device.index or 0),
        "has_user_compute_stream": "1",
        "user_compute_stream": str(stream.ptr),
        "use_tf32": "0",
    }
    return [("CUDAExecutionProvider", options)]


def _require_cuda_provider(ort) -> None:
    available = ort.get_available_providers()
    if "CUDAExecutionProvider" not in available:
        msg = (
            f"device='cuda' needs ONNX Runtime's CUDAExecutionProvider; this onnxruntime {ort.__version__} has {available}: "
            "install onnxruntime-gpu (a CUDA 13 build) instead of onnxruntime, or use device='cpu'"
        )
        raise EngineError(msg)
