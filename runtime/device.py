"""The device layer: CUDA memory, streams, events and graphs on cuda-python.

Every CUDA call goes through ``cuda_call`` (one checker): it resolves the
function in ``cuda.bindings.runtime`` (``cuda*``) or ``cuda.bindings.driver``
(``cu*``), calls it, and raises ``CudaError`` naming the call and the CUDA
error unless it succeeded. cuda-python is imported lazily, so importing this
module works on a CPU-only machine without it; the first use raises a
``CudaError`` that says how to install it.

Each resource has ONE owner object with an explicit, idempotent ``close()``
(and ``with`` support). Views handed out (``torch.as_tensor(buffer,
device="cuda")``, ``PinnedBuffer.numpy()``) do not keep the memory alive
past ``close()``: the owner must outlive them (the backends allocate once at
load and close last).

Host syncs happen only where a docstring says "Host sync" (the
``synchronize`` methods, ``synchronize_device``, and a ``DeviceBuffer``
allocated without a stream); everything else enqueues on a stream and
returns.
"""

from __future__ import annotations

import ctypes
import logging
import math
from collections.abc import Sequence
from contextlib import contextmanager
from types import ModuleType

import torch

from dflash_trt.errors import CudaError

INSTALL_HINT = "pip install 'dflash-trt[cuda]' (cuda-python >= 13) on a machine with an NVIDIA driver"

# torch dtype -> (__cuda_array_interface__ typestr, torch dtype that typestr maps to).
# bfloat16 has no numpy typestr: exposed as int16 and re-viewed by ``as_tensor``.
_TYPESTR: dict[torch.dtype, str] = {
    torch.float32: "<f4",
    torch.float16: "<f2",
    torch.bfloat16: "<i2",
    torch.float64: "<f8",
    torch.int64: "<i8",
    torch.int32: "<i4",
    torch.int16: "<i2",
    torch.int8: "|i1",
    torch.uint8: "|u1",
    torch.bool: "|b1",
}

_MODULES: dict[str, ModuleType] = {}


def _bindings() -> tuple[ModuleType, ModuleType]:
    """(cuda.bindings.runtime, cuda.bindings.driver), imported on first use."""
    if not _MODULES:
        try:
            from cuda.bindings import driver, runtime
        except ImportError as error:
            msg = f"the CUDA device layer needs cuda-python, not importable here ({error}); {INSTALL_HINT}"
            raise CudaError(msg, call="import cuda.bindings") from error
        _MODULES.update(runtime=runtime, driver=driver)
    return _MODULES["runtime"], _MODULES["driver"]


def _error_name(error) -> str:
    return getattr(error, "name", None) or str(error)


def _check(result, call: str, accept: tuple[str, ...] = ()):
    """THE checker: ``result`` is cuda-python's ``(error, *values)``.

    Returns the values (None, one value, or a tuple); raises ``CudaError``
    unless the error is success or one of ``accept`` (then returns its name).
    """
    error, values = (result[0], result[1:]) if isinstance(result, tuple) else (result, ())
    if int(error) != 0:
        name = _error_name(error)  # only on failure: an enum's name costs a look-up on every call
        _clear_last_error()
        if name in accept:
            return name
        msg = f"{call} failed: {name} ({_describe(error)})"
        raise CudaError(msg, call=call, code=name)
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def _clear_last_error() -> None:
    """Reset the runtime's per-thread "last error" after a failure we raised (or accepted).

    Otherwise a non-sticky error (e.g. a refused cudaMalloc) lingers and the
    next library to call cudaGetLastError (torch after every kernel launch)
    reports it as its own failure.
    """
    runtime = _MODULES.get("runtime")
    if runtime is not None:
        runtime.cudaGetLastError()


def _describe(error) -> str:
    """CUDA's sentence for an error code; never raises (used inside the checker)."""
    try:
        runtime, driver = _bindings()
        if isinstance(error, runtime.cudaError_t):
            text = runtime.cudaGetErrorString(error)[1]
        else:
            text = driver.cuGetErrorString(error)[1]
        return text.decode() if isinstance(text, bytes) else str(text)
    except Exception:  # noqa: BLE001 - a description is best effort; the name is the fact
        return "no description"


