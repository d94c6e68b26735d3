"""A plan streamed into TensorRT's runtime from its file, hashed as it streams: one read.

``deserialize_cuda_engine`` takes an ``IStreamReaderV2`` (TensorRT >= 10.7,
TensorRT-RTX): the runtime pulls the plan in chunks instead of a whole copy
in host memory, and the reader hashes what it hands over. The runtime may
seek (e.g. re-read the header); the digest covers the longest prefix read
in order, and ``sha256()`` reads only what the runtime skipped (nothing,
when it reads the plan front to back) — each byte is read once either way,
and the plan is never hashed by a separate pass. ``bytes_read`` counts what
the runtime was handed, ``catch_up_bytes`` what ``sha256()`` read itself.

The reader class derives from the flavour's own ``IStreamReaderV2``, so it
is made once per TensorRT module (``plan_reader_class``); a runtime without
one gets ``None`` and the loader reads the plan whole (hashing those bytes).
(Constructing one needs a CUDA driver: TensorRT's base class opens it.)
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from types import ModuleType

CHUNK_BYTES = 64 << 20  # per read: the runtime asks again for the rest

_CLASSES: dict[type, type] = {}  # IStreamReaderV2 of a TensorRT module -> its PlanReader


def plan_reader_class(trt: ModuleType) -> type | None:
    """``PlanReader`` over ``trt.IStreamReaderV2``, or None where the runtime has no stream reader."""
    base = getattr(trt, "IStreamReaderV2", None)
    if base is None:
        return None
    if base not in _CLASSES:

        class PlanReader(base):
            """One plan file, read in chunks, hashed as it is read (see the module docstring)."""

            def __init__(self, path: Path):
                base.__init__(self)
                self.file = open(path, "rb")  # noqa: SIM115  (closed by close())
                self.size = Path(path).stat().st_size
                self.position = 0  # where the next read starts
                self.hashed = 0  # the digest covers bytes [0, hashed)
                self.bytes_read = 0  # handed to the runtime (what it re-reads counts again)
                self.catch_up_bytes = 0  # read by sha256() because the runtime skipped them
                self.digest = hashlib.sha256()

            def read(self, num_bytes: int, stream: int = 0) -> bytes:
                data = self.file.read(min(int(num_bytes), CHUNK_BYTES))
                self._hash(self.position, data)
                self.position += len(data)
                self.bytes_read += len(data)
                return data

            def seek(self, offset: int, where) -> bool:
                origin = {"SET": 0, "CUR": self.position, "END": self.size}[where.name]
                target = origin + int(offset)
                if not 0 <= target <= self.size:
                    return False
                self.position = target
                self.file.seek(target)
                return True

            def _hash(self, start: int, data: bytes) -> None:
                """Extend the digest with the part of ``data`` (at ``start``) past what it covers."""
                if start <= self.hashed < start + len(data):
                    self.digest.update(memoryview(data)[self.hashed - start :])
                    self.hashed = start + len(data)

            def sha256(self) -> str:
                """The plan's digest: what the runtime skipped or left unread is read now, once."""
                self.file.seek(self.hashed)
                while block := self.file.read(CHUNK_BYTES):
                    self.catch_up_bytes += len(block)
                    self._hash(self.hashed, block)
                self.file.seek(self.position)
                return self.digest.hexdigest()

            def close(self) -> None:
                self.file.close()

        _CLASSES[base] = PlanReader
    return _CLASSES[base]
