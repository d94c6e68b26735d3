"""Sampling and verification math: one definition of the target's token choice, small pure functions over tensors.

``choose(logits, temperature, top_k, top_p, seed, position)`` is THE token
choice: the reference decoder calls it, the exported ``sample`` and
``verify_sample_{n}`` graphs are traced from it, and the runtime runs those
graphs for every choice (after a prompt or replay and in every cycle), so no
path can disagree with another.

Per row (logits [V] fp32; the token chosen sits AT ``position``):

- ``temperature == 0``: argmax of the logits, first index on ties.
- Otherwise ``z = logits / temperature`` and the token is the Gumbel-max
  ``argmax over kept tokens of z + g(seed, position, token)``, which is a
  sample of softmax(z) restricted to the kept set (renormalized). No sort,
  no cumulative sum, no uniform compared against a CDF: a decision changes
  only when two perturbed scores are equal to within float rounding.
- Kept set (temperature, then top-k, then top-p, as Hugging Face orders them):
  ``top_k > 0`` keeps ``z >= v_k``, the k-th largest z (``TopK``; ties at
  v_k are kept, as HF does); ``top_p < 1`` then keeps ``z >= c``, with ``c``
  found by ``TOP_P_STEPS`` bisection steps on a threshold in z (see
  ``nucleus_floor``). ``top_k == 0`` and ``top_p >= 1`` are off: every token
  is kept.

The noise ``g`` is a pure function of (seed, position, token), computed
bit-exactly by every backend: an integer hash in int64 multiply/add/mod with
every intermediate below 2**62 (no overflow, no bitwise operations), then
``u = (h + 0.5) / 2**31`` strictly inside (0, 1) and
``g = -log(-log1p(-u))``. A session's output therefore never depends on how
it was batched, and DFlash's sampled output is token-for-token the
target-only sampled output for the same seed.

``verdict``: accepting a one-hot draft token d by testing ``d == y`` with
``y`` an independent target sample is exactly rejection sampling with a
one-hot proposal (accept w.p. p(d); on reject ``y`` follows p without d,
renormalized), hence lossless.
"""

from __future__ import annotations

import math

import torch

# The parameters' value and their one check live where no torch is imported (an HTTP front parses requests
# without loading it); re-exported here beside the math they feed.
from dflash_trt.export.sampling_params import (  # noqa: F401
    FLOAT32_MAX,
    FLOAT32_TINY,
    GREEDY,
    MIN_TEMPERATURE,
    SEED_LIMIT,
    SEED_PART_BITS,
    SEED_PARTS,
    TOP_K_LIMIT,
    Sampling,
    check_sampling,
    check_seed,
    seed_parts,
    top_k_limit,
)

# The hash works modulo PRIME = 2**31 - 69: a product of two residues is < 2**62 and every
# intermediate fits int64 with room to spare. PRIME ≡ 2 (mod 3), so cubing permutes the residues.
PRIME = 2147483579
TOKEN_MULTIPLIER = 1103515245
# Round constants of the two 31-bit key lanes (initial value, then one per absorbed value).
LANE_A = (1640531527, 1013904223, 1664525, 2147001325, 747796405)
LANE_B = (744372876, 1181783497, 982451653, 1500450271, 1119516434)
U_SCALE = 2.0**-31  # u = (h + 0.5) * 2**-31; h <= PRIME - 1 keeps u < 1 after float32 rounding

TOP_P_STEPS = 20  # bisection steps of the top-p threshold (bracket width: span / 2**20)