def cuda_call(function: str, *args, accept: tuple[str, ...] = ()):
    """Call ``cuda.bindings.runtime.<function>`` (or ``driver.<function>`` for ``cu*``), checked.

    ``accept`` lists error names that are answers, not failures (e.g.
    ``cudaErrorNotReady`` for a query); their name is returned.
    """
    runtime, driver = _bindings()
    module = runtime if function.startswith("cuda") else driver
    return _check(getattr(module, function)(*args), function, accept)


def cuda_available() -> bool:
    """True when cuda-python imports and sees at least one device (never raises)."""
    try:
        return device_count() > 0
    except CudaError:
        return False


def device_count() -> int:
    return int(cuda_call("cudaGetDeviceCount"))


def set_device(index: int) -> None:
    cuda_call("cudaSetDevice", index)


def current_device() -> int:
    return int(cuda_call("cudaGetDevice"))


def free_memory() -> int:
    """Free bytes on the current device (``cudaMemGetInfo``)."""
    free, _total = cuda_call("cudaMemGetInfo")
    return int(free)


def synchronize_device() -> None:
    """Host sync: wait for all work on the current device (tests and teardown only)."""
    cuda_call("cudaDeviceSynchronize")


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    if dtype not in _TYPESTR:
        msg = f"dtype {dtype} is not supported by the device layer; use one of {sorted(map(str, _TYPESTR))}"
        raise CudaError(msg, call="allocate")
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


class _Owned:
    """One CUDA resource with an idempotent close and ``with`` support."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        # Best effort for a forgotten close; never raise from a finalizer.
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass


class DeviceBuffer(_Owned):
    """``shape`` × ``dtype`` of device memory (cudaMalloc), zero-filled, at a fixed address.

    ``torch.as_tensor(buffer, device="cuda")`` views it without a copy
    through ``__cuda_array_interface__`` (bfloat16 shows as int16 there; use
    ``as_tensor()`` for the typed view).
    """

    def __init__(self, shape: Sequence[int], dtype: torch.dtype, stream: Stream | None = None):
        self.shape, self.dtype = tuple(int(d) for d in shape), dtype
        self.nbytes = _nbytes(self.shape, dtype)
        self.ptr = 0
        # Zero-size buffers still get a real allocation: a null pointer is not a view.
        self.ptr = int(cuda_call("cudaMalloc", max(self.nbytes, 1)))
        memset_async(self.ptr, 0, self.nbytes, stream)
        if stream is None:
            synchronize_device()  # host sync: the zeros must land before anyone reads

    @property
    def __cuda_array_interface__(self) -> dict:
        if not self.ptr:
            raise CudaError("DeviceBuffer is closed", call="__cuda_array_interface__")
        # stream None: ordering is the caller's (the backends enqueue on their one stream).
        return {"shape": self.shape, "typestr": _TYPESTR[self.dtype], "data": (self.ptr, False), "version": 3, "strides": None, "stream": None}

    def as_tensor(self) -> torch.Tensor:
        """A torch CUDA tensor viewing this memory, with this buffer's dtype (no copy)."""
        return torch.as_tensor(self, device="cuda").view(self.dtype)

    def close(self) -> None:
        ptr, self.ptr = self.ptr, 0
        if ptr:
            cuda_call("cudaFree", ptr)


