"""``export.sampling.choose`` on CUDA in a dozen fused Triton passes (the torch backend's token choice).

The eager definition runs ~130 PyTorch kernels over [R, V] (int64 hash, 20
top-p bisection steps); here each pass reads the row block once, in chunks of
``BLOCK`` tokens per program, and the cross-chunk reductions are small
per-chunk partials that the next pass sums in a fixed order:

1. ``_scan``: z = logits / T (IEEE division, as torch), per-chunk max; for
   top-k rows the first 8-bit digit histogram of an order-preserving key of z.
2. ``_radix`` x 3: the next digits: the exact k-th largest z (TopK's value).
3. ``_mass``: the total of w = exp(z - max) over the top-k set.
4. ``_nucleus`` x 5: the 20 top-p bisection steps, 4 per pass: the 15 thresholds
   the next 4 steps may test are known (each a float sum of the current floor
   and the steps taken), so one pass sums w above each and the bisection walks
   4 steps on those masses; the result is the sequential bisection's.
5. ``_noise``: keep, the integer hash (exact int64), Gumbel noise, per-chunk
   argmax (first index on ties); the chunks' winners are reduced in torch.

Same function as the eager module: the integer hash, the comparisons and the
threshold arithmetic are exact; exp and log are libdevice's (what PyTorch's
CUDA kernels call); only the summation order of the masses differs, which
can change a top-p decision only when a mass equals top_p x total to within
float rounding. tests/test_sampling_cuda.py holds it against the eager module.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from dflash_trt.export import sampling
from dflash_trt.export.sampling import LANE_A, LANE_B, PRIME, TOKEN_MULTIPLIER

BLOCK = 4096  # tokens per program
SUB = 256  # tokens per inner step (the nucleus pass holds SUB x 16 values)
STEPS_PER_PASS = 4
PASSES = sampling.TOP_P_STEPS // STEPS_PER_PASS
assert PASSES * STEPS_PER_PASS == sampling.TOP_P_STEPS
# libdevice's expf/logf are what PyTorch's CUDA kernels call (tl.exp/tl.log are approximations);
# Triton's CPU interpreter (TRITON_INTERPRET=1, the tests' way to run these kernels) has no libdevice.
if os.environ.get("TRITON_INTERPRET") == "1":

    @triton.jit
    def _exp(x):
        return tl.exp(x)

    @triton.jit
    def _log(x):
        return tl.log(x)

else:

    @triton.jit
    def _exp(x):
        return libdevice.exp(x)

    @triton.jit
    def _log(x):
        return libdevice.log(x)



# --------------------------------------------------------------------------- per-row scalars


@triton.jit
def _scale(temperature_ptr, row):
    t = tl.load(temperature_ptr + row)
    return tl.where(t <= 0.0, 1.0, t)


@triton.jit
def _z(logits_ptr, row, offsets, vocab, scale):
    """z of the chunk (-inf past the vocabulary) and the in-range mask."""
    valid = offsets < vocab
    x = tl.load(logits_ptr + row * vocab + offsets, mask=valid, other=float("-inf"))
    return tl.math.div_rn(x, scale), valid


@triton.jit
def _key(z):
    """float32 -> int64 in [0, 2**32), increasing with z (-0.0 counted as +0.0)."""
    bits = (z + 0.0).to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return ordered.to(tl.int64) + 2147483648


@triton.jit
def _unkey(key):
    ordered = (key - 2147483648).to(tl.int32)
    bits = tl.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _row_max(pmax_ptr, row, chunks, CHUNKS: tl.constexpr):
    c = tl.arange(0, CHUNKS)
    return tl.max(tl.load(pmax_ptr + row * chunks + c, mask=c < chunks, other=float("-inf")), axis=0)


@triton.jit
def _kth_prefix(hist_ptr, row, rows, k, digits: tl.constexpr):
    """The first ``digits`` 8-bit digits of the k-th largest key (and k left inside that prefix)."""
    prefix = tl.zeros((), tl.int64)
    remaining = k
    bins = tl.arange(0, 256)
    for d in tl.static_range(digits):
        # Reversed histogram: position i holds digit 255 - i; cumulative = keys with digit >= 255 - i.
        counts = tl.load(hist_ptr + (d * rows + row) * 256 + 255 - bins).to(tl.int64)
        cumulative = tl.cumsum(counts, axis=0)
        hit = cumulative >= remaining
        first = tl.min(tl.where(hit, bins, 256), axis=0)
        above = tl.sum(tl.where(bins < first, counts, 0), axis=0)
        remaining = remaining - above
        prefix = prefix * 256 + (255 - first)
    return prefix, remaining


@triton.jit
def _kth_value(hist_ptr, row, rows, k):
    prefix, _ = _kth_prefix(hist_ptr, row, rows, k, 4)
    return _unkey(prefix)


# --------------------------------------------------------------------------- passes


@triton.jit
def _scan(logits_ptr, temperature_ptr, top_k_ptr, pmax_ptr, hist_ptr, vocab, chunks, BLOCK: tl.constexpr):
    row, chunk = tl.program_id(0), tl.program_id(1)
    offsets = chunk * BLOCK + tl.arange(0, BLOCK)
    z, valid = _z(logits_ptr, row, offsets, vocab, _scale(temperature_ptr, row))
    tl.store(pmax_ptr + row * chunks + chunk, tl.max(z, axis=0))
    if tl.load(top_k_ptr + row) > 0:
        counts = tl.histogram((_key(z) >> 24).to(tl.int32), 256, mask=valid)
        tl.atomic_add(hist_ptr + row * 256 + tl.arange(0, 256), counts)


@triton.jit
def _radix(logits_ptr, temperature_ptr, top_k_ptr, hist_ptr, vocab, rows, DIGIT: tl.constexpr, BLOCK: tl.constexpr):
    """Digit DIGIT (1..3) of the k-th largest key, among keys whose higher digits match."""
    row, chunk = tl.program_id(0), tl.program_id(1)
    k = tl.load(top_k_ptr + row)
    if k > 0:
        prefix, _ = _kth_prefix(hist_ptr, row, rows, k, DIGIT)
        offsets = chunk * BLOCK + tl.arange(0, BLOCK)
        z, valid = _z(logits_ptr, row, offsets, vocab, _scale(temperature_ptr, row))
        key = _key(z)
        shift = 24 - 8 * DIGIT
        inside = valid & ((key >> (shift + 8)) == prefix)
        counts = tl.histogram(((key >> shift) & 255).to(tl.int32), 256, mask=inside)
        tl.atomic_add(hist_ptr + (DIGIT * rows + row) * 256 + tl.arange(0, 256), counts)


@triton.jit
def _top_k_keep(z, valid, k, kth):
    """z >= the k-th largest z (every token when k == 0)."""
    return valid & (z >= tl.where(k > 0, kth, float("-inf")))


@triton.jit
def _weights(z, valid, top, k, kth):
    keep = _top_k_keep(z, valid, k, kth)
    return tl.where(keep, _exp(z - top), 0.0), keep


@triton.jit
def _mass(logits_ptr, temperature_ptr, top_k_ptr, pmax_ptr, hist_ptr, psum_ptr, vocab, rows, chunks,
          CHUNKS: tl.constexpr, BLOCK: tl.constexpr):
    row, chunk = tl.program_id(0), tl.program_id(1)
    k = tl.load(top_k_ptr + row)
    kth = _kth_value(hist_ptr, row, rows, k)
    top = _row_max(pmax_ptr, row, chunks, CHUNKS)
    offsets = chunk * BLOCK + tl.arange(0, BLOCK)
    z, valid = _z(logits_ptr, row, offsets, vocab, _scale(temperature_ptr, row))
    w, _ = _weights(z, valid, top, k, kth)
    tl.store(psum_ptr + row * chunks + chunk, tl.sum(w, axis=0))


@triton.jit
def _candidates(floor, first_step, deltas_ptr):
    """The 16 floors the next 4 bisection steps can reach from ``floor`` (lane i: steps taken = i's bits).

    ``deltas_ptr[s - 1]`` = step s's increment, span * 2**-s in float32 (the eager module's constant).
    """
    lanes = tl.arange(0, 16)
    c = tl.zeros((16,), tl.float32) + floor
    for j in tl.static_range(4):
        delta = tl.load(deltas_ptr + first_step - 1 + j)
        c = tl.where(((lanes >> (3 - j)) & 1) == 1, c + delta, c)
    return c


@triton.jit
def _floor(pmass_ptr, psum_ptr, pmax_ptr, top_p_ptr, deltas_ptr, row, rows, chunks, span, PASS: tl.constexpr, CHUNKS: tl.constexpr):
    """The bisection floor after PASS passes (4 steps each), from the earlier passes' partial masses."""
    c = tl.arange(0, CHUNKS)
    total = tl.sum(tl.load(psum_ptr + row * chunks + c, mask=c < chunks, other=0.0), axis=0)
    target = tl.load(top_p_ptr + row) * total
    floor = _row_max(pmax_ptr, row, chunks, CHUNKS) - span
    lanes = tl.arange(0, 16)
    for p in tl.static_range(PASS):
        candidates = _candidates(floor, 1 + 4 * p, deltas_ptr)
        parts = tl.load(pmass_ptr + ((p * rows + row) * chunks + c[:, None]) * 16 + lanes[None, :], mask=(c < chunks)[:, None], other=0.0)
        masses = tl.sum(parts, axis=0)  # [16]; lane 0 unused
        # Monotone in the lane: the bisection takes the largest candidate whose mass reaches the target.
        best = tl.max(tl.where((masses >= target) & (lanes > 0), lanes, 0), axis=0)
        floor = tl.sum(tl.where(lanes == best, candidates, 0.0), axis=0)
    return floor


