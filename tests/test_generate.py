"""generate()/stream(): continuous batching, stop tokens, limits, cleanup — against the reference."""

from __future__ import annotations

import pytest

from dflash_trt.errors import InputError
from dflash_trt.export.sampling import Sampling
from dflash_trt.runtime.executor import Executor
from dflash_trt.runtime.generate import CONTEXT, LENGTH, STOP, Request, generate, stream
from executor_fixtures import Oracle, Tiny, single_thread


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    yield from single_thread()


@pytest.fixture(scope="module")
def tiny(exported_pair):
    tiny = Tiny(exported_pair, rows=4)
    yield tiny
    tiny.close()


@pytest.fixture(scope="module")
def oracle(tiny):
    return Oracle(tiny.target, tiny.dims.max_context)


def expected(oracle: Oracle, request: Request) -> tuple[list[int], str]:
    """The reference's tokens and finish reason for a request."""
    sampling = Sampling(request.temperature, request.top_k, request.top_p, request.seed)
    tokens = oracle.continuation(list(request.prompt), sampling)[: request.max_new_tokens]
    for i, token in enumerate(tokens):
        if token in request.stop:
            return tokens[: i + 1], STOP
    if len(tokens) == request.max_new_tokens:
        return tokens, LENGTH
    return tokens, CONTEXT


def test_stream_with_joins_and_leaves_matches_reference(tiny, oracle):
    """Guards against continuous batching changing outputs (sessions joining while others decode,
    leaving at stop / length / context), and against finish reasons or truncation off by one."""
    executor = Executor(tiny.ort, max_sessions=3)
    prompts = [tiny.prompts[0], tiny.prompts[1], tiny.prompts[2], [5, 6, 7], list(range(10, 40)), [9] * 12, [44]]
    stop_of_first = oracle.continuation(tiny.prompts[0])[6]  # a token the first continuation reaches
    requests = [
        Request(prompts[0], 30, stop=(stop_of_first,)),
        Request(prompts[1], 12),
        Request(prompts[2], 60),  # runs into the context end
        Request(prompts[3], 25, temperature=0.9, top_k=10, seed=11),
        Request(prompts[4], 5),
        Request(prompts[5], 40, temperature=1.2, top_p=0.8, seed=3),
        Request(prompts[6], 1),
    ]
    got: dict[int, list[int]] = {i: [] for i in range(len(requests))}
    finish: dict[int, str] = {}
    open_counts = []
    for chunk in stream(executor, requests):
        assert chunk.index not in finish, "a chunk after the request finished"
        got[chunk.index] += chunk.tokens
        if chunk.finish:
            finish[chunk.index] = chunk.finish
        open_counts.append(len(executor.sessions()))
    for i, request in enumerate(requests):
        assert (got[i], finish[i]) == expected(oracle, request), i
    assert {finish[0], finish[1], finish[2]} == {STOP, LENGTH, CONTEXT}
    assert max(open_counts) == 3 and executor.sessions() == []
    cycles = executor.cycle_stats()
    assert cycles["emitted"].sum() >= sum(len(t) for t in got.values())
    assert cycles["session"].n_unique() == len(requests)


def test_stream_closes_sessions_when_abandoned(tiny):
    """Guards against leaking cache rows when the caller stops iterating early."""
    executor = Executor(tiny.ort, max_sessions=2)
    chunks = stream(executor, [Request([1, 2, 3], 20), Request([4, 5], 20), Request([6], 20)])
    next(chunks)
    assert len(executor.sessions()) == 2
    chunks.close()
    assert executor.sessions() == []


@pytest.mark.parametrize(
    "request_, words",
    [
        (Request([], 4), "prompt must hold 1..63"),
        (Request([1] * 64, 4), "got 64"),
        (Request([1], 0), "max_new_tokens"),
        (Request([1, 97], 4), r"in \[0, 96\], got 97"),
    ],
)
def test_bad_requests_refused_before_any_session_opens(tiny, request_, words):
    """Guards against a request that can never run opening sessions (or failing mid-stream)."""
    executor = Executor(tiny.ort, max_sessions=2)
    with pytest.raises(InputError, match=words):
        list(stream(executor, [Request([1, 2], 3), request_]))
    assert executor.sessions() == [] and executor.execute_stats().height == 0


class CharTokenizer:
    """A stand-in tokenizer: one token per character code (the tiny pair has no tokenizer)."""

    stop_ids = (0,)

    def encode(self, text: str) -> list[int]:
        return [ord(ch) % 90 + 3 for ch in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i + 30) for i in ids)


def test_generate_text_prompts_seeds_and_defaults(tiny, oracle):
    """Guards against generate() mixing up prompt order, seeds (prompt i samples with seed + i),
    tokenizer stop ids and decoding."""
    executor = Executor(tiny.ort, max_sessions=2)
    tokenizer = CharTokenizer()
    texts = ["def f(x):", "return", "import os\n"]
    done = generate(executor, texts, tokenizer=tokenizer, max_new_tokens=9, temperature=0.8, seed=40)
    for i, (text, completion) in enumerate(zip(texts, done)):
        request = Request(tokenizer.encode(text), 9, (0,), 0.8, 0, 1.0, 40 + i)
        assert (completion.tokens, completion.finish) == expected(oracle, request)
        assert completion.text == tokenizer.decode(completion.tokens)
    with pytest.raises(InputError, match="no tokenizer"):
        generate(executor, ["text"])
