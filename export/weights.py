"""One external-data file shared by every graph of an export, each distinct tensor once.

The target's weights appear in ``target_prefill`` and every ``target_verify_{n}``,
its embedding and LM head in every ``draft_{n}``: saved per graph, an 8B target
would be written 5+ times (~90 GB at max_owners 4). ``SharedWeights`` stores
each distinct initializer (by content) once in ``weights.data`` beside the
graphs; every graph's initializers point into it (ONNX external data with
offset and length, which ONNX Runtime and TensorRT's parser read). Small
tensors stay inline.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from types import TracebackType

import onnx_ir as ir

WEIGHTS_FILE = "weights.data"
ALIGNMENT = 64  # bytes; offsets aligned for memory-mapped readers
INLINE_BYTES = 1024  # tensors smaller than this stay in the graph file


class SharedWeights:
    """Append-only store of distinct tensors in ``directory/weights.data`` (truncated on open)."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.path = self.directory / WEIGHTS_FILE
        self._file = open(self.path, "wb")
        self._index: dict[bytes, tuple[int, int]] = {}
        self.stored_bytes = 0
        self.shared_bytes = 0  # bytes referenced again instead of written

    def __enter__(self) -> SharedWeights:
        return self

    def __exit__(self, kind: type | None, error: BaseException | None, trace: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        self._file.close()

    def externalize(self, model: ir.Model) -> None:
        """Point every initializer of ``model`` of >= INLINE_BYTES into the shared file."""
        for value in model.graph.initializers.values():
            tensor = value.const_value
            if tensor is None or tensor.nbytes < INLINE_BYTES:
                continue
            offset, length = self._store(tensor.tobytes())
            value.const_value = ir.ExternalTensor(
                WEIGHTS_FILE, offset, length, tensor.dtype, shape=tensor.shape, name=value.name, base_dir=self.directory
            )

    def _store(self, data: bytes) -> tuple[int, int]:
        key = hashlib.sha256(data).digest()
        if key in self._index:
            self.shared_bytes += len(data)
            return self._index[key]
        offset = -(-self._file.tell() // ALIGNMENT) * ALIGNMENT
        self._file.seek(offset)
        self._file.write(data)
        self._file.flush()
        self._index[key] = (offset, len(data))
        self.stored_bytes += len(data)
        return self._index[key]