class PinnedBuffer(_Owned):
    """Page-locked host memory (cudaMallocHost) for async device<->host copies."""

    def __init__(self, shape: Sequence[int], dtype: torch.dtype):
        self.shape, self.dtype = tuple(int(d) for d in shape), dtype
        self.nbytes = _nbytes(self.shape, dtype)
        self.ptr = 0
        self.ptr = int(cuda_call("cudaMallocHost", max(self.nbytes, 1)))
        ctypes.memset(self.ptr, 0, self.nbytes)

    def _bytes(self):
        if not self.ptr:
            raise CudaError("PinnedBuffer is closed", call="view")
        return (ctypes.c_uint8 * max(self.nbytes, 1)).from_address(self.ptr)

    def as_tensor(self) -> torch.Tensor:
        """A CPU torch tensor viewing the pinned memory (no copy)."""
        count = math.prod(self.shape)
        if count == 0:
            return torch.empty(self.shape, dtype=self.dtype)
        return torch.frombuffer(self._bytes(), dtype=self.dtype, count=count).view(self.shape)

    def numpy(self):
        """A numpy array viewing the pinned memory (no copy; not for bfloat16)."""
        return self.as_tensor().numpy()

    def close(self) -> None:
        ptr, self.ptr = self.ptr, 0
        if ptr:
            cuda_call("cudaFreeHost", ptr)


class Stream(_Owned):
    """A non-blocking CUDA stream (never synchronizes with the legacy default stream)."""

    def __init__(self):
        runtime, _ = _bindings()
        self.handle = None
        self.handle = cuda_call("cudaStreamCreateWithFlags", runtime.cudaStreamNonBlocking)

    @property
    def ptr(self) -> int:
        return int(self.handle) if self.handle is not None else 0

    def torch_stream(self) -> torch.cuda.ExternalStream:
        """The same stream for torch: use with ``torch.cuda.stream(...)``."""
        return torch.cuda.ExternalStream(self.ptr)

    def wait(self, event: Event) -> None:
        """Make later work on this stream wait for ``event`` (device-side; no host sync)."""
        cuda_call("cudaStreamWaitEvent", self.handle, event.handle, 0)

    def synchronize(self) -> None:
        """Host sync: block until everything enqueued on this stream has finished."""
        cuda_call("cudaStreamSynchronize", self.handle)

    def close(self) -> None:
        handle, self.handle = self.handle, None
        if handle is not None:
            cuda_call("cudaStreamDestroy", handle)


class Event(_Owned):
    """A CUDA event: record on a stream, wait on it, time between two."""

    def __init__(self, timing: bool = True):
        runtime, _ = _bindings()
        flags = runtime.cudaEventDefault if timing else runtime.cudaEventDisableTiming
        self.handle = None
        self.handle = cuda_call("cudaEventCreateWithFlags", flags)

    def record(self, stream: Stream) -> None:
        """Enqueue the event on ``stream`` (no host sync)."""
        cuda_call("cudaEventRecord", self.handle, stream.handle)

    def query(self) -> bool:
        """True when the work before the last record has finished (never blocks)."""
        return cuda_call("cudaEventQuery", self.handle, accept=("cudaErrorNotReady",)) is None

    def synchronize(self) -> None:
        """Host sync: block until the recorded work has finished."""
        cuda_call("cudaEventSynchronize", self.handle)

    def elapsed_ms(self, end: Event) -> float:
        """Milliseconds from this event to ``end`` (both recorded and finished; synchronize ``end`` first)."""
        return float(cuda_call("cudaEventElapsedTime", self.handle, end.handle))

    def close(self) -> None:
        handle, self.handle = self.handle, None
        if handle is not None:
            cuda_call("cudaEventDestroy", handle)


_CAPTURE_MODES = {
    "global": "cudaStreamCaptureModeGlobal",
    "thread_local": "cudaStreamCaptureModeThreadLocal",
    "relaxed": "cudaStreamCaptureModeRelaxed",
}


