"""``export.sampling.choose`` on CUDA in ten fused Triton passes (the torch backend's token choice).

The eager definition runs ~130 PyTorch kernels over [R, V] (int64 hash, 20
top-p bisection steps); here each pass reads the row block once, in chunks of
``BLOCK`` tokens per program, and each row stage ends in the row's last
program (a per-row arrival counter): it reduces the chunks' partials in a
fixed order and leaves the row's scalars (max z, k-th value, top-p target and
floor, the chosen token) for the next pass. Every pass skips the rows whose
settings skip its stage:

1. ``_scan``: a greedy row's argmax, an untruncated row's Gumbel-max (both
   done here); for the others z = logits / T (IEEE division, as torch), the
   max z and, for top-k rows, the first 8-bit digit histogram of an
   order-preserving key of z.
2. ``_radix`` x 3 (top-k rows): the next digits: the exact k-th largest z (TopK's value).
3. ``_nucleus`` x 5 (top-p rows): the 20 top-p bisection steps, 4 per pass:
   the 15 floors the next 4 steps may test are known (each a float sum of the
   current floor and the steps taken), so one pass sums w = exp(z - max) over
   the top-k set above each (and, first, the total), and the row's last
   program walks 4 steps on those masses: the sequential bisection's result.
4. ``_final`` (truncated rows): each program lists its kept tokens (z >= max(k-th value,
   floor), in token order: often a few percent), then the integer hash, Gumbel noise and
   argmax run over that list only.

Same function as the eager module: the integer hash (reduced with shifts and
adds modulo 2**31 - 69, the same residues), the comparisons, the threshold
arithmetic and the argmax (first index on ties) are exact; exp and log are
libdevice's (what PyTorch's CUDA kernels call); only the summation order of
the masses differs, which can change a top-p decision only when a mass equals
top_p x total to within float rounding. Deterministic: float sums run in a
fixed order, atomics only add or max integers. tests/runtime/test_sampling_cuda.py
holds it against the eager module.

Importing this module registers nothing: ``register_cuda_choose()`` (called by
the torch backend when it sets up CUDA) makes ``choose_cuda`` the op's CUDA kernel.
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

BLOCK = 2048  # tokens per program (one chunk of a row); 4096 measured 24% slower on the H200 (fewer programs in flight)
SUB = 1024  # tokens per inner step of the elementwise passes
LANE_SUB = 256  # tokens per inner step of the nucleus passes (LANE_SUB x 16 accumulators)
NUM_WARPS = 4
STEPS_PER_PASS = 4
PASSES = sampling.TOP_P_STEPS // STEPS_PER_PASS
assert PASSES * STEPS_PER_PASS == sampling.TOP_P_STEPS
# Per-row arrival counters, one per pass that ends a row stage: scan, radix (last digit), nucleus 0..4, final.
SCAN_COUNTER, RADIX_COUNTER, NUCLEUS_COUNTER = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
FINAL_COUNTER = tl.constexpr(2 + PASSES)
COUNTERS = 3 + PASSES
# Per-row float scalars the passes leave for the next ones: state [R, 4].
TOP, KTH, FLOOR, TARGET = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2), tl.constexpr(3)
STATE = 4
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


# --------------------------------------------------------------------------- per-token math


@triton.jit
def _z(logits_ptr, row, offsets, vocab, scale):
    """z of the tile (-inf past the vocabulary) and the in-range mask."""
    valid = offsets < vocab
    x = tl.load(logits_ptr + row.to(tl.int64) * vocab + offsets, mask=valid, other=float("-inf"))
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
def _mulmod(a, b):
    """a * b mod 2**31 - 69 for uint32 a, b < 2**31 - 69, without a 64-bit remainder.

    a * b = hi 2**32 + lo = q 2**31 + r, and 2**31 = 69 (mod p): a * b = 69 q + r = t
    (< 2**38), then t = 69 (t >> 31) + (t & (2**31 - 1)) < p + 5,400, then one subtraction.
    """
    lo = a * b
    hi = tl.umulhi(a, b)
    q = (hi << 1) | (lo >> 31)  # < 2**31
    t = q.to(tl.uint64) * 69 + (lo & 0x7FFFFFFF).to(tl.uint64)
    s = (t >> 31).to(tl.uint32) * 69 + (t & 0x7FFFFFFF).to(tl.uint32)
    return tl.where(s >= 2147483579, s - 2147483579, s)


@triton.jit
def _addmod(a, b):
    s = a + b  # uint32: a, b < p < 2**31
    return tl.where(s >= 2147483579, s - 2147483579, s)


@triton.jit
def _cube(x):
    return _mulmod(_mulmod(x, x), x)


@triton.jit
def _lane(seed_ptr, row, position, c0, c1, c2, c3, c4):
    """One of the row's two 31-bit keys (a few scalar int64 operations per program)."""
    x = tl.zeros((), tl.int64) + c0
    x = (x + tl.load(seed_ptr + row * 3) + c1) % 2147483579
    x = _cube(x.to(tl.uint32)).to(tl.int64)
    x = (x + tl.load(seed_ptr + row * 3 + 1) + c2) % 2147483579
    x = _cube(x.to(tl.uint32)).to(tl.int64)
    x = (x + tl.load(seed_ptr + row * 3 + 2) + c3) % 2147483579
    x = _cube(x.to(tl.uint32)).to(tl.int64)
    x = (x + position + c4) % 2147483579
    return _cube(x.to(tl.uint32))


