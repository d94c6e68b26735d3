"""The CUDA kernel of the token choice (``runtime/kernels/sampling.py``) against the definition.

The torch backend on CUDA runs ``torch.ops.dflash_trt.choose`` as fused
Triton passes; they must choose what the eager definition (``sampling.choose``)
chooses, on the GPU and on the CPU, for the same draws as tests/export/test_sampling.py,
for rows built to hit ties, masked tokens and chunk edges, and inside a CUDA graph.
The kernels' modular multiply (shifts and adds instead of a 64-bit remainder) is
also checked alone, on the GPU or through Triton's interpreter.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_trt.export import sampling
from dflash_trt.export.sampling import seed_parts
from test_sampling import NAMES, ROWS, draws

gpu = pytest.mark.gpu
TRITON = importlib.util.find_spec("triton") is not None


@pytest.fixture(scope="module")
def kernels():
    from dflash_trt.runtime.kernels import sampling as kernels

    kernels.register_cuda_choose()  # torch.ops.dflash_trt.choose on CUDA runs choose_cuda from here on
    return kernels


@gpu
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


# (temperature, top_k, top_p): every stage on and off, the extremes of top_k and top_p.
EDGE_SETTINGS = ((0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 1, 1.0), (1.0, 3840, 1.0), (1.3, 0, 1e-6), (1.0, 0, 0.9),
                 (0.5, 7, 0.3), (2.0, 3840, 0.999), (1e-6, 0, 1.0), (1.0, 0, 0.5))


def edge_rows(vocab: int, rng: np.random.Generator) -> np.ndarray:
    """Logits rows that break naive kernels: all equal (every token ties), a few integer levels
    (ties at the k-th value and at top-p cuts), half the vocabulary at -inf (a masked
    vocabulary), zeros of both signs, and plain gaussian rows."""
    gaussian = 3.0 * rng.standard_normal(vocab)
    masked = gaussian.copy()
    masked[rng.permutation(vocab)[: vocab // 2]] = -np.inf
    signed_zeros = np.where(rng.random(vocab) < 0.5, -0.0, 0.0)
    rows = [np.full(vocab, 1.5), rng.integers(-3, 4, vocab).astype(np.float64), masked, signed_zeros, gaussian]
    return np.stack(rows).astype(np.float32)


def edge_inputs(vocab: int) -> list[torch.Tensor]:
    """``edge_rows`` under every one of EDGE_SETTINGS: the op's six CPU inputs."""
    rng = np.random.default_rng(vocab)
    base = edge_rows(vocab, rng)
    settings = [(t, min(k, vocab), p) for t, k, p in EDGE_SETTINGS]
    logits = torch.from_numpy(np.repeat(base, len(settings), axis=0))
    rows = logits.shape[0]
    temperature = torch.tensor([t for t, _, _ in settings] * len(base), dtype=torch.float32)
    top_k = torch.tensor([k for _, k, _ in settings] * len(base), dtype=torch.int64)
    top_p = torch.tensor([p for _, _, p in settings] * len(base), dtype=torch.float32)
    seed = torch.tensor([seed_parts(int(s)) for s in rng.integers(0, 2**62, rows)], dtype=torch.int64)
    position = torch.from_numpy(rng.integers(0, sampling.PRIME, rows))
    return [logits, temperature, top_k, top_p, seed, position]


@gpu
@pytest.mark.parametrize("vocab", [5, 1000, 4096, 4097, 151936])
def test_cuda_kernel_edge_rows_and_chunk_edges(kernels, vocab):
    """Guards against a kernel that is right on gaussian rows only: ties (first index wins, ties at
    the k-th value all kept), -inf logits, -0.0 versus +0.0, top_k = 1, top_p near 0 and near 1,
    near-greedy temperatures, and vocabularies smaller than, equal to and one past a chunk; every
    row under every setting equals the definition on the CPU."""
    cpu = edge_inputs(vocab)
    with torch.no_grad():
        fused = torch.ops.dflash_trt.choose(*[t.cuda() for t in cpu]).cpu()
        reference = sampling.choose(*cpu)
    assert torch.equal(fused, reference), (vocab, (fused != reference).nonzero()[:10, 0].tolist())


@gpu
def test_cuda_kernel_replays_in_a_cuda_graph(kernels):
    """Guards against host syncs or host-to-device copies inside the kernel's launch sequence (a CUDA
    graph capture would fail, or replay stale inputs) and against per-call state that a replay
    does not reset (arrival counters, the running argmax): captured once, replayed on new
    logits, it returns the eager choice for those logits."""
    feeds = draws(8192)
    inputs = [torch.from_numpy(feeds[name])[:64].cuda() for name in NAMES]
    with torch.no_grad():
        kernels.choose_cuda(*inputs)  # warm-up: compiles the kernels
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = kernels.choose_cuda(*inputs)
        for scale in (1.0, 3.0, 0.5):
            inputs[0].copy_(torch.from_numpy(feeds["logits"][64:128]).cuda() * scale)
            graph.replay()
            assert torch.equal(out, sampling.choose(*inputs))


