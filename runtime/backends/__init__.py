"""Execution backends of the runtime, by name (see ``base.Backend`` for the interface).

``open_backend(kind, ...)`` builds one from artifacts:

- ``open_backend("torch", target_dir, draft_dir, dims_or_export_dir, max_sessions=None, device="cpu", cuda_graphs=True)``
- ``open_backend("onnxruntime", export_dir, max_sessions=None, device="cpu", threads=None, optimization="all", lazy=False, spinning=False)``
- ``open_backend("tensorrt", engine_dir, max_sessions=None, dims=None, device="cuda", cuda_graphs=False)``
"""

from __future__ import annotations

from dflash_trt.errors import EngineError
from dflash_trt.runtime.backends.base import Backend
from dflash_trt.runtime.backends.ort_backend import OrtBackend
from dflash_trt.runtime.backends.torch_backend import TorchBackend
from dflash_trt.runtime.backends.trt_backend import TensorRTBackend

BACKENDS: dict[str, type[Backend]] = {cls.name: cls for cls in (TorchBackend, OrtBackend, TensorRTBackend)}


def open_backend(kind: str, *args, **kwargs) -> Backend:
    """The backend named ``kind`` ("torch", "onnxruntime", "tensorrt"), opened from its artifacts."""
    cls = BACKENDS.get(kind)
    if cls is None:
        raise EngineError(f"backend must be one of {sorted(BACKENDS)}, got {kind!r}")
    return cls.open(*args, **kwargs)


__all__ = ["BACKENDS", "Backend", "OrtBackend", "TensorRTBackend", "TorchBackend", "open_backend"]
