"""The cuda-python device layer: the checker, lazy import, and (on a GPU) every resource."""

from __future__ import annotations

import enum
import sys

import pytest
import torch

from dflash_trt.errors import CudaError, DFlashError
from dflash_trt.runtime import device


class FakeError(enum.IntEnum):
    """Stands in for cuda-python's error enums (IntEnum with .name) on machines without it."""

    cudaSuccess = 0
    cudaErrorNotReady = 600
    cudaErrorMemoryAllocation = 2


@pytest.fixture
def no_cuda_python(monkeypatch):
    """A Python where ``import cuda.bindings`` fails, whatever is installed here."""
    monkeypatch.setitem(sys.modules, "cuda", None)
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    monkeypatch.setattr(device, "_MODULES", {})


def test_import_without_cuda_python_then_clear_error_on_use(no_cuda_python):
    """Bug: importing the runtime on a CPU-only CI machine fails, or the first use dies with a bare ImportError."""
    assert device.cuda_available() is False
    with pytest.raises(CudaError, match=r"cuda-python.*pip install") as caught:
        device.Stream()
    assert caught.value.code is None
    assert isinstance(caught.value, DFlashError)


def test_checker_returns_values_and_raises_with_call_and_error_name(no_cuda_python):
    """Bug: a failed CUDA call is ignored, or its error reaches the user without the call or the CUDA name."""
    assert device._check((FakeError.cudaSuccess,), "cudaFree") is None
    assert device._check((FakeError.cudaSuccess, 7), "cudaMalloc") == 7
    assert device._check((FakeError.cudaSuccess, 1, 2), "cudaX") == (1, 2)
    with pytest.raises(CudaError, match="cudaMalloc failed: cudaErrorMemoryAllocation") as caught:
        device._check((FakeError.cudaErrorMemoryAllocation, None), "cudaMalloc")
    assert (caught.value.call, caught.value.code) == ("cudaMalloc", "cudaErrorMemoryAllocation")


def test_checker_accepts_named_answers(no_cuda_python):
    """Bug: Event.query treats 'not ready yet' as a failure (or any failure as 'not ready')."""
    accept = ("cudaErrorNotReady",)
    assert device._check((FakeError.cudaErrorNotReady,), "cudaEventQuery", accept) == "cudaErrorNotReady"
    with pytest.raises(CudaError):
        device._check((FakeError.cudaErrorMemoryAllocation,), "cudaEventQuery", accept)


def test_unsupported_dtype_is_refused_before_allocating(no_cuda_python):
    """Bug: a dtype with no array-interface typestr is allocated and then viewed with the wrong element size."""
    with pytest.raises(CudaError, match="not supported by the device layer"):
        device.DeviceBuffer((4,), torch.complex64)


def test_closed_resources_close_again_quietly(no_cuda_python):
    """Bug: a second close() (explicit, then __del__/__exit__) double-frees."""
    graph = device.CudaGraph()
    graph.close()
    graph.close()
    with pytest.raises(CudaError, match="not captured"):
        graph.launch(None)


# --- GPU -----------------------------------------------------------------------------

gpu = pytest.mark.gpu


@gpu
def test_device_buffer_is_viewed_in_place_by_torch():
    """Bug: torch.as_tensor copies the buffer (writes never reach the memory the engines are bound to)."""
    with device.DeviceBuffer((3, 5), torch.float32) as buffer:
        view = torch.as_tensor(buffer, device="cuda")
        assert view.data_ptr() == buffer.ptr and view.shape == (3, 5) and view.dtype == torch.float32
        assert torch.count_nonzero(view).item() == 0  # zero-filled at allocation
        view.copy_(torch.arange(15.0, device="cuda").view(3, 5))
        again = buffer.as_tensor()
        torch.cuda.synchronize()
        assert torch.equal(again.cpu(), torch.arange(15.0).view(3, 5))


@gpu
def test_bfloat16_buffer_round_trip():
    """Bug: bf16 (no numpy typestr) is viewed with a wrong dtype or size."""
    with device.DeviceBuffer((8,), torch.bfloat16) as buffer:
        view = buffer.as_tensor()
        assert view.dtype == torch.bfloat16 and view.data_ptr() == buffer.ptr
        values = torch.linspace(-2, 2, 8, dtype=torch.bfloat16)
        view.copy_(values.cuda())
        assert torch.equal(buffer.as_tensor().cpu(), values)


