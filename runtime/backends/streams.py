"""A backend's CUDA stream and its ordering with the caller's torch stream.

Every CUDA backend enqueues on ONE device-layer ``Stream``. Callers produce
feeds (and consume outputs) on whatever torch stream is current, so each
``run`` is bracketed by device-side waits, never host syncs::

    with backend_stream.scope():      # ours waits for the caller's stream
        enqueue work on ours          # torch ops here run on ours
    # on exit: the caller's stream waits for ours

When the caller already runs on the backend's stream (``torch.cuda.stream(
backend.stream.torch)``: ``current``, which the executor enters for every call,
since it takes and returns host values only), the waits are skipped.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


def select_device(device: str | torch.device) -> torch.device:
    """``device`` as a torch.device; for CUDA with an explicit index (the current one if none given),
    made current for torch and, through the shared runtime, for the device layer."""
    device = torch.device(device)
    if device.type != "cuda":
        return device
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(device)  # needs an index: torch.device("cuda") alone is refused
    return device


class BackendStream:
    """Owns a device-layer stream (and the torch view of it)."""

    def __init__(self) -> None:
        from dflash_trt.runtime.device import Stream

        self.device_stream = Stream()
        self.torch = self.device_stream.torch_stream()
        # The caller's stream is asked by this index: ``torch.cuda.current_stream()`` with no device looks the
        # current device up through ``torch.cuda.is_available()``, an environment read per call (7% of the
        # serving thread's time at 64 streams, benchmarks/RESULTS.md).
        self.index = self.torch.device_index

    @property
    def handle(self):
        """The cudaStream_t (for cuda-python calls and event records)."""
        return self.device_stream.handle

    @property
    def ptr(self) -> int:
        """The stream as an integer (TensorRT's execute_async_v3, ONNX Runtime's user stream)."""
        return self.device_stream.ptr

    @contextmanager
    def scope(self):
        """Run the body on this stream, ordered after the caller's current stream and before its later work.

        Does not synchronize the host.
        """
        caller = torch.cuda.current_stream(self.index)
        if caller.cuda_stream == self.torch.cuda_stream:
            yield
            return
        self.torch.wait_stream(caller)
        with self._made_current(caller):
            yield
        caller.wait_stream(self.torch)

    def current(self):
        """Make ours this thread's current torch stream for the body (no CUDA call: torch's stream context),
        so every ``scope`` inside it skips its waits. For callers whose work with the backend is host values
        in and out (the executor: token lists in, token lists out): nothing on their own stream needs
        ordering with ours, and the two cross-stream waits per ``scope`` (an event made, recorded and waited
        on each way) are pure host cost at every launch, staging and prefill of a serving round."""
        return self._made_current(torch.cuda.current_stream(self.index))

    @contextmanager
    def _made_current(self, caller):
        """``torch.cuda.stream(self.torch)`` for a thread whose current stream is ``caller``, without its
        two device look-ups (``index``'s comment)."""
        torch.cuda.set_stream(self.torch)
        try:
            yield
        finally:
            torch.cuda.set_stream(caller)

    def hand_over(self, tensors) -> None:
        """Tell torch's allocator that ``tensors`` (made on this stream) are used on the caller's stream.

        Without it, freeing an output on the caller's side could let this
        stream reuse its memory while the caller still reads it.
        """
        caller = torch.cuda.current_stream(self.index)
        if caller.cuda_stream != self.torch.cuda_stream:
            for tensor in tensors:
                tensor.record_stream(caller)

    def synchronize(self) -> None:
        """Host sync: wait for everything enqueued on this stream."""
        self.device_stream.synchronize()

    def close(self) -> None:
        self.device_stream.close()
