"""Every bad value refused at the API edge with a typed error, state and stats unchanged; equivalent
spellings of a good value (numpy scalars, arrays, tuples) accepted alike."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dflash_trt.errors import DFlashError, EngineError, InputError, SamplingError, SessionError
from dflash_trt.export.sampling import Sampling
from dflash_trt.runtime.executor import Executor, Input
from dflash_trt.runtime.generate import generate, stream
from dflash_trt.runtime.serving.batcher import Request
from executor_fixtures import RecordingBackend, Tracker

VOCAB = 97  # the tiny pair's vocabulary


TINY_ROWS = 6  # cache rows of the module's Tiny (conftest)


@pytest.fixture(scope="module")
def live(tiny, oracle):
    """One executor with two sessions mid-generation, shared by the refusal cases (each must leave it as it was)."""
    executor = Executor(backend := RecordingBackend(tiny.ort), tiny.dims, 4)
    tracker = Tracker(executor, oracle)
    a, b = tracker.open(), tracker.open()
    tracker.execute([(a, [4, 8, 15, 16, 23], None, True), (b, [42, 7], None, True)])
    yield executor, tracker, backend, (a, b)
    executor.close()


def state(executor: Executor) -> tuple:
    """Everything a refusal must leave alone: sessions, stats rows, the batch counter."""
    return ([executor.session(s) for s in executor.sessions()], executor.cycle_stats().height,
            executor.execute_stats().height, executor.log.batch_id)


def refused(executor: Executor, call, error: type, words: list[str]) -> None:
    before, refusals = state(executor), sum(executor.refused_calls().values())
    with pytest.raises(error) as info:
        call()
    assert all(word in str(info.value) for word in words), str(info.value)
    assert state(executor) == before
    assert sum(executor.refused_calls().values()) == refusals + 1


F32_MAX = float(np.finfo(np.float32).max)
BAD_SAMPLING = {
    # case: (set_sampling keyword arguments, words of the error)
    "temperature-1e308": (dict(temperature=1e308), ["temperature", "3.4028234663852886e+38", "1e+308"]),
    "temperature-past-f32": (dict(temperature=F32_MAX * 1.0001), ["temperature", "float32"]),
    "temperature-tiny": (dict(temperature=1e-40), ["temperature", "[1e-06", "1e-40"]),
    "temperature-below-min": (dict(temperature=5e-7), ["temperature", "5e-07"]),
    "temperature-negative": (dict(temperature=-0.1), ["temperature"]),
    "temperature-nan": (dict(temperature=math.nan), ["temperature", "finite"]),
    "temperature-inf": (dict(temperature=np.float32("inf")), ["temperature", "finite"]),
    "temperature-bool": (dict(temperature=True), ["temperature", "not a bool", "True"]),
    "temperature-numpy-bool": (dict(temperature=np.bool_(True)), ["temperature", "not a bool"]),
    "temperature-text": (dict(temperature="0.7"), ["temperature", "'0.7'"]),
    "temperature-none": (dict(temperature=None), ["temperature", "None"]),
    "temperature-complex": (dict(temperature=1j), ["temperature"]),
    "top-p-1e-50": (dict(temperature=0.7, top_p=1e-50), ["top_p", "1.1754943508222875e-38", "1e-50"]),
    "top-p-subnormal": (dict(temperature=0.7, top_p=1e-40), ["top_p", "1e-40"]),
    "top-p-zero": (dict(top_p=0.0), ["top_p"]),
    "top-p-above-one": (dict(top_p=1.0000001), ["top_p"]),
    "top-p-bool": (dict(top_p=True), ["top_p", "True"]),
    "top-p-nan": (dict(top_p=np.float64("nan")), ["top_p"]),
    "top-k-bool": (dict(top_k=True), ["top_k", "not a bool"]),
    "top-k-float": (dict(top_k=2.0), ["top_k", "2.0"]),
    "top-k-numpy-float": (dict(top_k=np.float32(3)), ["top_k"]),
    "top-k-past-vocab": (dict(top_k=VOCAB + 1), ["top_k", f"[0, {VOCAB}]", f"{VOCAB + 1}"]),
    "top-k-negative": (dict(top_k=np.int64(-1)), ["top_k", "-1"]),
    "seed-bool": (dict(seed=True), ["seed", "True"]),
    "seed-float": (dict(seed=1.0), ["seed", "1.0"]),
    "seed-2-64": (dict(seed=2**64), ["seed", "2**64 - 1"]),
    "seed-negative": (dict(seed=np.int64(-1)), ["seed", "-1"]),
}


@pytest.mark.parametrize("case", sorted(BAD_SAMPLING))
def test_bad_sampling_values_are_refused_and_change_nothing(live, case):
    """Guards against sampling values the float32 verifier cannot represent (1e308 poisoned the next
    execute; 1e-40 and top_p 1e-50 gave NaN probabilities), bools taken as numbers, and numpy
    scalars handled unlike Python numbers."""
    executor, _, _, (a, _) = live
    kwargs, words = BAD_SAMPLING[case]
    refused(executor, lambda: executor.set_sampling(a, **kwargs), SamplingError, words)


def test_numpy_scalars_sample_exactly_like_python_numbers(tiny, oracle):
    """Guards against numpy scalars being refused (they were, for top_k and temperature) or
    converted lossily: np.float32/np.int64/np.uint64 values give the same tokens as the plain
    numbers they hold."""
    plain = Sampling(float(np.float32(0.7)), 5, float(np.float32(0.9)), 77)
    outputs = []
    for values in ((plain.temperature, 5, plain.top_p, 77), (np.float32(0.7), np.int64(5), np.float32(0.9), np.uint64(77))):
        with Executor(tiny.ort, max_sessions=1) as executor:
            s = executor.open_session()
            executor.set_sampling(s, *values)
            assert executor.session(s).sampling == plain and type(executor.session(s).sampling.top_k) is int
            out = executor.execute([Input(s, [3, 9, 27])])[0]
            out += executor.execute([Input(s, [out[-1]])])[0]
            outputs.append(out)
    assert outputs[0] == outputs[1] == oracle.continuation([3, 9, 27], plain)[: len(outputs[0])]


def _gen():
    yield 1


BAD_TOKENS = {
    # case: (tokens, words of the error)
    "dict": ({1: 2, 3: 4}, ["input[0].tokens", "dict"]),
    "set": ({1, 2}, ["input[0].tokens", "set"]),
    "frozenset": (frozenset({5}), ["input[0].tokens", "frozenset"]),
    "generator": (_gen(), ["input[0].tokens", "generator"]),
    "str": ("12", ["input[0].tokens", "str"]),
    "bytes": (b"\x01\x02", ["input[0].tokens", "bytes"]),
    "int": (5, ["input[0].tokens", "int"]),
    "none": (None, ["input[0].tokens", "NoneType"]),
    "bool-item": ([True, 2], ["input[0].tokens[0]", "True"]),
    "numpy-bool-item": ([np.bool_(True)], ["input[0].tokens[0]"]),
    "float-item": ([1.0], ["input[0].tokens[0]", "1.0"]),
    "float-array": (np.array([1.5]), ["input[0].tokens[0]", "1.5"]),
    "bool-array": (np.array([True, False]), ["input[0].tokens[0]", "True"]),
    "float-tensor": (torch.tensor([1.0, 2.0]), ["input[0].tokens[0]", "1.0"]),
    "2d-array": (np.array([[1, 2]]), ["input[0].tokens", "1-D", "[1, 2]"]),
    "0d-tensor": (torch.tensor(3), ["input[0].tokens", "1-D"]),
    "past-vocab": (np.array([1, VOCAB]), ["input[0].tokens[1]", f"[0, {VOCAB - 1}]", f"{VOCAB}"]),
    "nested-list": ([[1, 2]], ["input[0].tokens[0]", "[1, 2]"]),
}


@pytest.mark.parametrize("case", sorted(BAD_TOKENS))
def test_bad_token_containers_are_refused_and_change_nothing(live, case):
    """Guards against tokens as a dict (its keys were fed) or set (arbitrary order) being accepted,
    and against bools / floats passing as token ids."""
    executor, _, _, (a, _) = live
    tokens, words = BAD_TOKENS[case]
    refused(executor, lambda: executor.execute([Input(a, tokens)]), InputError, words)


BAD_FIELDS = {
    "session-bool": (lambda a, f: Input(True, [1]), SessionError, ["input[0].session", "True"]),
    "position-bool": (lambda a, f: Input(a, [1], position=True), InputError, ["input[0].position", "True"]),
    "offset-float": (lambda a, f: Input(a, [1, 2], offset=1.0), InputError, ["input[0].offset", "1.0"]),
    "size-numpy-bool": (lambda a, f: Input(a, [1, 2], size=np.bool_(True)), InputError, ["input[0].size"]),
    "produce-int": (lambda a, f: Input(a, [1], produce_output=1), InputError, ["input[0].produce_output", "1"]),
    "position-past-frontier": (lambda a, f: Input(a, [1], position=f + 1), InputError, ["input[0].position", "got"]),
}


@pytest.mark.parametrize("case", sorted(BAD_FIELDS))
def test_bad_input_fields_are_refused_and_change_nothing(live, case):
    """Guards against bools or floats accepted as sessions, positions, offsets and sizes."""
    executor, _, _, (a, _) = live
    make, error, words = BAD_FIELDS[case]
    refused(executor, lambda: executor.execute([make(a, executor.session(a).frontier)]), error, words)


def test_equivalent_token_spellings_give_the_same_tokens(live):
    """Guards against a container type changing what is fed: list, tuple, range, numpy int32 array,
    torch int64 tensor and a list of numpy ints all replay the same tokens to the same output."""
    executor, tracker, _, (_, b) = live
    position = executor.session(b).frontier - 2
    tokens = tracker.seq[b][position : position + 2]
    spellings = [list(tokens), tuple(tokens), np.array(tokens, dtype=np.int32), torch.tensor(tokens),
                 [np.int64(t) for t in tokens]]
    if tokens == list(range(tokens[0], tokens[0] + 2)):
        spellings.append(range(tokens[0], tokens[0] + 2))
    outputs = [executor.execute([Input(b, spelling, position=position)])[0] for spelling in spellings]
    assert all(out == outputs[0] for out in outputs) and outputs[0]
    tracker.seq[b], tracker.pending[b] = tracker.seq[b][: position + 2] + outputs[0], True  # follow the replays
    tracker.check_state()


def test_clone_copy_failure_is_typed_and_leaves_nothing(live, oracle):
    """Guards against a failed clone surfacing as the backend's raw RuntimeError, or leaving a
    half-made session (its row taken) behind."""
    executor, tracker, backend, (a, _) = live
    inner_copy = backend.copy_rows

    def broken(*args):
        raise RuntimeError("device copy failed")

    backend.copy_rows = broken
    try:
        refused(executor, lambda: executor.clone(a, 3), EngineError, [f"clone({a}, 3)", "RuntimeError: device copy failed", "nothing changed"])
    finally:
        backend.copy_rows = inner_copy
    tracker.execute(tracker.decode_inputs([a]))  # the source continues with the reference's tokens


def test_bad_generate_arguments_are_refused_before_any_session_opens(tiny):
    """Guards against generate() running max_new_tokens=True as 1, reporting max_sessions=-1 as
    'batch must be a non-empty list', and failing after opening sessions."""
    executor = Executor(tiny.ort, max_sessions=2)
    cases = [
        (dict(max_new_tokens=True), InputError, ["max_new_tokens", "not a bool", "True"]),
        (dict(max_new_tokens=0), InputError, ["request[0].max_new_tokens", "0"]),
        (dict(max_new_tokens=2.0), InputError, ["max_new_tokens", "2.0"]),
        (dict(max_sessions=-1), InputError, ["max_sessions", "-1"]),
        (dict(max_sessions=True), InputError, ["max_sessions", "True"]),
        (dict(max_sessions=0), InputError, ["max_sessions", "0"]),
        (dict(prompts="def f():"), InputError, ["prompts must be a list", "str"]),
        (dict(prompts=[{1: 2}]), InputError, ["request[0].prompt", "dict"]),
        (dict(prompts=[[1, 2], {3, 4}]), InputError, ["request[1].prompt", "set"]),
        (dict(prompts=[[1, VOCAB]]), InputError, ["request[0].prompt[1]", f"{VOCAB}"]),
        (dict(prompts=[[]]), InputError, ["request[0].prompt", "1..63"]),
        (dict(stop=5), InputError, ["request[0].stop", "int"]),
        (dict(stop=[True]), InputError, ["request[0].stop[0]", "True"]),
        (dict(temperature=1e308), SamplingError, ["request[0]: temperature", "1e+308"]),
        (dict(temperature=True), SamplingError, ["temperature", "not a bool"]),
        (dict(top_p=1e-50), SamplingError, ["top_p"]),
        (dict(top_k=True), SamplingError, ["top_k"]),
        (dict(seed=-1), SamplingError, ["seed", "-1"]),
        (dict(seed=2**64 - 1, prompts=[[1], [2]]), SamplingError, ["seed", "2**64 - len(prompts)"]),
        (dict(seed=True), SamplingError, ["seed", "True"]),
    ]
    for kwargs, error, words in cases:
        arguments = dict(prompts=[[1, 2, 3]], max_new_tokens=4) | kwargs
        before = state(executor)
        with pytest.raises(error) as info:
            generate(executor, **arguments)
        assert all(word in str(info.value) for word in words), (kwargs, str(info.value))
        assert state(executor) == before and executor.sessions() == []
    with pytest.raises(InputError, match="request\\[0\\] must be a Request"):
        next(stream(executor, [([1, 2], 3)]))
    assert generate(executor, [np.array([1, 2, 3])], max_new_tokens=np.int64(3))[0].finish == "length"
    executor.close()


def test_constructor_arguments_are_checked(tiny):
    """Guards against an executor built with a bool or out-of-range size silently using it."""
    for kwargs, word in ((dict(max_sessions=True), "max_sessions"), (dict(max_sessions=tiny.rows + 1), "max_sessions"),
                         (dict(stats_rows=0), "stats_rows"), (dict(stats_rows=True), "stats_rows")):
        with pytest.raises(InputError, match=word):
            Executor(tiny.ort, **kwargs)
    assert issubclass(InputError, DFlashError) and Request([1]).max_new_tokens == 64


def test_one_sampling_value_is_checked_by_one_routine(tiny):
    """Guards against sampling settings travelling as loose scalars checked by two different routines
    (the request layer's and the executor's): a Request carries one Sampling, and check_request and
    set_sampling refuse a bad field with the same Sampling.checked message, naming the field."""
    from dflash_trt.runtime.serving.batcher import check_request

    dims = tiny.dims
    bad = Sampling(temperature=0.5, top_k=-3)
    with pytest.raises(SamplingError) as at_request:
        check_request(0, Request([1, 2], 4, (), bad), dims.max_context, dims.vocab_size)
    executor = Executor(tiny.ort, dims, 2)
    session = executor.open_session()
    with pytest.raises(SamplingError) as at_session:
        executor.set_sampling(session, bad)
    assert at_request.value.param == at_session.value.param == "top_k"
    assert str(at_session.value) in str(at_request.value)
    with pytest.raises(SamplingError, match=r"request\[0\]\.sampling must be a Sampling, got tuple"):
        check_request(0, Request([1, 2], 4, (), (0.5, 0, 1.0, 3)), dims.max_context, dims.vocab_size)
    executor.set_sampling(session, Sampling(0.7, 5, 0.9, 3))
    assert executor.session(session).sampling == Sampling(0.7, 5, 0.9, 3)
    executor.close()


def test_batch_validation_fast_path_agrees_with_the_full_check():
    """Guards against the plain-input fast path of ``validate_batch`` (``_plain_step``) accepting an
    input the full check refuses, refusing with another error, or planning another step (start, room,
    stop, tokens), and against ``last`` / ``fast`` / ``decode`` going wrong when a session repeats:
    random batches of valid and invalid inputs against the per-input check and a brute-force marking."""
    import random

    from dflash_trt.runtime import sessions as S
    from dflash_trt.runtime.ownership import RowAllocator

    limits = S.Limits(vocab_size=50, max_context=24, block=4)
    table = S.SessionTable(4, RowAllocator(4))
    fresh, going, poisoned, full = (table.open(speculate) for speculate in (True, True, False, True))
    going.frontier, going.draft_position, going.pending = 5, 3, 7
    poisoned.poisoned = True
    full.frontier = 21
    sids = [fresh.id, going.id, poisoned.id, full.id, 99, np.int64(going.id), 1.0]
    token_lists = [[7], [3, 4, 5], [], [True], [60], [-1], (7,), np.array([7]), range(2), [np.int64(7)], [7] * 4]
    rng = random.Random(0)

    def one() -> Input:
        fields = dict(session=rng.choice(sids), tokens=rng.choice(token_lists))
        for name, values in (
            ("offset", [0, 1, True, np.int64(0)]), ("size", [None, 1, 0]), ("position", [None, 0, 5, 21]),
            ("produce_output", [True, False, np.bool_(True), 1]), ("max_new_tokens", [None, 1, 9, 0, True, np.int64(3)]),
            ("stop", [(), (3,), [3, 49], (50,), (True,), {3}, range(1)]),
        ):
            if rng.random() < 0.3:
                fields[name] = rng.choice(values)
        return Input(**fields)

    def reference(batch):
        cursors: dict[int, int] = {}
        steps = [S._validate_input(i, item, table, limits, cursors) for i, item in enumerate(batch)]
        for step in steps:
            same = [other for other in steps if other.session is step.session]
            step.last = same[-1] is step
            single = len(same) == 1 and step.produce_output and len(step.tokens) == 1
            drafts = step.session.speculate and step.start + limits.block <= limits.max_context
            step.fast = single and drafts and step.start == step.session.frontier and step.session.pending == step.tokens[0]
            step.decode = single and not drafts
        return steps

    def outcome(check, batch):
        try:
            return check(batch)
        except DFlashError as error:
            return type(error), str(error)

    plain = 0
    for _ in range(3000):
        batch = [one() for _ in range(rng.randint(1, 5))]
        expected = outcome(reference, batch)
        assert outcome(lambda b: S.validate_batch(table, b, limits), batch) == expected, batch
        plain += isinstance(expected, list)
    assert plain > 100  # enough valid batches to compare plans, not only errors
