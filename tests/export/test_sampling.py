"""The one sampling definition (``export.sampling.choose``) against an independent reference and brute force.

Three implementations of the same function meet on identical logits: the
exported ``sample`` graph in ONNX Runtime, the PyTorch module, and
``reference_choose`` below (numpy, with the hash recomputed in Python ints).
Their draws must agree on every one of >= 100,000 rows, and the draws must
follow the truncated softmax a brute-force, sorted, float64 filter computes.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import onnxruntime as ort
import pytest
import torch

import tiny_models
from dflash_trt.errors import SamplingError
from dflash_trt.export import contract, sampling
from dflash_trt.export.exporter import export_graph
from dflash_trt.export.graph_modules import Sample
from dflash_trt.export.pair import load_pair
from dflash_trt.export.reference import ReferenceDecoder
from dflash_trt.export.sampling import Sampling, check_sampling, choose, seed_parts, verdict

TEMPERATURES = (0.3, 1.0, 1.5)
TOP_KS = (0, 50, 3840)  # clipped to the vocabulary (top_k <= min(3840, V))
TOP_PS = (0.5, 0.9, 1.0)
COMBOS = list(itertools.product(TEMPERATURES, TOP_KS, TOP_PS))
# Rows per (temperature, top_k, top_p) combination (27 of them, plus greedy): 28 * (3600 + 8 + 1) = 101,052 draws.
ROWS = {97: 3600, 8192: 8, 151936: 1}


# --------------------------------------------------------------------------- the reference


def reference_noise(seed: np.ndarray, position: np.ndarray, vocab: int) -> np.ndarray:
    """seed [R, 3], position [R] -> Gumbel noise [R, V] float32, the hash in numpy int64."""
    p = sampling.PRIME

    def cube(x):
        return x * x % p * x % p

    values = (seed[:, 0:1], seed[:, 1:2], seed[:, 2:3], position[:, None])
    keys = []
    for lane in (sampling.LANE_A, sampling.LANE_B):
        x = np.full((len(seed), 1), lane[0], np.int64)
        for value, constant in zip(values, lane[1:]):
            x = cube((x + value + constant) % p)
        keys.append(x)
    tokens = np.arange(vocab, dtype=np.int64)[None, :]
    h = cube((cube((tokens * sampling.TOKEN_MULTIPLIER + keys[0]) % p) + keys[1]) % p)
    u = (h.astype(np.float32) + np.float32(0.5)) * np.float32(2.0**-31)
    w = np.float32(1.0) - u
    with np.errstate(divide="ignore", invalid="ignore"):
        exponential = np.where(w == 1, u, u * np.log(w) / (w - np.float32(1.0)))
    return -np.log(exponential)


def reference_choose(logits, temperature, top_k, top_p, seed, position) -> np.ndarray:
    """numpy float32: the definition in the export.sampling docstring, with a sort for the k-th value."""
    rows, vocab = logits.shape
    greedy = temperature <= 0
    z = logits / np.where(greedy, np.float32(1.0), temperature)[:, None]
    ordered = -np.sort(-z, axis=1)
    kth = ordered[np.arange(rows), np.clip(top_k - 1, 0, min(vocab, sampling.TOP_K_LIMIT) - 1)][:, None]
    keep = (z >= kth) | (top_k <= 0)[:, None]
    top = ordered[:, :1]
    weights = np.where(keep, np.exp(z - top), np.float32(0.0))
    target = top_p[:, None] * weights.sum(axis=1, keepdims=True, dtype=np.float32)
    span = np.float32(sampling.top_p_span(vocab))
    floor = top - span
    for step in range(1, sampling.TOP_P_STEPS + 1):
        mid = floor + span * np.float32(2.0**-step)
        mass = np.where(z >= mid, weights, np.float32(0.0)).sum(axis=1, keepdims=True, dtype=np.float32)
        floor = np.where(mass >= target, mid, floor)
    keep &= (z >= floor) | (top_p >= 1)[:, None]
    score = np.where(keep, z + reference_noise(seed, position, vocab), -np.inf)
    return np.where(greedy[:, None], logits, score).argmax(axis=1)


def brute_force_probs(logits: list[float], temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """float64, sorted: HF's order (temperature, top-k, top-p over the top-k renormalized mass)."""
    z = np.asarray(logits, np.float64) / temperature
    order = np.argsort(-z, kind="stable")
    kept = order[: top_k or len(z)]
    weights = np.exp(z[kept] - z[kept[0]])
    above = np.cumsum(weights) - weights  # mass strictly before each token in sorted order
    nucleus = kept[above < top_p * weights.sum()] if top_p < 1 else kept
    probs = np.zeros(len(z))
    probs[nucleus] = np.exp(z[nucleus] - z[kept[0]])
    return probs / probs.sum()


