"""Execution backends of the runtime, by name (see ``base.Backend`` for the interface).

``open_backend(kind, ...)`` builds one from artifacts:

- ``open_backend("torch", target_dir, draft_dir, dims_or_export_dir, max_sessions=None, device="cpu", cuda_graphs=True, kernels="auto")``
- ``open_backend("onnxruntime", export_dir, max_sessions=None, device="cpu", threads=None, optimization="all", lazy=False, spinning=False, torch_threads=None)``
  (``spinning``: intra-op threads keep spinning between runs; by default they spin within a run only;
  ``torch_threads``: torch's intra-op threads while it is open, on the CPU, where torch only glues its runs: the CLI uses 1)
- ``open_backend("tensorrt", engine_dir, max_sessions=None, dims=None, device="cuda", cuda_graphs=False)``

Backends are looked up lazily: only the chosen backend's module is imported,
so opening ONNX Runtime never loads the PyTorch model stack (the ``torch`` backend) or
TensorRT.
"""

from __future__ import annotations

import importlib

from dflash_trt.errors import EngineError
from dflash_trt.runtime.backends.base import Backend

# backend name -> (module in this package, class name)
BACKENDS: dict[str, tuple[str, str]] = {
    "torch": ("torch_backend", "TorchBackend"),
    "onnxruntime": ("ort_backend", "OrtBackend"),
    "tensorrt": ("trt_backend", "TensorRTBackend"),
}
_CLASSES = {cls: (module, kind) for kind, (module, cls) in BACKENDS.items()}


def backend_class(kind: str) -> type[Backend]:
    """The backend class named ``kind``, importing only its module."""
    if kind not in BACKENDS:
        raise EngineError(f"backend must be one of {sorted(BACKENDS)}, got {kind!r}")
    module, cls = BACKENDS[kind]
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)


def open_backend(kind: str, *args, **kwargs) -> Backend:
    """The backend named ``kind`` ("torch", "onnxruntime", "tensorrt"), opened from its artifacts."""
    return backend_class(kind).open(*args, **kwargs)


def __getattr__(name: str):
    """``from dflash_trt.runtime.backends import OrtBackend`` imports that backend's module only."""
    if name in _CLASSES:
        return backend_class(_CLASSES[name][1])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["BACKENDS", "Backend", "OrtBackend", "TensorRTBackend", "TorchBackend", "backend_class", "open_backend"]