class CudaGraph(_Owned):
    """Stream capture → instantiated graph → launches.

    ::

        with graph.capture(stream):   # work enqueued on ``stream`` is recorded, not run
            enqueue(stream)
        graph.launch(stream)          # replays it (same addresses as at capture)

    Work captured this way must not allocate (cudaMalloc is illegal during
    capture): capture only over memory allocated beforehand. For torch ops,
    use ``torch.cuda.CUDAGraph`` on ``stream.torch_stream()`` instead: it
    gives the captured intermediates a private allocator pool.
    """

    def __init__(self):
        self.graph = None
        self.exec = None

    @property
    def ready(self) -> bool:
        return self.exec is not None

    @contextmanager
    def capture(self, stream: Stream, mode: str = "thread_local"):
        if self.graph is not None:
            raise CudaError("CudaGraph already captured; close it or make another", call="cudaStreamBeginCapture")
        runtime, _ = _bindings()
        cuda_call("cudaStreamBeginCapture", stream.handle, getattr(runtime.cudaStreamCaptureMode, _CAPTURE_MODES[mode]))
        try:
            yield self
        except BaseException:
            # End the capture so the stream is usable again; the partial graph is discarded.
            graph = _check(runtime.cudaStreamEndCapture(stream.handle), "cudaStreamEndCapture", accept=_CAPTURE_BROKEN)
            if graph is not None and not isinstance(graph, str):
                cuda_call("cudaGraphDestroy", graph)
            raise
        self.graph = cuda_call("cudaStreamEndCapture", stream.handle)
        self.exec = cuda_call("cudaGraphInstantiate", self.graph, 0)

    def upload(self, stream: Stream) -> None:
        """Pre-load the graph's resources on the device so the first launch is not slower."""
        cuda_call("cudaGraphUpload", self._exec(), stream.handle)

    def launch(self, stream: Stream) -> None:
        """Enqueue one replay on ``stream`` (no host sync)."""
        cuda_call("cudaGraphLaunch", self._exec(), stream.handle)

    def _exec(self):
        if self.exec is None:
            raise CudaError("CudaGraph not captured (or closed): capture it before launching", call="cudaGraphLaunch")
        return self.exec

    def close(self) -> None:
        graph_exec, graph = self.exec, self.graph
        self.exec = self.graph = None
        if graph_exec is not None:
            cuda_call("cudaGraphExecDestroy", graph_exec)
        if graph is not None:
            cuda_call("cudaGraphDestroy", graph)


class CaptureFallback:
    """Eager fallback for CUDA-graph captures that fail, logged once per owner (a backend, a loop).

    A capture can fail where the eager run worked: a library call that is
    illegal while capturing (an allocation, a sync, TensorRT enqueue work it
    cannot record), or another thread's CUDA call under a global-mode
    capture. ``capture(what, make)`` returns ``make()``'s graph, or None
    after the failure: the caller runs that work eagerly from then on. Only
    CUDA / TensorRT failures are caught (``DFlashError``, and ``RuntimeError``
    which torch raises for CUDA errors); the first one is logged with its
    reason, later ones are counted in ``failures``.
    """

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.failures = 0

    def capture(self, what: str, make):
        from dflash_trt.errors import DFlashError

        try:
            return make()
        except (DFlashError, RuntimeError) as error:
            self.failures += 1
            if self.failures == 1:
                cause = error.__context__ if error.__context__ is not None else error  # the capture's end reports the body's failure second
                logging.getLogger(__name__).warning(
                    "%s: CUDA-graph capture of %s failed (%s: %s); it runs eagerly, as does any later capture that fails (not logged again)",
                    self.owner, what, type(cause).__name__, cause,
                )
            return None


# Errors EndCapture reports when the capture was already invalidated by a failed call inside it.
_CAPTURE_BROKEN = ("cudaErrorStreamCaptureInvalidated", "cudaErrorStreamCaptureUnjoined", "cudaErrorStreamCaptureUnmatched")


def memset_async(ptr: int, value: int, nbytes: int, stream: Stream | None = None) -> None:
    """Fill ``nbytes`` at device address ``ptr`` with byte ``value`` (enqueued; no host sync)."""
    if nbytes:
        cuda_call("cudaMemsetAsync", ptr, value, nbytes, stream.handle if stream is not None else 0)


def copy_async(destination: int, source: int, nbytes: int, stream: Stream) -> None:
    """Copy ``nbytes`` between any two addresses (device or pinned host; UVA), enqueued on ``stream``."""
    runtime, _ = _bindings()
    if nbytes:
        cuda_call("cudaMemcpyAsync", destination, source, nbytes, runtime.cudaMemcpyKind.cudaMemcpyDefault, stream.handle)