# --------------------------------------------------------------------------- draws


def draws(vocab: int) -> dict[str, np.ndarray]:
    """The sample graph's feeds: every combination, ROWS[vocab] rows each.

    At V = 97 each combination repeats ONE logits row at consecutive positions
    (i.i.d. draws of one distribution, for the chi-square test); larger
    vocabularies give every row its own logits. Plus greedy rows.
    """
    rng = np.random.default_rng(vocab)
    per = ROWS[vocab]
    combos = COMBOS + [(0.0, 0, 1.0)]
    if vocab == 97:
        logits = np.repeat((2.5 * rng.standard_normal((len(combos), vocab))).astype(np.float32), per, axis=0)
    else:
        logits = (2.5 * rng.standard_normal((len(combos) * per, vocab))).astype(np.float32)
    seeds = rng.integers(0, 2**63, len(combos), dtype=np.int64).astype(np.uint64) * np.uint64(2) + np.uint64(1)
    return {
        contract.LOGITS: logits,
        contract.TEMPERATURE: np.repeat(np.array([t for t, _, _ in combos], np.float32), per),
        contract.TOP_K: np.repeat(np.array([min(k, vocab) for _, k, _ in combos], np.int64), per),
        contract.TOP_P: np.repeat(np.array([p for _, _, p in combos], np.float32), per),
        contract.SEED: np.repeat(np.array([seed_parts(int(s)) for s in seeds], np.int64), per, axis=0),
        contract.POSITION: np.tile(np.arange(per, dtype=np.int64) * 7 + 3, len(combos)),
    }


def sampling_dims(vocab: int) -> contract.Dims:
    """Contract dims whose only fact that matters here is the vocabulary (the sample graph's V)."""
    return contract.Dims(
        vocab_size=vocab, tap_width=8, block_size=4, proposals=3, max_owners=1, max_context=64, max_chunk=8,
        target_layers=1, target_kv_heads=1, target_head_dim=8, draft_layers=1, draft_kv_heads=1, draft_head_dim=8,
        dtype="float32",
    )


