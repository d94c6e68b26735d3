"""The two cache pools every backend owns (docs/design.md §2).

A pool holds, per layer, one K and one V tensor of shape
``[rows, kv_heads, max_context, head_dim]`` (row = one session). It is
allocated ONCE at load, zero-filled, and never reallocated: engines, ONNX
Runtime bindings and captured CUDA graphs keep its addresses.

On CUDA the memory is owned by device-layer ``DeviceBuffer``s and the
tensors are zero-copy torch views of them; on CPU they are plain torch
tensors. A graph over n owners binds ``rows(first, n)``: views of n
CONSECUTIVE rows starting at ``first`` (row is the outermost axis, so a view
is contiguous and starts ``first * row_bytes`` into the buffer).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch

from dflash_trt.checks import is_int
from dflash_trt.errors import EngineError
from dflash_trt.export import contract as c


@dataclass(frozen=True)
class PoolShape:
    layers: int
    rows: int
    kv_heads: int
    max_context: int
    head_dim: int
    dtype: torch.dtype

    @property
    def layer_shape(self) -> tuple[int, int, int, int]:
        return (self.rows, self.kv_heads, self.max_context, self.head_dim)


def check_sessions(value) -> int:
    """``max_sessions`` (rows per pool) must be a positive int."""
    if not is_int(value) or value < 1:
        raise EngineError(f"max_sessions must be an int >= 1, got {value!r}")
    return value


def pool_shapes(dims: c.Dims, rows: int, dtype: torch.dtype) -> dict[str, PoolShape]:
    """The target and draft pool geometry of an artifact set, ``rows`` sessions each."""
    return {
        "target": PoolShape(dims.target_layers, rows, dims.target_kv_heads, dims.max_context, dims.target_head_dim, dtype),
        "draft": PoolShape(dims.draft_layers, rows, dims.draft_kv_heads, dims.max_context, dims.draft_head_dim, dtype),
    }


@dataclass
class CachePool:
    """One pool: ``keys[l]`` and ``values[l]``, each [rows, kv_heads, max_context, head_dim]."""

    name: str
    shape: PoolShape
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    owners: list = field(default_factory=list)  # DeviceBuffers behind the views (CUDA)

    @classmethod
    def allocate(cls, name: str, shape: PoolShape, device: torch.device, stream=None) -> CachePool:
        """Zeroed pool on ``device``; on CUDA through the device layer (``stream``: where the zeroing is enqueued)."""
        if device.type == "cuda":
            return cls._allocate_cuda(name, shape, stream)
        keys = [torch.zeros(shape.layer_shape, dtype=shape.dtype) for _ in range(shape.layers)]
        values = [torch.zeros(shape.layer_shape, dtype=shape.dtype) for _ in range(shape.layers)]
        return cls(name, shape, keys, values)

    @classmethod
    def _allocate_cuda(cls, name: str, shape: PoolShape, stream) -> CachePool:
        from dflash_trt.runtime.device import DeviceBuffer

        owners = []
        try:
            for _ in range(2 * shape.layers):
                owners.append(DeviceBuffer(shape.layer_shape, shape.dtype, stream))
        except BaseException:
            for buffer in owners:
                buffer.close()
            raise
        views = [buffer.as_tensor() for buffer in owners]
        return cls(name, shape, views[0::2], views[1::2], owners)

    def tensor(self, which: str, layer: int) -> torch.Tensor:
        return (self.keys if which == "key" else self.values)[layer]

    def rows(self, first: int, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(keys, values): per layer the view of rows ``first .. first+n-1`` (in place, contiguous)."""
        return [k[first : first + n] for k in self.keys], [v[first : first + n] for v in self.values]

    def interleaved(self, first: int, n: int) -> list[torch.Tensor]:
        """Row views in contract binding order: key_0, value_0, key_1, ..."""
        keys, values = self.rows(first, n)
        return [t for pair in zip(keys, values) for t in pair]

    def copy_rows(self, source: int, destination: int, upto: int) -> None:
        """Slots ``0..upto-1`` of row ``source`` into row ``destination``, every layer, K and V.

        Enqueued on torch's current stream (the caller makes it the backend's); no host sync.
        """
        self._check_copy(source, destination, upto)
        if upto == 0 or source == destination:
            return
        for tensor in self.keys + self.values:
            tensor[destination, :, :upto].copy_(tensor[source, :, :upto])

    def _check_copy(self, source: int, destination: int, upto: int) -> None:
        rows, slots = self.shape.rows, self.shape.max_context
        for label, row in (("source", source), ("destination", destination)):
            if not is_int(row) or not 0 <= row < rows:
                raise EngineError(f"copy_rows({self.name!r}): {label} row must be in [0, {rows - 1}], got {row!r}")
        if not is_int(upto) or not 0 <= upto <= slots:
            raise EngineError(f"copy_rows({self.name!r}): upto must be in [0, {slots}] (max_context), got {upto!r}")

    def close(self) -> None:
        """Free the device memory (CUDA); the views must not be used afterwards."""
        self.keys, self.values = [], []
        owners, self.owners = self.owners, []
        for buffer in owners:
            buffer.close()


def pool_bytes(shape: PoolShape) -> int:
    """Bytes of one pool: K and V of every layer."""
    return 2 * shape.layers * math.prod(shape.layer_shape) * torch.empty((), dtype=shape.dtype).element_size()


def available_bytes(device: torch.device) -> int | None:
    """Memory an allocation can still get on ``device`` (CUDA: free device memory; CPU: MemAvailable), or None if unknown."""
    if device.type == "cuda":
        from dflash_trt.runtime.device import free_memory

        return free_memory()
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_room(shapes: dict[str, PoolShape], device: torch.device) -> None:
    """Refuse pools that cannot fit, naming rows and bytes, BEFORE allocating (an allocator's own failure is untyped or late)."""
    need = {name: pool_bytes(shape) for name, shape in shapes.items()}
    available = available_bytes(device)
    if available is not None and sum(need.values()) > available:
        rows = next(iter(shapes.values())).rows
        parts = ", ".join(f"{name} {size / 2**30:.3g} GiB" for name, size in need.items())
        msg = (
            f"cache pools for max_sessions {rows} need {sum(need.values()) / 2**30:.3g} GiB ({parts}), "
            f"only {available / 2**30:.3g} GiB is available on {device}: lower max_sessions (or re-export with a smaller max_context)"
        )
        raise EngineError(msg)


def allocate_pools(shapes: dict[str, PoolShape], device: torch.device, stream=None) -> dict[str, CachePool]:
    """Both pools, or neither (a failure frees what was allocated); refused first if they cannot fit."""
    check_room(shapes, device)
    pools: dict[str, CachePool] = {}
    try:
        for name, shape in shapes.items():
            pools[name] = CachePool.allocate(name, shape, device, stream)
    except BaseException as error:
        close_pools(pools)
        if isinstance(error, (MemoryError, RuntimeError)) and not isinstance(error, EngineError):
            raise EngineError(f"allocating the cache pools ({shapes}) failed on {device}: {type(error).__name__}: {error}") from error
        raise
    return pools


def pool_named(pools: dict[str, CachePool] | None, name: str) -> CachePool:
    """The pool called ``name``; EngineError naming the valid pools if there is none (or the backend is closed)."""
    if pools is None or name not in pools:
        raise EngineError(f"pool must be one of {sorted(pools or {})}, got {name!r}")
    return pools[name]


def close_pools(pools: dict[str, CachePool] | None) -> None:
    """Free every pool (None: nothing allocated yet, or already closed). The caller syncs first."""
    for pool in (pools or {}).values():
        pool.close()