@triton.jit
def _row_keys(seed_ptr, position_ptr, row, A0, A1, A2, A3, A4, B0, B1, B2, B3, B4):
    """The row's two hash keys for the token at its position (what every token's noise mixes in)."""
    position = tl.load(position_ptr + row)
    return _lane(seed_ptr, row, position, A0, A1, A2, A3, A4), _lane(seed_ptr, row, position, B0, B1, B2, B3, B4)


@triton.jit
def _noise_scores(z, offsets, key_a, key_b):
    """z + g(seed, position, token) for the tile's tokens (the integer hash, then Gumbel)."""
    tokens = offsets.to(tl.uint32)
    spread = _mulmod(tokens, tokens * 0 + 1103515245)
    h = _cube(_addmod(_cube(_addmod(spread, key_a)), key_b))
    u = (h.to(tl.float32) + 0.5) * 4.656612873077393e-10  # 2**-31
    w = 1.0 - u
    exponential = tl.where(w == 1.0, u, tl.math.div_rn(u * _log(w), w - 1.0))
    return z - _log(exponential)


@triton.jit
def _better(score, offsets, best, index):
    """Running argmax of a tile position over the tiles (strict: the earlier token wins ties)."""
    take = score > best
    return tl.where(take, score, best), tl.where(take, offsets, index)


@triton.jit
def _packed(best, index):
    """The tile's argmax (first index on ties) as one int64 that orders like (score, -index)."""
    top = tl.max(best, axis=0)
    first = tl.min(tl.where(best == top, index, 2147483647), axis=0)
    return (_key(top) << 31) | (2147483647 - first).to(tl.int64)


@triton.jit
def _arrive(counter_ptr, row, chunks):
    """Count this program in; True in the row's last program (after the others' writes)."""
    tl.debug_barrier()  # every thread's partial writes come before the release
    return tl.atomic_add(counter_ptr + row, 1, sem="acq_rel") == chunks - 1


@triton.jit
def _finish(packed, best_ptr, counter_ptr, out_ptr, row, chunks):
    """Fold the chunk's packed argmax into the row's; the row's last program writes the token."""
    tl.atomic_max(best_ptr + row, packed)
    if _arrive(counter_ptr, row, chunks):
        final = tl.atomic_max(best_ptr + row, 0)  # an atomic read of the row's maximum
        tl.store(out_ptr + row, 2147483647 - (final & 2147483647))


# --------------------------------------------------------------------------- stage: scan


@triton.jit
def _argmax_logits(logits_ptr, row, chunk, vocab, BLOCK: tl.constexpr, SUB: tl.constexpr):
    best = tl.full((SUB,), float("-inf"), tl.float32)
    index = tl.zeros((SUB,), tl.int32)
    for start in range(0, BLOCK, SUB):
        offsets = chunk * BLOCK + start + tl.arange(0, SUB)
        x = tl.load(logits_ptr + row.to(tl.int64) * vocab + offsets, mask=offsets < vocab, other=float("-inf"))
        best, index = _better(x, offsets, best, index)
    return _packed(best, index)