@gpu
def test_pinned_round_trip_through_a_stream():
    """Bug: async copies between pinned host memory and device memory land in the wrong place or are not ordered."""
    with device.Stream() as stream, device.DeviceBuffer((64,), torch.int64) as dev, device.PinnedBuffer((64,), torch.int64) as host:
        host.as_tensor().copy_(torch.arange(64))
        device.copy_async(dev.ptr, host.ptr, dev.nbytes, stream)
        host.as_tensor().zero_()
        stream.synchronize()  # the upload has finished before we overwrite the source again
        device.copy_async(host.ptr, dev.ptr, dev.nbytes, stream)
        stream.synchronize()
        assert torch.equal(host.as_tensor(), torch.arange(64))
        assert (host.numpy() == torch.arange(64).numpy()).all()


@gpu
def test_event_timing_and_query():
    """Bug: elapsed time is read before the end event finished, or events are recorded on another stream."""
    with device.Stream() as stream, device.Event() as start, device.Event() as end:
        a = torch.randn(1024, 1024, device="cuda")
        torch.cuda.synchronize()
        start.record(stream)
        with torch.cuda.stream(stream.torch_stream()):
            for _ in range(20):
                a = a @ a.T / 1024
        end.record(stream)
        end.synchronize()
        assert end.query() is True
        assert start.elapsed_ms(end) > 0.0


@gpu
def test_cuda_graph_capture_and_replay_reads_current_inputs():
    """Bug: a replayed graph reads the inputs as they were at capture (or other addresses) instead of the live buffers."""
    with device.Stream() as stream, device.DeviceBuffer((256,), torch.float32) as a, device.DeviceBuffer((256,), torch.float32) as b:
        ta, tb = a.as_tensor(), b.as_tensor()
        graph = device.CudaGraph()
        with graph.capture(stream), torch.cuda.stream(stream.torch_stream()):
            torch.mul(ta, 2.0, out=tb)  # no allocation: legal under raw capture
            device.copy_async(a.ptr, b.ptr, a.nbytes, stream)  # a <- 2a
        assert graph.ready
        with torch.cuda.stream(stream.torch_stream()):
            ta.fill_(1.5)
        graph.launch(stream)
        graph.launch(stream)
        stream.synchronize()
        assert torch.all(ta == 6.0).item() and torch.all(tb == 6.0).item()
        graph.close()
        with pytest.raises(CudaError, match="not captured"):
            graph.launch(stream)


@gpu
def test_failed_capture_releases_the_stream():
    """Bug: an exception inside a capture leaves the stream in capture mode, breaking every later call on it."""
    with device.Stream() as stream, device.DeviceBuffer((4,), torch.float32) as a:
        graph = device.CudaGraph()
        with pytest.raises(RuntimeError, match="boom"), graph.capture(stream):
            raise RuntimeError("boom")
        assert not graph.ready
        device.memset_async(a.ptr, 0, a.nbytes, stream)
        stream.synchronize()


@gpu
def test_allocation_failure_is_typed():
    """Bug: an out-of-memory cudaMalloc returns a null pointer that is used later."""
    with pytest.raises(CudaError) as caught:
        device.DeviceBuffer((1 << 50,), torch.uint8)
    assert caught.value.call == "cudaMalloc" and caught.value.code == "cudaErrorMemoryAllocation"
    torch.ones(4, device="cuda").add_(1)  # the refused malloc must not surface later as torch's error
    torch.cuda.synchronize()


@gpu
def test_a_backend_streams_scope_asks_no_device_lookup(monkeypatch):
    """Bug: ``torch.cuda.current_stream()`` without a device (and ``torch.cuda.stream``) finds the current one
    through ``torch.cuda.is_available()``, an environment read on every call; the serving thread enters a
    scope per launch and prefill, and spent 7% of its time there at 64 streams. ``scope`` and ``current`` must
    ask by index, still order the caller's stream around the body, and give the caller its stream back."""
    from dflash_trt.runtime.backends.streams import BackendStream

    ours = BackendStream()
    try:
        asked = []
        real = torch.cuda.is_available
        monkeypatch.setattr(torch.cuda, "is_available", lambda: asked.append(1) or real())
        x = torch.zeros(1 << 20, device="cuda")
        with ours.scope():
            assert torch.cuda.current_stream(ours.index).cuda_stream == ours.torch.cuda_stream
            y = x + 1  # on ours, after the caller's zeros
        z = y * 2  # on the caller's, after ours
        caller = torch.cuda.current_stream(ours.index).cuda_stream
        with ours.current(), ours.scope():  # the executor's way: already on ours, no waits, the same stream
            assert torch.cuda.current_stream(ours.index).cuda_stream == ours.torch.cuda_stream
        assert torch.cuda.current_stream(ours.index).cuda_stream == caller
        assert not asked
        assert torch.equal(z, torch.full_like(x, 2.0))
    finally:
        ours.synchronize()
        ours.close()