@triton.jit
def _nucleus(logits_ptr, temperature_ptr, top_k_ptr, top_p_ptr, pmax_ptr, hist_ptr, psum_ptr, pmass_ptr, deltas_ptr,
             vocab, rows, chunks, span, PASS: tl.constexpr, CHUNKS: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr):
    """Pass PASS of the top-p bisection: the mass of w above each of the next 15 candidate floors."""
    row, chunk = tl.program_id(0), tl.program_id(1)
    lanes = tl.arange(0, 16)
    if tl.load(top_p_ptr + row) < 1.0:
        k = tl.load(top_k_ptr + row)
        kth = _kth_value(hist_ptr, row, rows, k)
        top = _row_max(pmax_ptr, row, chunks, CHUNKS)
        floor = _floor(pmass_ptr, psum_ptr, pmax_ptr, top_p_ptr, deltas_ptr, row, rows, chunks, span, PASS, CHUNKS)
        candidates = _candidates(floor, 1 + 4 * PASS, deltas_ptr)
        scale = _scale(temperature_ptr, row)
        acc = tl.zeros((16,), tl.float32)
        for start in range(0, BLOCK, SUB):
            offsets = chunk * BLOCK + start + tl.arange(0, SUB)
            z, valid = _z(logits_ptr, row, offsets, vocab, scale)
            w, _ = _weights(z, valid, top, k, kth)
            acc += tl.sum(tl.where(z[:, None] >= candidates[None, :], w[:, None], 0.0), axis=0)
        tl.store(pmass_ptr + ((PASS * rows + row) * chunks + chunk) * 16 + lanes, acc)