@triton.jit
def _argmax_noise(logits_ptr, seed_ptr, position_ptr, row, chunk, vocab, scale, keep_below,
                  A0, A1, A2, A3, A4, B0, B1, B2, B3, B4, BLOCK: tl.constexpr, SUB: tl.constexpr):
    """Gumbel-max over the chunk's kept tokens: z >= keep (a scalar; -inf keeps all)."""
    key_a, key_b = _row_keys(seed_ptr, position_ptr, row, A0, A1, A2, A3, A4, B0, B1, B2, B3, B4)
    best = tl.full((SUB,), float("-inf"), tl.float32)
    index = tl.zeros((SUB,), tl.int32)
    for start in range(0, BLOCK, SUB):
        offsets = chunk * BLOCK + start + tl.arange(0, SUB)
        z, valid = _z(logits_ptr, row, offsets, vocab, scale)
        score = tl.where(valid & (z >= keep_below), _noise_scores(z, offsets, key_a, key_b), float("-inf"))
        best, index = _better(score, offsets, best, index)
    return _packed(best, index)


@triton.jit
def _argmax_kept(logits_ptr, seed_ptr, position_ptr, kept_ptr, row, chunk, chunks, vocab, scale, keep_below,
                 A0, A1, A2, A3, A4, B0, B1, B2, B3, B4, BLOCK: tl.constexpr, SUB: tl.constexpr):
    """Gumbel-max over the chunk's tokens with z >= keep_below: the kept tokens (a truncated row's
    few percent) are listed first, in token order, and only they get the noise."""
    listing = kept_ptr + (row * chunks + chunk).to(tl.int64) * BLOCK  # this program's BLOCK slots
    count = tl.zeros((), tl.int32)
    for start in range(0, BLOCK, SUB):
        offsets = chunk * BLOCK + start + tl.arange(0, SUB)
        z, valid = _z(logits_ptr, row, offsets, vocab, scale)
        keep = (valid & (z >= keep_below)).to(tl.int32)
        tl.store(listing + count + tl.cumsum(keep, axis=0) - 1, offsets, mask=keep == 1)
        count += tl.sum(keep, axis=0)
    tl.debug_barrier()  # the list's writes (by any thread) before its reads (by any thread)
    key_a, key_b = _row_keys(seed_ptr, position_ptr, row, A0, A1, A2, A3, A4, B0, B1, B2, B3, B4)
    best = tl.full((SUB,), float("-inf"), tl.float32)
    index = tl.zeros((SUB,), tl.int32)
    for start in range(0, BLOCK, SUB):
        if start < count:
            slots = start + tl.arange(0, SUB)
            listed = slots < count
            offsets = tl.load(listing + slots, mask=listed, other=0)
            x = tl.load(logits_ptr + row.to(tl.int64) * vocab + offsets, mask=listed, other=float("-inf"))
            z = tl.math.div_rn(x, scale)
            score = tl.where(listed, _noise_scores(z, offsets, key_a, key_b), float("-inf"))
            best, index = _better(score, offsets, best, index)
    return _packed(best, index)


@triton.jit
def _max_and_digit(logits_ptr, hist_ptr, row, chunk, vocab, scale, top_k, BLOCK: tl.constexpr, SUB: tl.constexpr):
    """The chunk's max z; for top-k rows, its first-digit histogram added to the row's."""
    top = tl.full((SUB,), float("-inf"), tl.float32)
    counts = tl.zeros((256,), tl.int32)
    for start in range(0, BLOCK, SUB):
        offsets = chunk * BLOCK + start + tl.arange(0, SUB)
        z, valid = _z(logits_ptr, row, offsets, vocab, scale)
        top = tl.maximum(top, z)
        if top_k > 0:
            counts += tl.histogram((_key(z) >> 24).to(tl.int32), 256, mask=valid)
    if top_k > 0:
        tl.atomic_add(hist_ptr + row * 256 + tl.arange(0, 256), counts)
    return tl.max(top, axis=0)