INTERPRETED_CHOICE = """
import sys, torch
from dflash_trt.runtime.kernels.sampling import choose_cuda

inputs = torch.load(sys.argv[1])
torch.save(choose_cuda(*inputs), sys.argv[2])
"""


@pytest.mark.skipif(not TRITON, reason="needs triton (it ships with the CUDA builds of torch)")
def test_fused_passes_in_the_interpreter_choose_what_the_definition_chooses(tmp_path):
    """Bug: an edit of the kernels' Triton code (a shared helper, a moved stage) changes the function
    where no GPU is at hand to notice: all ten passes, run by Triton's interpreter on the CPU
    (tl.exp/tl.log for libdevice's), choose the definition's token for the tied and the masked edge
    rows under every setting, over a vocabulary one token past a chunk (two programs per row)."""
    from dflash_trt.runtime.kernels.sampling import BLOCK

    settings = len(EDGE_SETTINGS)
    # Rows of edge_inputs: edge_rows' rows 1 (integer levels: ties) and 2 (half masked), each under
    # every setting (the interpreter runs each program in turn: ~10 ms a program).
    inputs = [t[settings : 3 * settings] for t in edge_inputs(BLOCK + 1)]
    given, chosen = tmp_path / "inputs.pt", tmp_path / "chosen.pt"
    torch.save(inputs, given)
    env = dict(os.environ, TRITON_INTERPRET="1")  # read when the kernels' module is imported
    command = [sys.executable, "-c", INTERPRETED_CHOICE, str(given), str(chosen)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    fused, reference = torch.load(chosen), sampling.choose(*inputs)
    assert torch.equal(fused, reference), (fused != reference).nonzero()[:10, 0].tolist()


MULMOD_CHECK = """
import torch, triton, triton.language as tl
from dflash_trt.runtime.kernels.sampling import _mulmod

@triton.jit
def mulmod_kernel(a_ptr, b_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    a = tl.load(a_ptr + offsets, mask=mask, other=0).to(tl.uint32)
    b = tl.load(b_ptr + offsets, mask=mask, other=0).to(tl.uint32)
    tl.store(out_ptr + offsets, _mulmod(a, b).to(tl.int64), mask=mask)

p = 2**31 - 69
edges = torch.tensor([0, 1, 2, 68, 69, 70, 2**30, 2**31 - 70, p - 2, p - 1, 1103515245], dtype=torch.int64)
generator = torch.Generator().manual_seed(0)
a = torch.cat([edges.repeat_interleave(len(edges)), torch.randint(0, p, (DRAWS,), generator=generator)])
b = torch.cat([edges.repeat(len(edges)), torch.randint(0, p, (DRAWS,), generator=generator)])
a, b = a.to(DEVICE), b.to(DEVICE)
out = torch.empty_like(a)
mulmod_kernel[(triton.cdiv(len(a), 1024),)](a, b, out, len(a), BLOCK=1024)
want = a * b % p
assert torch.equal(out, want), (a[out != want][:5].tolist(), b[out != want][:5].tolist())
"""


def _run_mulmod_check(directory: Path, device: str, draws_: int, interpret: bool) -> None:
    script = directory / "mulmod_check.py"  # Triton compiles @jit functions from a source file
    script.write_text(MULMOD_CHECK.replace("DRAWS", str(draws_)).replace("DEVICE", repr(device)))
    env = dict(os.environ, TRITON_INTERPRET="1") if interpret else dict(os.environ)
    result = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]


@pytest.mark.skipif(not TRITON, reason="needs triton (it ships with the CUDA builds of torch)")
def test_mulmod_reduction_equals_the_remainder_in_the_interpreter(tmp_path):
    """Bug: the shift-and-add reduction modulo 2**31 - 69 differs from int64 ``%`` (a missed carry,
    a second subtraction needed): on edge residues and random products, Triton's interpreter."""
    _run_mulmod_check(tmp_path, "cpu", 100_000, interpret=True)


@gpu
def test_mulmod_reduction_equals_the_remainder_on_the_gpu(tmp_path):
    """Bug: the compiled reduction differs from int64 ``%`` (signed instead of unsigned shifts or
    high product): on edge residues and 10**7 random products, on the GPU."""
    _run_mulmod_check(tmp_path, "cuda", 10_000_000, interpret=False)