@triton.jit
def _mulmod(a, b):
    return a * b % 2147483579


@triton.jit
def _cube(x):
    return _mulmod(_mulmod(x, x), x)


@triton.jit
def _lane(seed_ptr, row, position, c0, c1, c2, c3, c4):
    x = tl.zeros((), tl.int64) + c0
    x = _cube((x + tl.load(seed_ptr + row * 3) + c1) % 2147483579)
    x = _cube((x + tl.load(seed_ptr + row * 3 + 1) + c2) % 2147483579)
    x = _cube((x + tl.load(seed_ptr + row * 3 + 2) + c3) % 2147483579)
    return _cube((x + position + c4) % 2147483579)


@triton.jit
def _noise_scores(z, offsets, key_a, key_b):
    """z + g(seed, position, token) for the chunk's tokens (the integer hash, then Gumbel)."""
    spread = offsets.to(tl.int64) * 1103515245 % 2147483579
    x = spread + key_a
    x = _cube(tl.where(x >= 2147483579, x - 2147483579, x))
    x = x + key_b
    h = _cube(tl.where(x >= 2147483579, x - 2147483579, x))
    u = (h.to(tl.float32) + 0.5) * 4.656612873077393e-10  # 2**-31
    w = 1.0 - u
    exponential = tl.where(w == 1.0, u, tl.math.div_rn(u * _log(w), w - 1.0))
    return z - _log(exponential)