@triton.jit
def _scan(logits_ptr, temperature_ptr, top_k_ptr, top_p_ptr, seed_ptr, position_ptr, pmax_ptr, hist_ptr, best_ptr,
          counter_ptr, state_ptr, out_ptr, vocab, rows, chunks, A0, A1, A2, A3, A4, B0, B1, B2, B3, B4,
          CHUNKS: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr):
    row, chunk = tl.program_id(0), tl.program_id(1)
    temperature = tl.load(temperature_ptr + row)
    top_k = tl.load(top_k_ptr + row)
    if temperature <= 0.0:
        packed = _argmax_logits(logits_ptr, row, chunk, vocab, BLOCK, SUB)
        _finish(packed, best_ptr, counter_ptr + FINAL_COUNTER * rows, out_ptr, row, chunks)
    elif (top_k <= 0) & (tl.load(top_p_ptr + row) >= 1.0):
        packed = _argmax_noise(logits_ptr, seed_ptr, position_ptr, row, chunk, vocab, temperature,
                               float("-inf"), A0, A1, A2, A3, A4, B0, B1, B2, B3, B4, BLOCK, SUB)
        _finish(packed, best_ptr, counter_ptr + FINAL_COUNTER * rows, out_ptr, row, chunks)
    else:
        top = _max_and_digit(logits_ptr, hist_ptr, row, chunk, vocab, temperature, top_k, BLOCK, SUB)
        tl.store(pmax_ptr + row * chunks + chunk, top)
        if _arrive(counter_ptr + SCAN_COUNTER * rows, row, chunks):
            c = tl.arange(0, CHUNKS)
            parts = tl.load(pmax_ptr + row * chunks + c, mask=c < chunks, other=float("-inf"), volatile=True)
            tl.store(state_ptr + row * 4 + TOP, tl.max(parts, axis=0))


# --------------------------------------------------------------------------- stage: the k-th largest z


@triton.jit
def _kth_prefix(hist_ptr, row, rows, k, digits: tl.constexpr):
    """The first ``digits`` 8-bit digits of the k-th largest key (and k left inside that prefix)."""
    prefix = tl.zeros((), tl.int64)
    remaining = k
    bins = tl.arange(0, 256)
    for d in tl.static_range(digits):
        # Reversed histogram: position i holds digit 255 - i; cumulative = keys with digit >= 255 - i.
        counts = tl.load(hist_ptr + (d * rows + row) * 256 + 255 - bins, volatile=True).to(tl.int64)
        cumulative = tl.cumsum(counts, axis=0)
        hit = cumulative >= remaining
        first = tl.min(tl.where(hit, bins, 256), axis=0)
        above = tl.sum(tl.where(bins < first, counts, 0), axis=0)
        remaining = remaining - above
        prefix = prefix * 256 + (255 - first)
    return prefix, remaining


@triton.jit
def _radix(logits_ptr, temperature_ptr, top_k_ptr, hist_ptr, counter_ptr, state_ptr, vocab, rows, chunks,
           DIGIT: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr):
    """Digit DIGIT (1..3) of the k-th largest key, among keys whose higher digits match; the last
    digit's last program leaves the k-th value."""
    row, chunk = tl.program_id(0), tl.program_id(1)
    k = tl.load(top_k_ptr + row)
    temperature = tl.load(temperature_ptr + row)
    if (k > 0) & (temperature > 0.0):
        prefix, _ = _kth_prefix(hist_ptr, row, rows, k, DIGIT)
        shift: tl.constexpr = 24 - 8 * DIGIT
        counts = tl.zeros((256,), tl.int32)
        for start in range(0, BLOCK, SUB):
            offsets = chunk * BLOCK + start + tl.arange(0, SUB)
            z, valid = _z(logits_ptr, row, offsets, vocab, temperature)
            key = _key(z)
            inside = valid & ((key >> (shift + 8)) == prefix)
            counts += tl.histogram(((key >> shift) & 255).to(tl.int32), 256, mask=inside)
        tl.atomic_add(hist_ptr + (DIGIT * rows + row) * 256 + tl.arange(0, 256), counts)
        if DIGIT == 3:
            if _arrive(counter_ptr + RADIX_COUNTER * rows, row, chunks):
                kth, _ = _kth_prefix(hist_ptr, row, rows, k, 4)
                tl.store(state_ptr + row * 4 + KTH, _unkey(kth))


