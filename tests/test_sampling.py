"""Sampling math and the losslessness of DFlash sampling, against brute force."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

import tiny_models
from dflash_trt.export.pair import load_pair
from dflash_trt.export.reference import ReferenceDecoder
from dflash_trt.export.sampling import Sampling, filtered_probs, positional_uniform, sample, verdict


def brute_force_probs(logits: list[float], temperature: float, top_k: int, top_p: float) -> list[float]:
    """Plain-Python filtering: temperature, then top-k, then top-p over the top-k renormalized mass."""
    if temperature == 0:
        best = max(range(len(logits)), key=lambda i: (logits[i], -i))
        return [1.0 if i == best else 0.0 for i in range(len(logits))]
    order = sorted(range(len(logits)), key=lambda i: (-logits[i], i))
    kept = order[: top_k or len(order)]
    weights = {i: math.exp(logits[i] / temperature - logits[kept[0]] / temperature) for i in kept}
    total = sum(weights.values())
    mass, nucleus = 0.0, []
    for i in kept:
        if mass < top_p:
            nucleus.append(i)
        mass += weights[i] / total
    norm = sum(weights[i] for i in nucleus)
    return [weights[i] / norm if i in nucleus else 0.0 for i in range(len(logits))]


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.6, 3, 1.0), (1.4, 0, 0.5), (0.9, 4, 0.8)])
def test_filtered_probs_match_brute_force(temperature, top_k, top_p):
    """Guards against wrong filter order or off-by-one nucleus cut-offs in the vectorized filter."""
    logits = torch.randn(6, 11, generator=torch.Generator().manual_seed(4)) * 2
    rows = logits.shape[0]
    probs = filtered_probs(
        logits, torch.full((rows,), temperature), torch.full((rows,), top_k), torch.full((rows,), top_p)
    )
    expected = [brute_force_probs(row.tolist(), temperature, top_k, top_p) for row in logits]
    torch.testing.assert_close(probs, torch.tensor(expected), rtol=1e-5, atol=1e-6)


def test_inverse_cdf_sample_follows_the_distribution():
    """Guards against an inverse CDF that is biased at bin edges or can pick a zero-probability token."""
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.5, 0.25, 0.0]])
    uniforms = torch.linspace(0, 1, 4001)[:-1]
    tokens = sample(probs.expand(len(uniforms), -1), uniforms)
    counts = torch.bincount(tokens, minlength=6).float() / len(uniforms)
    torch.testing.assert_close(counts, probs[0], atol=1e-3, rtol=0)


def test_positional_uniform_is_a_pure_function_of_seed_and_position():
    """Guards against uniforms that depend on call order or batch shape (batch-dependent sampling)."""
    whole = positional_uniform(42, np.arange(100))
    pieces = np.concatenate([positional_uniform(42, [p]) for p in range(100)])
    assert np.array_equal(whole, pieces)
    assert not np.array_equal(whole, positional_uniform(43, np.arange(100)))
    assert ((whole >= 0) & (whole < 1)).all()
    assert abs(float(whole.mean()) - 0.5) < 0.1


def test_verdict_takes_the_longest_matching_prefix():
    """Guards against counting matches after the first mismatch, or the wrong correction/bonus token."""
    proposals = torch.tensor([[5, 6, 7], [5, 6, 7], [5, 6, 7], [1, 6, 7]])
    choices = torch.tensor([[5, 6, 7, 8], [5, 9, 7, 8], [5, 6, 3, 8], [5, 6, 7, 8]])
    accepted, token = verdict(proposals, choices)
    assert accepted.tolist() == [3, 1, 2, 0]
    assert token.tolist() == [8, 9, 3, 5]


def _chi_square_threshold(df: int, z: float = 3.09) -> float:
    """Upper quantile (z = 3.09: significance 0.001) by the Wilson–Hilferty approximation."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("sampling", [Sampling(1.0), Sampling(0.8, top_k=3), Sampling(1.5, top_p=0.8)])
def test_dflash_sampling_is_lossless_in_distribution(tmp_path_factory, sampling):
    """Guards against a verifier that biases emitted tokens (e.g. reusing one uniform for several
    positions or accepting by draft confidence): the joint distribution of the first two emitted
    tokens over 600 seeds matches the target's exact filtered distribution (chi-square, 0.1%)."""
    root = tmp_path_factory.mktemp("vocab8")
    target_dir = tiny_models.write_target(root / "t", vocab_size=8, std=0.25)
    target, draft = load_pair(target_dir, tiny_models.write_draft(root / "d", target_dir, block_size=4))
    decoder, prompt = ReferenceDecoder(target, draft), [3, 1, 4]
    exact = _exact_two_token_distribution(decoder, prompt, sampling)
    counts = np.zeros((8, 8))
    for seed in range(600):
        first, second = decoder.generate_dflash(prompt, 2, Sampling(**{**sampling.__dict__, "seed": seed})).tokens
        counts[first, second] += 1
    expected = exact * counts.sum()
    cells = expected > 0
    assert cells.sum() >= 4, "the test needs a spread-out distribution to have power"
    assert counts[~cells].sum() == 0, "a token outside the filtered support was emitted"
    statistic = float(((counts[cells] - expected[cells]) ** 2 / expected[cells]).sum())
    assert statistic < _chi_square_threshold(int(cells.sum()) - 1)


@torch.no_grad()
def _exact_two_token_distribution(decoder, prompt, sampling) -> np.ndarray:
    """P(x1, x2 | prompt) from the target's logits, filtered by brute force."""
    def next_probs(tokens):
        cache = decoder.target.new_cache(1, 16)
        logits, _ = decoder.target(torch.tensor([tokens]), torch.tensor([0]), torch.tensor([0]), *cache)
        return brute_force_probs(logits[0, -1].tolist(), sampling.temperature, sampling.top_k, sampling.top_p)

    first = next_probs(prompt)
    table = np.zeros((8, 8))
    for a, b in itertools.product(range(8), range(8)):
        if first[a] > 0:
            table[a, b] = first[a] * next_probs(prompt + [a])[b]
    return table
