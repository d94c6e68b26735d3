"""A session's sampling parameters as one value, and their one check: plain Python, no torch.

``export.sampling`` holds the definition these parameters feed (``choose``, the noise, the verdict);
this module is what a request's path needs before any tensor exists — the HTTP schema, the fronts'
pipe messages, ``Executor.set_sampling``'s check — so an HTTP front process parses and checks requests
without importing torch (~200 MB and ~1 s per front).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dflash_trt.checks import is_int
from dflash_trt.errors import SamplingError

SEED_PARTS = 3  # the 64-bit seed as three parts of < 2**22 (low first): each below export.sampling's PRIME
SEED_PART_BITS = 22
TOP_K_LIMIT = 3840  # TensorRT's TopK caps K at 3840


@dataclass(frozen=True)
class Sampling:
    """One session's sampling parameters; the default is greedy decoding.

    The one value that carries them from a request (the HTTP schema, ``generate``) to the session
    (``Executor.set_sampling``); ``Sampling.checked`` is their one check.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    @classmethod
    def checked(cls, temperature=0.0, top_k=0, top_p=1.0, seed=0, vocab_size: int | None = None) -> Sampling:
        """The parameters as a Sampling of plain Python values, or a ``SamplingError`` naming the field, the
        valid range and the value (``check_sampling``, ``check_seed``)."""
        temperature, top_k, top_p = check_sampling(temperature, top_k, top_p, vocab_size)
        return cls(temperature, top_k, top_p, check_seed(seed))

    def check(self, vocab_size: int | None = None) -> Sampling:
        """This value, checked (``Sampling.checked`` of its fields): a plain copy."""
        return Sampling.checked(self.temperature, self.top_k, self.top_p, self.seed, vocab_size)


GREEDY = Sampling()


# What the verifier graphs can represent: sampling parameters are float32 feeds.
FLOAT32_MAX = float(np.finfo(np.float32).max)
FLOAT32_TINY = float(np.finfo(np.float32).tiny)  # smallest normal: below it a GPU may flush to 0
# Below this, logits / temperature leave any sane range (and NaN-prone softmax follows);
# a caller who wants near-greedy output should ask for greedy (0).
MIN_TEMPERATURE = 1e-6


def seed_parts(seed: int) -> tuple[int, int, int]:
    """A seed in [0, 2**64) -> three parts of 22, 22 and 20 bits, low first (each < 2**22 < PRIME)."""
    mask = (1 << SEED_PART_BITS) - 1
    return seed & mask, (seed >> SEED_PART_BITS) & mask, seed >> (2 * SEED_PART_BITS)


def top_k_limit(vocab_size: int) -> int:
    """The largest top_k a vocabulary allows: min(3840, V)."""
    return min(TOP_K_LIMIT, vocab_size)


def _real(value) -> bool:
    """A plain or numpy real number; bools (Python or numpy) are not numbers here."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


SEED_LIMIT = 1 << 64  # seeds are 64-bit


def check_seed(seed) -> int:
    """A seed of the sampling noise: an int in [0, 2**64 - 1] (numpy ints too, not a bool)."""
    if not is_int(seed, numpy=True) or not 0 <= int(seed) < SEED_LIMIT:
        msg = f"seed must be an int in [0, 2**64 - 1], got {seed!r}"
        raise SamplingError(msg, param="seed")
    return int(seed)


def check_sampling(temperature: float, top_k: int, top_p: float, vocab_size: int | None = None) -> tuple[float, int, float]:
    """Refuse sampling parameters the verifier cannot represent, naming the field, range and value.

    Returns them as plain Python (float, int, float). Numpy scalars are accepted
    like Python numbers; bools are refused everywhere.
    """
    if not _real(temperature) or not math.isfinite(temperature):
        raise SamplingError(f"temperature must be a finite real number (not a bool), got {temperature!r}", param="temperature")
    if temperature != 0 and not MIN_TEMPERATURE <= temperature <= FLOAT32_MAX:
        msg = f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, {FLOAT32_MAX}] (float32), got {temperature!r}"
        raise SamplingError(msg, param="temperature")
    if not is_int(top_k, numpy=True) or top_k < 0:
        raise SamplingError(f"top_k must be an int >= 0 (0 = off; not a bool), got {top_k!r}", param="top_k")
    limit = TOP_K_LIMIT if vocab_size is None else top_k_limit(vocab_size)
    if top_k > limit:
        why = f"min({TOP_K_LIMIT}, vocabulary {vocab_size})" if vocab_size is not None else "TensorRT's TopK limit"
        raise SamplingError(f"top_k must be in [0, {limit}] (0 = off; at most {why}), got {top_k}", param="top_k")
    if not _real(top_p) or not math.isfinite(top_p) or not FLOAT32_TINY <= top_p <= 1:
        raise SamplingError(f"top_p must be a real number in [{FLOAT32_TINY}, 1] (float32 normal, > 0), got {top_p!r}", param="top_p")
    return float(temperature), int(top_k), float(top_p)