# --------------------------------------------------------------------------- stage: top-p


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
def _walk(pmass_ptr, psum_ptr, state_ptr, top_p_ptr, candidates, row, chunks, PASS: tl.constexpr, CHUNKS: tl.constexpr):
    """The row's last program: sum the chunks' masses (fixed order) and take 4 bisection steps."""
    c = tl.arange(0, CHUNKS)
    lanes = tl.arange(0, 16)
    if PASS == 0:
        total = tl.sum(tl.load(psum_ptr + row * chunks + c, mask=c < chunks, other=0.0, volatile=True), axis=0)
        target = tl.load(top_p_ptr + row) * total
        tl.store(state_ptr + row * 4 + TARGET, target)
    else:
        target = tl.load(state_ptr + row * 4 + TARGET)
    parts = tl.load(pmass_ptr + (row * chunks + c[:, None]) * 16 + lanes[None, :], mask=(c < chunks)[:, None],
                    other=0.0, volatile=True)
    masses = tl.sum(parts, axis=0)  # [16]; lane 0 (the floor itself) unused
    # Monotone in the lane: the bisection takes the largest candidate whose mass reaches the target.
    best = tl.max(tl.where((masses >= target) & (lanes > 0), lanes, 0), axis=0)
    tl.store(state_ptr + row * 4 + FLOOR, tl.sum(tl.where(lanes == best, candidates, 0.0), axis=0))


@triton.jit
def _nucleus(logits_ptr, temperature_ptr, top_k_ptr, top_p_ptr, psum_ptr, pmass_ptr, deltas_ptr, counter_ptr,
             state_ptr, vocab, rows, chunks, span, PASS: tl.constexpr, CHUNKS: tl.constexpr, BLOCK: tl.constexpr,
             LANE_SUB: tl.constexpr):
    """Pass PASS of the top-p bisection: the mass of w above each of the next 15 candidate floors."""
    row, chunk = tl.program_id(0), tl.program_id(1)
    temperature = tl.load(temperature_ptr + row)
    if (tl.load(top_p_ptr + row) < 1.0) & (temperature > 0.0):
        top = tl.load(state_ptr + row * 4 + TOP)
        kth = tl.where(tl.load(top_k_ptr + row) > 0, tl.load(state_ptr + row * 4 + KTH), float("-inf"))
        if PASS == 0:
            floor = top - span
        else:
            floor = tl.load(state_ptr + row * 4 + FLOOR)
        candidates = _candidates(floor, 1 + 4 * PASS, deltas_ptr)
        acc = tl.zeros((LANE_SUB, 16), tl.float32)
        total = tl.zeros((LANE_SUB, 1), tl.float32)
        for start in range(0, BLOCK, LANE_SUB):
            # [LANE_SUB, 1] from the load on: z is made where the lanes use it (no layout shuffle per tile).
            offsets = chunk * BLOCK + start + tl.arange(0, LANE_SUB)[:, None]
            z, valid = _z(logits_ptr, row, offsets, vocab, temperature)
            w = tl.where(valid & (z >= kth), _exp(z - top), 0.0)
            acc += tl.where(z >= candidates[None, :], w, 0.0)
            if PASS == 0:
                total += w
        tl.store(pmass_ptr + (row * chunks + chunk) * 16 + tl.arange(0, 16), tl.sum(acc, axis=0))
        if PASS == 0:
            tl.store(psum_ptr + row * chunks + chunk, tl.sum(tl.sum(total, axis=1), axis=0))
        if _arrive(counter_ptr + (NUCLEUS_COUNTER + PASS) * rows, row, chunks):
            _walk(pmass_ptr, psum_ptr, state_ptr, top_p_ptr, candidates, row, chunks, PASS, CHUNKS)


# --------------------------------------------------------------------------- stage: the choice


