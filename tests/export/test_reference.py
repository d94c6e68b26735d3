"""The reference decoder: DFlash is lossless against target-only decoding."""

from __future__ import annotations

import random

import pytest
import torch

import tiny_models
from dflash_trt.errors import InputError, SamplingError
from dflash_trt.export.pair import load_pair
from dflash_trt.export.reference import ReferenceDecoder
from dflash_trt.export.sampling import Sampling

PROMPTS = [[random.Random(i).randrange(3, 90) for _ in range(1 + (i * 7) % 23)] for i in range(20)]
PROPOSALS = {4: (2, 3), 8: (2, 5, 7), 16: (2, 9, 15)}


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """One tiny target with drafts of block sizes 4, 8 and 16."""
    root = tmp_path_factory.mktemp("blocks")
    target = tiny_models.write_target(root / "target")
    return {
        block: load_pair(target, tiny_models.write_draft(root / f"draft{block}", target, block_size=block))
        for block in PROPOSALS
    }


@pytest.fixture(scope="module")
def greedy_targets(pairs):
    decoder = ReferenceDecoder(pairs[4][0])
    return [decoder.generate_target(prompt, 24).tokens for prompt in PROMPTS]


@pytest.mark.parametrize("block", sorted(PROPOSALS))
def test_dflash_greedy_equals_target_greedy(pairs, greedy_targets, block):
    """Guards against any cycle bookkeeping error (anchor position, draft context rows, target KV
    rewind, correction token): 20 prompts x every proposal count give the target's greedy tokens."""
    decoder = ReferenceDecoder(*pairs[block])
    for proposals in PROPOSALS[block]:
        for prompt, expected in zip(PROMPTS, greedy_targets):
            generation = decoder.generate_dflash(prompt, 24, proposals=proposals)
            assert generation.tokens == expected, (block, proposals, prompt)
            assert all(0 <= a <= proposals for a in generation.accepted)


class OracleDecoder(ReferenceDecoder):
    """Proposes the target's true continuation with seeded corruptions, so every acceptance length
    (0..P, bonus included) is exercised — a random draft almost never accepts."""

    def __init__(self, target, draft, truth, corrupt):
        super().__init__(target, draft)
        self.truth, self.corrupt, self.rng = truth, corrupt, random.Random(0)
        self.emitted = 0

    def _propose(self, anchor, start, proposals, d_cache):
        real = super()._propose(anchor, start, proposals, d_cache)  # keeps the draft cache path live
        offset = start - self.prompt_length + 1  # truth index of the token AT start + 1
        guesses = list(self.truth[offset : offset + proposals])
        guesses += real[len(guesses) :]
        for i in range(len(guesses)):
            if self.rng.random() < self.corrupt:
                guesses[i] = (guesses[i] + 1) % 97
        return guesses


@pytest.mark.parametrize("corrupt", [0.0, 0.15, 0.5])
def test_every_acceptance_length_stays_lossless(pairs, greedy_targets, corrupt):
    """Guards against off-by-one errors that only show when proposals ARE accepted (bonus token,
    rewinding after a partial accept, taps of accepted rows as next context)."""
    target, draft = pairs[8]
    seen = set()
    for prompt, expected in zip(PROMPTS[:8], greedy_targets):
        truth = ReferenceDecoder(target).generate_target(prompt, 40).tokens
        decoder = OracleDecoder(target, draft, truth, corrupt)
        decoder.prompt_length = len(prompt)
        generation = decoder.generate_dflash(prompt, 24)
        assert generation.tokens == expected
        seen.update(generation.accepted)
    if corrupt == 0.0:
        assert seen == {7}  # a perfect draft: every cycle all proposals + bonus
    if corrupt == 0.5:
        assert {0, 1} <= seen


@pytest.mark.parametrize(
    "sampling",
    [Sampling(1.0, seed=5), Sampling(0.7, top_k=5, seed=6), Sampling(1.3, top_p=0.6, seed=7)],
)
def test_sampled_dflash_equals_sampled_target_for_the_same_seed(pairs, sampling):
    """Guards against uniforms keyed by anything but (seed, position): a sampled DFlash run must be
    token-for-token the target-only sampled run with the same seed, at every proposal count."""
    decoder = ReferenceDecoder(*pairs[8])
    for prompt in PROMPTS[:6]:
        expected = decoder.generate_target(prompt, 20, sampling).tokens
        for proposals in (2, 7):
            assert decoder.generate_dflash(prompt, 20, sampling, proposals=proposals).tokens == expected


def test_block_beyond_context_falls_back_to_target_decode(pairs, greedy_targets):
    """Guards against writing a draft block past the cache end: near max_context the decoder must
    switch to plain target decode and stay lossless."""
    target, draft = pairs[8]
    prompt = PROMPTS[5]
    decoder = ReferenceDecoder(target, draft, max_context=len(prompt) + 24)
    generation = decoder.generate_dflash(prompt, 24)
    assert generation.tokens == greedy_targets[5]
    assert generation.target_steps > 0 and generation.accepted


def test_stop_token_ends_generation(pairs, greedy_targets):
    """Guards against emitting tokens past a stop token inside an accepted burst."""
    decoder = ReferenceDecoder(*pairs[8])
    expected = greedy_targets[3]
    stop = expected[6]
    out = decoder.generate_dflash(PROMPTS[3], 24, stop=(stop,)).tokens
    assert out == expected[: expected.index(stop) + 1]


@pytest.mark.parametrize(
    "kwargs, error, field",
    [
        (dict(prompt=[]), InputError, "prompt"),
        (dict(prompt=[5, 97]), InputError, "token"),
        (dict(sampling=Sampling(float("nan"))), SamplingError, "temperature"),
        (dict(sampling=Sampling(1.0, top_p=0.0)), SamplingError, "top_p"),
        (dict(sampling=Sampling(1.0, top_k=-1)), SamplingError, "top_k"),
        (dict(proposals=8), InputError, "proposals"),
    ],
)
def test_bad_requests_are_refused_with_the_field_named(pairs, kwargs, error, field):
    """Guards against silent clamping of bad requests: each raises a typed error naming the field."""
    decoder = ReferenceDecoder(*pairs[8])
    request = dict(prompt=[5, 6], max_new_tokens=4) | kwargs
    with pytest.raises(error, match=field):
        decoder.generate_dflash(**request)
