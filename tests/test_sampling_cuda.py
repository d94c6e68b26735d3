"""The CUDA kernel of the token choice (``runtime/backends/sampling_kernels.py``) against the definition.

The torch backend on CUDA runs ``torch.ops.dflash_trt.choose`` as fused
Triton passes; they must choose what the eager definition (``sampling.choose``)
chooses, on the GPU and on the CPU, for the same draws as tests/test_sampling.py,
and inside a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

from dflash_trt.export import sampling
from test_sampling import NAMES, ROWS, draws

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def kernels():
    from dflash_trt.runtime.backends import sampling_kernels as kernels

    return kernels


@pytest.mark.parametrize("vocab", sorted(ROWS))
def test_cuda_kernel_chooses_what_the_definition_chooses(kernels, vocab):
    """Guards against a fused kernel that computes another function (a wrong radix digit for the
    k-th value, a bisection step off by one, a hash constant typo, chunk-boundary or tie-breaking
    errors): on the >= 100,000 draws of test_sampling, the kernel's tokens equal the eager
    module's on the GPU and on the CPU."""
    feeds = draws(vocab)
    cpu = [torch.from_numpy(feeds[name]) for name in NAMES]
    cuda = [t.cuda() for t in cpu]
    with torch.no_grad():
        fused = torch.ops.dflash_trt.choose(*cuda).cpu()
        eager = sampling.choose(*cuda).cpu()
        reference = sampling.choose(*cpu)
    assert torch.equal(eager, reference), (vocab, (eager != reference).nonzero()[:10].tolist())
    assert torch.equal(fused, reference), (vocab, (fused != reference).nonzero()[:10].tolist())


def test_cuda_kernel_replays_in_a_cuda_graph(kernels):
    """Guards against host syncs or host-to-device copies inside the kernel's launch sequence (a CUDA
    graph capture would fail, or replay stale inputs): captured once, replayed on new logits, it
    returns the eager choice for those logits."""
    feeds = draws(8192)
    inputs = [torch.from_numpy(feeds[name])[:64].cuda() for name in NAMES]
    with torch.no_grad():
        kernels.choose_cuda(*inputs)  # warm-up: compiles the kernels
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = kernels.choose_cuda(*inputs)
        for scale in (1.0, 3.0):
            inputs[0].copy_(torch.from_numpy(feeds["logits"][64:128]).cuda() * scale)
            graph.replay()
            assert torch.equal(out, sampling.choose(*inputs))