@triton.jit
def _final(logits_ptr, temperature_ptr, top_k_ptr, top_p_ptr, seed_ptr, position_ptr, kept_ptr, best_ptr, counter_ptr,
           state_ptr, out_ptr, vocab, rows, chunks, A0, A1, A2, A3, A4, B0, B1, B2, B3, B4,
           BLOCK: tl.constexpr, SUB: tl.constexpr):
    """Gumbel-max over a truncated row's kept set: z >= max(k-th value, top-p floor)."""
    row, chunk = tl.program_id(0), tl.program_id(1)
    temperature = tl.load(temperature_ptr + row)
    top_k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    if (temperature > 0.0) & ((top_k > 0) | (top_p < 1.0)):
        keep = tl.full((), float("-inf"), tl.float32)
        if top_k > 0:
            keep = tl.load(state_ptr + row * 4 + KTH)
        if top_p < 1.0:
            keep = tl.maximum(keep, tl.load(state_ptr + row * 4 + FLOOR))
        packed = _argmax_kept(logits_ptr, seed_ptr, position_ptr, kept_ptr, row, chunk, chunks, vocab, temperature,
                              keep, A0, A1, A2, A3, A4, B0, B1, B2, B3, B4, BLOCK, SUB)
        _finish(packed, best_ptr, counter_ptr + FINAL_COUNTER * rows, out_ptr, row, chunks)


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
    with the caching allocator (one zeroed workspace: one memset) and never syncs the host, so it
    can be captured in a CUDA graph."""
    rows, vocab = logits.shape
    logits = logits.float().contiguous()
    temperature, top_k, top_p, seed, position = (t.contiguous() for t in (temperature, top_k, top_p, seed, position))
    chunks = triton.cdiv(vocab, BLOCK)
    block_chunks = triton.next_power_of_2(chunks)
    device = logits.device
    span, deltas = _bisection_steps(vocab, device)
    # Zeroed int32 workspace: digit histograms [4, R, 256], arrival counters [COUNTERS, R], argmax [R] int64.
    work = torch.zeros(4 * rows * 256 + COUNTERS * rows + 2 * rows, dtype=torch.int32, device=device)
    hist = work[: 4 * rows * 256]
    counters = work[4 * rows * 256 : 4 * rows * 256 + COUNTERS * rows]
    best = work[4 * rows * 256 + COUNTERS * rows :].view(torch.int64)
    floats = torch.empty(rows * (STATE + 2 * chunks + 16 * chunks), device=device)
    state, pmax, psum, pmass = floats.split([rows * STATE, rows * chunks, rows * chunks, rows * chunks * 16])
    out = torch.empty(rows, dtype=torch.int64, device=device)
    grid = (rows, chunks)
    keys = (*LANE_A, *LANE_B)
    _scan[grid](logits, temperature, top_k, top_p, seed, position, pmax, hist, best, counters, state, out,
                vocab, rows, chunks, *keys, CHUNKS=block_chunks, BLOCK=BLOCK, SUB=SUB, num_warps=NUM_WARPS)
    for digit in (1, 2, 3):
        _radix[grid](logits, temperature, top_k, hist, counters, state, vocab, rows, chunks,
                     DIGIT=digit, BLOCK=BLOCK, SUB=SUB, num_warps=NUM_WARPS)
    for p in range(PASSES):
        _nucleus[grid](logits, temperature, top_k, top_p, psum, pmass, deltas, counters, state, vocab, rows, chunks,
                       span, PASS=p, CHUNKS=block_chunks, BLOCK=BLOCK, LANE_SUB=LANE_SUB, num_warps=NUM_WARPS)
    kept = torch.empty(rows * chunks * BLOCK, dtype=torch.int32, device=device)  # each program's list of kept tokens
    _final[grid](logits, temperature, top_k, top_p, seed, position, kept, best, counters, state, out, vocab, rows, chunks,
                 *keys, BLOCK=BLOCK, SUB=SUB, num_warps=NUM_WARPS)
    return out


# The kernels spell these constants out (Triton inlines literals); keep them the definition's.
assert TOKEN_MULTIPLIER == 1103515245 and PRIME == 2147483579 and 2.0**-31 == 4.656612873077393e-10
assert PRIME == 2**31 - 69  # _mulmod's reduction


@functools.cache
def register_cuda_choose() -> None:
    """Make ``choose_cuda`` the CUDA kernel of ``torch.ops.dflash_trt.choose`` (the torch backend's
    token choice on CUDA). Idempotent: the first call registers, later calls do nothing."""
    sampling.choose_op.register_kernel("cuda")(choose_cuda)