@triton.jit
def _noise(logits_ptr, temperature_ptr, top_k_ptr, top_p_ptr, seed_ptr, position_ptr, pmax_ptr, hist_ptr,
           psum_ptr, pmass_ptr, deltas_ptr, best_ptr, index_ptr, vocab, rows, chunks, span,
           A0, A1, A2, A3, A4, B0, B1, B2, B3, B4,
           PASSES: tl.constexpr, CHUNKS: tl.constexpr, BLOCK: tl.constexpr):
    row, chunk = tl.program_id(0), tl.program_id(1)
    offsets = chunk * BLOCK + tl.arange(0, BLOCK)
    valid = offsets < vocab
    logits = tl.load(logits_ptr + row * vocab + offsets, mask=valid, other=float("-inf"))
    if tl.load(temperature_ptr + row) <= 0.0:
        score = logits
    else:
        z, _ = _z(logits_ptr, row, offsets, vocab, _scale(temperature_ptr, row))
        k = tl.load(top_k_ptr + row)
        keep = _top_k_keep(z, valid, k, _kth_value(hist_ptr, row, rows, k))
        if tl.load(top_p_ptr + row) < 1.0:
            floor = _floor(pmass_ptr, psum_ptr, pmax_ptr, top_p_ptr, deltas_ptr, row, rows, chunks, span, PASSES, CHUNKS)
            keep = keep & (z >= floor)
        position = tl.load(position_ptr + row)
        key_a = _lane(seed_ptr, row, position, A0, A1, A2, A3, A4)
        key_b = _lane(seed_ptr, row, position, B0, B1, B2, B3, B4)
        score = tl.where(keep, _noise_scores(z, offsets, key_a, key_b), float("-inf"))
    best = tl.max(score, axis=0)
    first = tl.min(tl.where(score == best, offsets, 2147483647), axis=0)
    tl.store(best_ptr + row * chunks + chunk, best)
    tl.store(index_ptr + row * chunks + chunk, first.to(tl.int64))


# --------------------------------------------------------------------------- the op's CUDA kernel


@functools.lru_cache(maxsize=16)
def _bisection_steps(vocab: int, device: torch.device) -> tuple[float, torch.Tensor]:
    """(span as float32, the 20 step increments span * 2**-s as a float32 tensor on ``device``).

    Made once per vocabulary and device (before any CUDA-graph capture: a
    host-to-device copy cannot be captured).
    """
    span = torch.tensor(sampling.top_p_span(vocab), dtype=torch.float32)
    steps = torch.arange(1, sampling.TOP_P_STEPS + 1, dtype=torch.float64)
    return float(span), (span.double() * 2.0**-steps).float().to(device)  # exact: powers of two


def choose_cuda(logits, temperature, top_k, top_p, seed, position) -> torch.Tensor:
    """``sampling.choose`` for CUDA tensors (same arguments, same result). Allocates its partials
    with the caching allocator and never syncs the host, so it can be captured in a CUDA graph."""
    rows, vocab = logits.shape
    logits = logits.float().contiguous()
    temperature, top_k, top_p, seed, position = (t.contiguous() for t in (temperature, top_k, top_p, seed, position))
    chunks = triton.cdiv(vocab, BLOCK)
    block_chunks = triton.next_power_of_2(chunks)
    device = logits.device
    span, deltas = _bisection_steps(vocab, device)
    pmax = torch.empty(rows, chunks, device=device)
    hist = torch.zeros(4, rows, 256, dtype=torch.int32, device=device)
    psum = torch.empty(rows, chunks, device=device)
    pmass = torch.zeros(PASSES, rows, chunks, 16, device=device)
    best = torch.empty(rows, chunks, device=device)
    index = torch.empty(rows, chunks, dtype=torch.int64, device=device)
    grid = (rows, chunks)
    _scan[grid](logits, temperature, top_k, pmax, hist, vocab, chunks, BLOCK=BLOCK)
    for digit in (1, 2, 3):
        _radix[grid](logits, temperature, top_k, hist, vocab, rows, DIGIT=digit, BLOCK=BLOCK)
    _mass[grid](logits, temperature, top_k, pmax, hist, psum, vocab, rows, chunks, CHUNKS=block_chunks, BLOCK=BLOCK)
    for p in range(PASSES):
        _nucleus[grid](logits, temperature, top_k, top_p, pmax, hist, psum, pmass, deltas, vocab, rows, chunks, span,
                       PASS=p, CHUNKS=block_chunks, BLOCK=BLOCK, SUB=SUB)
    _noise[grid](logits, temperature, top_k, top_p, seed, position, pmax, hist, psum, pmass, deltas, best, index,
                 vocab, rows, chunks, span, *LANE_A, *LANE_B, PASSES=PASSES, CHUNKS=block_chunks, BLOCK=BLOCK)
    winner = best.argmax(dim=1, keepdim=True)  # first chunk holding the max: the first index overall
    return index.gather(1, winner)[:, 0]


# The kernels spell these constants out (Triton inlines literals); keep them the definition's.
assert TOKEN_MULTIPLIER == 1103515245 and PRIME == 2147483579 and 2.0**-31 == 4.656612873077393e-10


sampling.choose_op.register_kernel("cuda")(choose_cuda)  # the torch backend's token choice on CUDA