def session(path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def sample_graph(directory, vocab: int) -> ort.InferenceSession:
    """The contract's ``sample`` graph exported for a vocabulary of ``vocab``, in ONNX Runtime."""
    graph = export_graph(Sample(), contract.graph_spec(sampling_dims(vocab), contract.SAMPLE), directory)
    return session(directory / graph.file)


NAMES = (contract.LOGITS, contract.TEMPERATURE, contract.TOP_K, contract.TOP_P, contract.SEED, contract.POSITION)


@pytest.fixture(scope="module")
def three_ways(tmp_path_factory, exported_pair):
    """{V: (feeds, ONNX Runtime tokens, torch tokens, reference tokens)} for V in ROWS.

    V = 97 runs the tiny pair's exported ``sample`` graph; the others are exported here.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    results = {}
    for vocab in ROWS:
        feeds = draws(vocab)
        if vocab == exported_pair.manifest.vocab_size:
            graph = session(exported_pair.out / exported_pair.manifest.graphs[contract.SAMPLE].file)
        else:
            graph = sample_graph(tmp_path_factory.mktemp(f"sample{vocab}"), vocab)
        onnx_tokens = graph.run(None, feeds)[0]
        with torch.no_grad():
            torch_tokens = choose(*(torch.from_numpy(feeds[name]) for name in NAMES)).numpy()
        results[vocab] = feeds, onnx_tokens, torch_tokens, reference_choose(*(feeds[name] for name in NAMES))
    torch.set_num_threads(previous)
    return results


# --------------------------------------------------------------------------- tests


def test_onnx_runtime_torch_and_reference_agree_on_every_draw(three_ways):
    """Guards against backends or code paths that choose different tokens on identical logits (the
    old inverse CDF over an fp32 cumulative sum flipped 0.44% of draws between ONNX Runtime and
    torch; top_p = 1 dropped tokens in one and not the other): >= 100,000 draws over T in
    {0.3, 1, 1.5} (and 0), top_k in {0, 50, 3840}, top_p in {0.5, 0.9, 1}, V in {97, 8192, 151936}
    must be identical in all three."""
    total = 0
    for vocab, (feeds, onnx_tokens, torch_tokens, reference) in three_ways.items():
        assert np.array_equal(onnx_tokens, torch_tokens), (vocab, np.flatnonzero(onnx_tokens != torch_tokens)[:10])
        assert np.array_equal(reference, torch_tokens), (vocab, np.flatnonzero(reference != torch_tokens)[:10])
        greedy = feeds[contract.TEMPERATURE] == 0
        assert np.array_equal(torch_tokens[greedy], feeds[contract.LOGITS][greedy].argmax(axis=1))
        total += len(torch_tokens)
    assert total >= 100_000


def _chi_square_threshold(df: int, z: float = 3.09) -> float:
    """Upper quantile (z = 3.09: significance 0.001) by the Wilson–Hilferty approximation."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson statistic and degrees of freedom; cells expecting < 5 draws are pooled into one."""
    expected = probs * counts.sum()
    big = expected >= 5
    observed = np.append(counts[big], counts[~big].sum())
    wanted = np.append(expected[big], expected[~big].sum())
    used = wanted > 0
    return float(((observed[used] - wanted[used]) ** 2 / wanted[used]).sum()), int(used.sum()) - 1


def test_draws_follow_the_truncated_softmax(three_ways):
    """Guards against a sampler that is consistent but wrong (biased noise, a top-k or top-p cut in
    the wrong place, ties, an off-by-one bisection): per combination, 4,000 draws of one V = 97
    distribution at consecutive positions match the brute-force filtered softmax (chi-square,
    significance 0.001 each) and never leave its support."""
    feeds, _, tokens, _ = three_ways[97]
    per = ROWS[97]
    for index, (temperature, top_k, top_p) in enumerate(COMBOS):
        rows = slice(index * per, (index + 1) * per)
        probs = brute_force_probs(feeds[contract.LOGITS][index * per].tolist(), temperature, min(top_k, 97), top_p)
        counts = np.bincount(tokens[rows], minlength=97)
        assert counts[probs == 0].sum() == 0, ("a token outside the kept set", temperature, top_k, top_p)
        statistic, df = chi_square(counts, probs)
        if df > 0:
            assert statistic < _chi_square_threshold(df), (temperature, top_k, top_p, statistic, df)


def test_noise_is_gumbel_and_independent_over_150k_tokens():
    """Guards against a weak hash (noise that favours some token ids, correlates neighbouring tokens
    or positions, or is quantized near the top): over 3 rows x 151,936 tokens, F(g) = exp(-exp(-g))
    is uniform (Kolmogorov-Smirnov, significance 0.001), equally so in 16 token-id ranges, and
    uncorrelated between neighbouring tokens and between neighbouring positions."""
    vocab = 151936
    seed = torch.tensor([seed_parts(2**63 + 12345)] * 3)
    g = sampling.noise(seed, torch.tensor([[40], [41], [9000]]), vocab).double()
    u = torch.exp(-torch.exp(-g)).numpy()  # uniform on (0, 1) if g is Gumbel
    flat = np.sort(u.reshape(-1))
    n = len(flat)
    ks = np.max(np.maximum(np.arange(1, n + 1) / n - flat, flat - np.arange(n) / n))
    assert ks < 1.95 / math.sqrt(n), ks
    ranges = u.reshape(3, 16, -1).mean(axis=(0, 2))  # mean of F(g) per token-id range: 1/2 each
    assert np.abs(ranges - 0.5).max() < 4 * math.sqrt(1 / 12 / (n / 16)), ranges
    for x, y in ((u[:, :-1], u[:, 1:]), (u[0], u[1])):
        assert abs(np.corrcoef(x.reshape(-1), y.reshape(-1))[0, 1]) < 4 / math.sqrt(x.size)


def test_noise_is_a_pure_function_of_seed_position_and_token():
    """Guards against noise that depends on batch shape or order (batch-dependent sampling), on
    one seed part only, or that int64 arithmetic overflowed: rows alone equal rows in a shuffled
    batch, each seed part and the position change the noise, and the hash equals the same
    formula in Python's unbounded ints."""
    seeds = torch.tensor([seed_parts(s) for s in (0, 1, 1 << 22, 1 << 44, 2**64 - 1)])
    positions = torch.tensor([0, 5, 5, 5, 2**31 - 100])
    batch = sampling.noise(seeds, positions[:, None], 300)
    order = torch.tensor([3, 0, 4, 2, 1])
    shuffled = sampling.noise(seeds[order], positions[order, None], 300)
    assert torch.equal(shuffled, batch[order])
    for i in range(5):
        assert torch.equal(sampling.noise(seeds[i : i + 1], positions[i : i + 1, None], 300), batch[i : i + 1])
    assert len({tuple(row.tolist()) for row in batch}) == 5
    key_a, key_b = sampling.row_keys(seeds, positions[:, None])
    hashes = sampling.token_hash(key_a, key_b, 300)
    p = sampling.PRIME
    for row in range(5):
        a, b = int(key_a[row]), int(key_b[row])
        for token in (0, 1, 150, 299):
            x = pow((token * sampling.TOKEN_MULTIPLIER + a) % p, 3, p)
            assert int(hashes[row, token]) == pow((x + b) % p, 3, p)
    assert bool(torch.isfinite(batch).all())


def test_top_p_one_keeps_every_token_and_top_k_zero_is_off():
    """Guards against "off" values that still cut (the old top_p = 1.0 dropped thousands of tokens
    when its cumulative sum overshot 1): with top_p = 1 and top_k = 0 every token is kept, even
    one 60 logits below the max; top_k = V keeps every token too."""
    z = torch.randn(3, 8192, generator=torch.Generator().manual_seed(5)) * 4
    z[:, 17] = z.max() - 60
    ones, zeros = torch.ones(3), torch.zeros(3, dtype=torch.int64)
    assert bool(sampling.kept(z, zeros[:, None], ones[:, None], 8192).all())
    small = torch.randn(2, 97)
    assert bool(sampling.kept(small, torch.full((2, 1), 97), torch.ones(2, 1), 97).all())


def test_top_k_beyond_tensorrt_limit_is_refused_with_the_range():
    """Guards against a top_k the engines cannot compute (TensorRT's TopK caps K at 3840) being
    accepted and silently clamped: the refusal names the field, the range and the value."""
    check_sampling(1.0, 3840, 1.0, 151936)
    with pytest.raises(SamplingError, match=r"top_k must be in \[0, 3840\].*got 3841"):
        check_sampling(1.0, 3841, 1.0, 151936)
    with pytest.raises(SamplingError, match=r"top_k must be in \[0, 97\].*got 98"):
        check_sampling(1.0, 98, 1.0, 97)


def test_verdict_takes_the_longest_matching_prefix():
    """Guards against counting matches after the first mismatch, or the wrong correction/bonus token."""
    proposals = torch.tensor([[5, 6, 7], [5, 6, 7], [5, 6, 7], [1, 6, 7]])
    choices = torch.tensor([[5, 6, 7, 8], [5, 9, 7, 8], [5, 6, 3, 8], [5, 6, 7, 8]])
    accepted, token = verdict(proposals, choices)
    assert accepted.tolist() == [3, 1, 2, 0]
    assert token.tolist() == [8, 9, 3, 5]


@pytest.mark.parametrize("sampling_", [Sampling(1.0), Sampling(0.8, top_k=3), Sampling(1.5, top_p=0.8)])
def test_dflash_sampling_is_lossless_in_distribution(tmp_path_factory, sampling_):
    """Guards against a verifier that biases emitted tokens (e.g. reusing one noise draw for several
    positions or accepting by draft confidence): the joint distribution of the first two emitted
    tokens over 600 seeds matches the target's exact filtered distribution (chi-square, 0.1%)."""
    root = tmp_path_factory.mktemp("vocab8")
    target_dir = tiny_models.write_target(root / "t", vocab_size=8, std=0.25)
    target, draft = load_pair(target_dir, tiny_models.write_draft(root / "d", target_dir, block_size=4))
    decoder, prompt = ReferenceDecoder(target, draft), [3, 1, 4]
    exact = _exact_two_token_distribution(decoder, prompt, sampling_)
    counts = np.zeros((8, 8))
    for seed in range(600):
        first, second = decoder.generate_dflash(prompt, 2, Sampling(**{**sampling_.__dict__, "seed": seed})).tokens
        counts[first, second] += 1
    expected = exact * counts.sum()
    cells = expected > 0
    assert cells.sum() >= 4, "the test needs a spread-out distribution to have power"
    assert counts[~cells].sum() == 0, "a token outside the filtered support was emitted"
    statistic = float(((counts[cells] - expected[cells]) ** 2 / expected[cells]).sum())
    assert statistic < _chi_square_threshold(int(cells.sum()) - 1)


@torch.no_grad()
def _exact_two_token_distribution(decoder, prompt, sampling_) -> np.ndarray:
    """P(x1, x2 | prompt) from the target's logits, filtered by brute force."""

    def next_probs(tokens):
        cache = decoder.target.new_cache(1, 16)
        logits, _ = decoder.target(torch.tensor([tokens]), torch.tensor([0]), torch.tensor([0]), *cache)
        return brute_force_probs(logits[0, -1].tolist(), sampling_.temperature, sampling_.top_k, sampling_.top_p)

    first = next_probs(prompt)
    table = np.zeros((8, 8))
    for a, b in itertools.product(range(8), range(8)):
        if first[a] > 0:
            table[a, b] = first[a] * next_probs(prompt + [a])[b]
    return table