def sampling_tensors(sampling: Sampling, rows: int, device=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(temperature [rows] f32, top_k [rows] i64, top_p [rows] f32, seed [rows, 3] i64): ``choose``'s row inputs
    for one ``Sampling``."""
    return (
        torch.full((rows,), float(sampling.temperature), dtype=torch.float32, device=device),
        torch.full((rows,), int(sampling.top_k), dtype=torch.int64, device=device),
        torch.full((rows,), float(sampling.top_p), dtype=torch.float32, device=device),
        torch.tensor([seed_parts(sampling.seed)] * rows, dtype=torch.int64, device=device).reshape(rows, SEED_PARTS),
    )


# --------------------------------------------------------------------------- primitives


class TorchPrimitives:
    """The few primitives the sampling math needs beyond Python operators, in eager PyTorch.

    ``export.onnx_kernels.OnnxOps`` has the same methods as ONNX nodes: the
    math below is written once over ``ops`` and both run it, the eager module
    and the exported graphs (``torch.ops.dflash_trt.choose``'s translation).
    Comparisons and arithmetic use Python operators, which both tensor kinds
    implement with the same ONNX semantics.
    """

    column = staticmethod(lambda x, i: x[:, i : i + 1])  # [R, k] -> [R, 1]
    as_column = staticmethod(lambda x: x[:, None])  # [R] -> [R, 1]
    tokens = staticmethod(lambda like, vocab: torch.arange(vocab, dtype=torch.int64, device=like.device)[None, :])
    to_float = staticmethod(lambda x: x.to(torch.float32))
    log = staticmethod(torch.log)
    exp = staticmethod(torch.exp)
    equal = staticmethod(torch.eq)
    where = staticmethod(torch.where)
    either = staticmethod(torch.logical_or)
    both = staticmethod(torch.logical_and)
    row_sum = staticmethod(lambda x: x.sum(dim=-1, keepdim=True))  # [R, V] -> [R, 1]
    top_values = staticmethod(lambda x, k: torch.topk(x, k, dim=-1).values)  # [R, V] -> [R, k] descending
    pick = staticmethod(lambda x, index: torch.gather(x, 1, index))  # [R, K], [R, 1] -> [R, 1]
    clamp = staticmethod(lambda x, low, high: x.clamp(low, high))
    argmax = staticmethod(lambda x: x.argmax(dim=-1))  # [R, V] -> [R], first index on ties


TORCH = TorchPrimitives()


# --------------------------------------------------------------------------- the noise


def _mulmod(a, b):
    return a * b % PRIME  # a, b < PRIME < 2**31: the product < 2**62


def _addmod(a, b, ops):
    total = a + b  # a, b < PRIME: one subtraction reduces it (cheaper than a Mod over [R, V])
    return ops.where(total >= PRIME, total - PRIME, total)


def _cube(x):
    return _mulmod(_mulmod(x, x), x)


def row_keys(seed, position, ops=TORCH):
    """seed [R, 3] (parts < 2**22), position [R, 1] (< 2**31) -> two 31-bit keys [R, 1] per row.

    Each lane absorbs the seed parts and the position: ``x = (x + value + c)^3 mod PRIME``.
    """
    values = (ops.column(seed, 0), ops.column(seed, 1), ops.column(seed, 2), position)
    keys = []
    for constants in (LANE_A, LANE_B):
        x = values[0] * 0 + constants[0]
        for value, constant in zip(values, constants[1:]):
            x = _cube((x + value + constant) % PRIME)
        keys.append(x)
    return keys[0], keys[1]


def token_hash(key_a, key_b, vocab: int, ops=TORCH):
    """Keys [R, 1] -> h [R, V] int64 in [0, PRIME): ``(((A t + a)^3 + b) mod p)^3 mod p`` of each token t.

    Four Mods per (row, token): ``A t mod p`` is per token only, the two additions reduce by a subtraction.
    """
    spread = ops.tokens(key_a, vocab) * TOKEN_MULTIPLIER % PRIME  # [1, V]
    x = _cube(_addmod(spread, key_a, ops))
    return _cube(_addmod(x, key_b, ops))


def gumbel(h, ops=TORCH):
    """h [R, V] in [0, PRIME) -> Gumbel noise [R, V] fp32: g = -log(E), E = -log1p(-u) ~ Exp(1).

    u = (h + 0.5) * 2**-31 lies in (0, 1) (h < 2**31 - 64 keeps float32 rounding below 1)
    with 2**-31 resolution near 0, where E is small and g large. ``log1p`` in
    Kahan's form (log(w) * u / (w - 1), w = 1 - u) keeps that resolution;
    ONNX has no Log1p.
    """
    u = (ops.to_float(h) + 0.5) * U_SCALE
    w = 1.0 - u
    exponential = ops.where(ops.equal(w, 1.0), u, u * ops.log(w) / (w - 1.0))
    return -ops.log(exponential)


def noise(seed, position, vocab: int, ops=TORCH):
    """seed [R, 3], position [R, 1] -> Gumbel noise g(seed, position, token) [R, V] fp32."""
    key_a, key_b = row_keys(seed, position, ops)
    return gumbel(token_hash(key_a, key_b, vocab, ops), ops)


# --------------------------------------------------------------------------- the kept set


def top_p_span(vocab: int) -> float:
    """How far below the max z the top-p threshold can lie, for any top_p < 1 in float32.

    Tokens below the threshold hold >= (1 - top_p) >= 2**-24 of the mass, each
    at most exp(c - m) of the max token's: c >= m - log(V * 2**24). One more
    for rounding.
    """
    return math.log(vocab) + 24 * math.log(2.0) + 1.0


def nucleus_floor(z, weights, top, top_p, vocab: int, ops=TORCH):
    """z [R, V], weights [R, V] = exp(z - top) on the top-k set (else 0), top [R, 1] = max z,
    top_p [R, 1] -> floor [R, 1].

    Bisection on the threshold: ``floor`` starts at ``top - span`` and steps
    up by span/2, span/4, ... (exact powers of two times span) whenever the
    mass with z >= floor + step is still >= top_p of the total. Invariant: the
    mass with z >= floor is >= top_p * total. After TOP_P_STEPS steps the kept
    set ``z >= floor`` is the smallest set of the form {z >= c} holding top_p of
    the mass (HF's nucleus, ties kept together), plus any tokens within
    span * 2**-20 below its cut (3e-5 for V = 151,936: near-ties). Each step is
    one masked sum (no sort, no cumulative sum); a step's decision can differ
    between backends only when that mass equals top_p * total to within float
    rounding.
    """
    span = top_p_span(vocab)
    target = top_p * ops.row_sum(weights)
    floor = top - span
    for step in range(1, TOP_P_STEPS + 1):
        mid = floor + span * 2.0**-step
        mass = ops.row_sum(ops.where(z >= mid, weights, 0.0))
        floor = ops.where(mass >= target, mid, floor)
    return floor


def kept(z, top_k, top_p, vocab: int, ops=TORCH):
    """z [R, V], top_k [R, 1], top_p [R, 1] -> bool [R, V]: the tokens top-k (k-th largest
    value, ties kept) then top-p keep."""
    limit = top_k_limit(vocab)
    values = ops.top_values(z, limit)  # [R, K] descending
    keep = ops.either(z >= ops.pick(values, ops.clamp(top_k - 1, 0, limit - 1)), top_k <= 0)
    top = ops.column(values, 0)
    weights = ops.where(keep, ops.exp(z - top), 0.0)
    floor = nucleus_floor(z, weights, top, top_p, vocab, ops)
    return ops.both(keep, ops.either(z >= floor, top_p >= 1.0))


# --------------------------------------------------------------------------- the choice


def choose(logits, temperature, top_k, top_p, seed, position, ops=TORCH):
    """The target's token for each row of logits [R, V] fp32 -> [R] int64.

    temperature [R] f32 (0 = greedy), top_k [R] i64 (0 = off, <= min(3840, V)),
    top_p [R] f32 (>= 1 = off), seed [R, 3] i64 (``seed_parts``), position [R]
    i64: the position of the token being chosen (< PRIME).
    """
    vocab = int(logits.shape[-1])
    temperature, top_k, top_p = ops.as_column(temperature), ops.as_column(top_k), ops.as_column(top_p)
    greedy = temperature <= 0.0
    z = logits / ops.where(greedy, 1.0, temperature)
    g = noise(seed, ops.as_column(position), vocab, ops)
    score = ops.where(kept(z, top_k, top_p, vocab, ops), z + g, float("-inf"))
    return ops.argmax(ops.where(greedy, logits, score))


@torch.library.custom_op("dflash_trt::choose", mutates_args=())
def choose_op(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seed: torch.Tensor,
    position: torch.Tensor,
) -> torch.Tensor:
    """``choose`` as one operator: the graph modules call it, so an exported graph holds it as
    one node, lowered by ``onnx_kernels.TRANSLATIONS`` through the same math over ONNX ops
    (a traced copy of the math would cost ~20 s of export per graph)."""
    return choose(logits, temperature, top_k, top_p, seed, position)


@choose_op.register_fake
def _(logits, temperature, top_k, top_p, seed, position):
    return logits.new_empty((logits.shape[0],), dtype=torch.int64)


def verdict(proposals: torch.Tensor, choices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """proposals [n, P], target choices [n, P+1] -> (accepted [n], next token [n]).

    accepted = longest prefix with proposals[:, i] == choices[:, i]; the
    emitted tokens are choices[:, :accepted+1] (the last is the correction,
    or the bonus when accepted == P).
    """
    # Count the leading positions with no mismatch so far (cumsum, not cumprod:
    # ONNX has no CumProd, and this is the exported verifiers' math too).
    mismatches = (proposals != choices[:, :-1]).to(torch.int64)
    accepted = (torch.cumsum(mismatches, dim=1) == 0).to(torch.int64).sum(dim=1)
    return accepted, torch.gather(choices, 1, accepted[:, None])[:, 0]
