"""Run one deserialized engine once over torch buffers: the probe's and ``selfcheck``'s execution.

Buffers are torch tensors on ``device`` (CUDA; CPU only for stand-in
engines in tests): the feeds are copied there (the engine writes its cache
inputs in place), every cache output is bound to its input's buffer (as the
runtime binds them), other outputs get buffers of the context's shapes.
One ``execute_async_v3`` on the current stream at optimization profile
``profile``, one host sync, outputs copied back to the host. Every TensorRT
call goes through ``engines.calls.trt_call``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from dflash_trt.engines.bindings import trt_dtype_name
from dflash_trt.engines.calls import trt_call
from dflash_trt.engines.flavour import Flavour
from dflash_trt.errors import EngineError
from dflash_trt.export.torch_dtypes import TORCH_DTYPES


def execute(
    flavour: Flavour,
    engine,
    feeds: Mapping[str, torch.Tensor],
    aliases: Mapping[str, str],
    device: torch.device,
    cache_dir: Path | None = None,
    name: str = "engine",
    profile: int = 0,
    specialize: bool = False,
) -> dict[str, torch.Tensor]:
    """Host outputs of one run; ``aliases`` maps each cache output to the input whose buffer it
    writes; ``specialize``: the context's kernels (``Flavour.execution_context``)."""
    where = f"engine {name!r}"
    context, runtime_cache = flavour.execution_context(engine, cache_dir, name, specialize=specialize)
    if context is None:
        msg = f"{where}: TensorRT could not create an execution context (device memory?)"
        raise EngineError(msg)
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    if profile:
        trt_call(where, "set_optimization_profile_async", context.set_optimization_profile_async, profile, stream)
    buffers = {key: tensor.to(device).contiguous().clone() for key, tensor in feeds.items()}
    for key, tensor in buffers.items():
        trt_call(where, "set_input_shape", context.set_input_shape, key, tuple(tensor.shape))
    outputs = {}
    for index in range(engine.num_io_tensors):
        tensor_name = engine.get_tensor_name(index)
        if tensor_name not in buffers:
            outputs[tensor_name] = _output_buffer(engine, context, tensor_name, buffers, aliases, device)
        buffer = buffers.get(tensor_name, outputs.get(tensor_name))
        trt_call(where, f"set_tensor_address[{tensor_name}]", context.set_tensor_address, tensor_name, buffer.data_ptr())
    trt_call(where, "execute_async_v3", context.execute_async_v3, stream)
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()  # host sync: the results are read next
    if cache_dir is not None:
        flavour.save_runtime_cache(runtime_cache, cache_dir)
    return {key: tensor.cpu() for key, tensor in outputs.items()}


def _output_buffer(engine, context, name: str, buffers: Mapping[str, torch.Tensor], aliases, device) -> torch.Tensor:
    # A KV-cache write (IKVCacheUpdateLayer) updates its cache input in place: the output must
    # be bound to that same buffer. The engine says which input where the API exists; the
    # contract's naming says it otherwise.
    aliased = getattr(engine, "get_aliased_input_tensor", lambda _n: None)(name) or aliases.get(name)
    if aliased:
        return buffers[aliased]
    shape = tuple(int(d) for d in context.get_tensor_shape(name))
    dtype = TORCH_DTYPES[trt_dtype_name(engine.get_tensor_dtype(name))]
    return torch.empty(shape, dtype=dtype, device=device)
