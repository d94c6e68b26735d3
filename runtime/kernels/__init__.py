"""The torch backend's fused kernels: the fast path of the contract graphs and the token choice.

- ``plan``: launch plans (tilings, attention splits) as pure functions of static shapes;
- ``triton_ops``: the Triton kernels (CUDA): skinny GEMM with RMSNorm prologue and
  residual / SiLU-gate epilogues, q/k-norm + RoPE + KV write, split-K attention over
  the valid cache slots;
- ``exact_ops``: the same interface with kernels whose rows don't depend on the batch (one
  ``tl.dot`` linear for every row count, attention split at fixed slot windows): DFlash equals
  plain decoding bit for bit in bf16 (``TorchBackend(..., kernels="exact")``);
- ``torch_ops``: their pure-torch twin (any device; what the CPU tests run);
- ``fused``: q|k|v and gate|up weights fused at load, the target/draft forwards over them;
- ``quant``: the draft's weights in fp8 with a scale per row (``draft_weights="fp8"``);
- ``modules``: the contract graphs built from those forwards;
- ``sampling``: the token choice (``torch.ops.dflash_trt.choose``) as fused Triton passes
  (CUDA), registered as the op's CUDA kernel by ``register_cuda_choose()``.

``fast_path(target, draft, dims, ops)`` returns the graph modules; the torch
backend uses them on CUDA by default (``TorchBackend(..., kernels="fast")``).
"""

from __future__ import annotations

from dflash_trt.export.contract import Dims
from dflash_trt.runtime.kernels.fused import FastDraft, FastTarget, supported
from dflash_trt.runtime.kernels.modules import fast_graph_modules


def fast_path(specs, target, draft, dims: Dims, ops, draft_weights: str = "model") -> dict:
    """Fuse the pair's weights (in place: the modules' parameters become views) and build the graphs;
    ``draft_weights="fp8"``: the draft's products in fp8 (``quant``; new tensors beside the model's)."""
    fast_target = FastTarget(target, ops)
    return fast_graph_modules(specs, fast_target, FastDraft(draft, fast_target, ops, draft_weights), dims)


def default_ops(device):
    """``TritonOps`` on CUDA, the pure-torch twin elsewhere."""
    if device.type == "cuda":
        from dflash_trt.runtime.kernels.triton_ops import TritonOps

        return TritonOps()
    from dflash_trt.runtime.kernels.torch_ops import TorchOps

    return TorchOps()


def exact_default_ops(device):
    """``ExactOps`` (Triton: CUDA, or CPU tensors under Triton's interpreter)."""
    from dflash_trt.runtime.kernels.exact_ops import ExactOps

    return ExactOps()


OPS = {"fast": default_ops, "exact": exact_default_ops}  # kernels name -> ops factory (device -> ops)


__all__ = ["OPS", "default_ops", "exact_default_ops", "fast_path", "supported"]
