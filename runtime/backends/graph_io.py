"""What a backend needs to know about a contract graph's IO, beyond the contract itself.

- which cache pool a graph's ``past_*`` / ``present_*`` bindings address;
- dtype names of the contract as torch dtypes and ONNX element types;
- ``check_feeds``: the caller's feeds against the contract (names, dtypes,
  shapes, device) before anything is enqueued, with a message naming the
  graph, the input and both values; it resolves the dynamic dims.
  ``check_run`` is what every ``Backend.run`` checks: the feeds and the
  graph's cache rows (``check_rows``).

Pure host-side checks on tensor metadata: nothing here touches device memory
or synchronizes.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from dflash_trt.checks import is_int
from dflash_trt.errors import EngineError
from dflash_trt.export import contract as c
from dflash_trt.export.contract import GraphSpec, TensorSpec
from dflash_trt.export.torch_dtypes import TORCH_DTYPES

# Which pool the cache bindings of each graph kind address (None: the graph has no caches).
POOL_OF_KIND: dict[str, str | None] = {
    c.TARGET_PREFILL: "target",
    c.TARGET_VERIFY: "target",
    c.TARGET_DECODE: "target",
    c.DRAFT_CONTEXT: "draft",
    c.DRAFT: "draft",
    c.VERIFY_ARGMAX: None,
    c.VERIFY_SAMPLE: None,
    c.SAMPLE: None,
}


def torch_dtype(name: str) -> torch.dtype:
    if name not in TORCH_DTYPES:
        raise EngineError(f"contract dtype {name!r} has no torch dtype; known: {sorted(TORCH_DTYPES)}")
    return TORCH_DTYPES[name]


def pool_of(spec: GraphSpec) -> str | None:
    """'target', 'draft' or None for the graph's cache bindings."""
    return POOL_OF_KIND[spec.kind]


def owner_rows(spec: GraphSpec) -> int:
    """How many consecutive cache rows the graph binds (1 for the dynamic graphs)."""
    return spec.owners or 1


def plain_inputs(spec: GraphSpec) -> tuple[TensorSpec, ...]:
    """Inputs the caller feeds (everything but the caches)."""
    return tuple(s for s in spec.inputs if not s.name.startswith("past_"))


def plain_outputs(spec: GraphSpec) -> tuple[TensorSpec, ...]:
    """Outputs returned to the caller (everything but the in-place caches)."""
    return tuple(s for s in spec.outputs if not s.name.startswith("present_"))


def check_rows(spec: GraphSpec, first_row: int, pool_rows: int) -> None:
    """The graph's n consecutive rows from ``first_row`` must lie inside the pool."""
    n = owner_rows(spec)
    if not is_int(first_row) or not 0 <= first_row <= pool_rows - n:
        msg = f"graph {spec.name!r} binds {n} cache rows: first_row must be in [0, {pool_rows - n}] (pool of {pool_rows} rows), got {first_row!r}"
        raise EngineError(msg)


def check_run(spec: GraphSpec, feeds: Mapping[str, torch.Tensor], first_row: int, device: torch.device, pool_rows: int) -> dict[str, int]:
    """One ``Backend.run``'s arguments: the feeds (``check_feeds``) and, for a graph with caches,
    ``first_row`` (``check_rows``). Returns the dynamic dims' sizes."""
    sizes = check_feeds(spec, feeds, device)
    if pool_of(spec) is not None:
        check_rows(spec, first_row, pool_rows)
    return sizes


def check_feeds(spec: GraphSpec, feeds: Mapping[str, torch.Tensor], device: torch.device) -> dict[str, int]:
    """Every plain input present, nothing else, each of the contract's dtype and shape on ``device``.

    Returns the sizes of the dynamic dims (``{"T": 5}``) read off the feeds.
    """
    wanted = plain_inputs(spec)
    names = {s.name for s in wanted}
    missing, extra = sorted(names - feeds.keys()), sorted(feeds.keys() - names)
    if missing or extra:
        msg = f"graph {spec.name!r} feeds: missing {missing}, not inputs of the graph {extra} (inputs: {sorted(names)})"
        raise EngineError(msg)
    sizes: dict[str, int] = {}
    for s in wanted:
        _check_feed(spec, s, feeds[s.name], device, sizes)
    return sizes


def _check_feed(spec: GraphSpec, s: TensorSpec, tensor: torch.Tensor, device: torch.device, sizes: dict[str, int]) -> None:
    where = f"graph {spec.name!r} input {s.name!r}"
    if not isinstance(tensor, torch.Tensor):
        raise EngineError(f"{where} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype != TORCH_DTYPES[s.dtype]:
        raise EngineError(f"{where} dtype must be {s.dtype}, got {tensor.dtype}")
    if tensor.device.type != device.type:
        raise EngineError(f"{where} must be on {device}, got {tensor.device}")
    if tensor.dim() != len(s.shape) or not tensor.is_contiguous():
        raise EngineError(f"{where} must be a contiguous tensor of shape {list(s.shape)}, got {list(tensor.shape)} (contiguous: {tensor.is_contiguous()})")
    for axis, (want, got) in enumerate(zip(s.shape, tensor.shape)):
        if isinstance(want, str):
            _check_dim(spec, where, want, got, sizes)
        elif want != got:
            raise EngineError(f"{where} shape must be {list(s.shape)}, got {list(tensor.shape)} (axis {axis})")


def _check_dim(spec: GraphSpec, where: str, symbol: str, got: int, sizes: dict[str, int]) -> None:
    bounds = spec.dims[symbol]
    if not bounds.min <= got <= bounds.max:
        raise EngineError(f"{where} dim {symbol!r} must be in [{bounds.min}, {bounds.max}], got {got}")
    if sizes.setdefault(symbol, got) != got:
        raise EngineError(f"{where} dim {symbol!r} is {got} here but {sizes[symbol]} in another input")


def prefix_view(flat: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The first prod(shape) elements of a flat max-size buffer, as ``shape`` (no copy).

    A dynamic output (e.g. taps [1, T, W]) is bound to such a prefix of the
    buffer allocated for its largest shape.
    """
    count = 1
    for d in shape:
        count *= d
    return flat[:count].view(shape)

