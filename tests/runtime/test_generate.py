"""generate()/stream(): continuous batching, stop tokens, limits, cleanup — against the reference."""

from __future__ import annotations

import pytest

from dflash_trt.errors import InputError
from dflash_trt.export.sampling import Sampling
from dflash_trt.runtime.executor import Executor
from dflash_trt.runtime.generate import generate, stream
from dflash_trt.runtime.finish import CONTEXT, LENGTH, STOP
from dflash_trt.runtime.serving.batcher import Request
from executor_fixtures import Oracle


TINY_ROWS = 4  # cache rows of the module's Tiny (conftest)


def expected(oracle: Oracle, request: Request) -> tuple[list[int], str]:
    """The reference's tokens and finish reason for a request."""
    sampling = request.sampling
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
    executor = Executor(tiny.ort, max_sessions=3, max_cycles=8)  # a chunk comes while three sessions are open
    prompts = [tiny.prompts[0], tiny.prompts[1], tiny.prompts[2], [5, 6, 7], list(range(10, 40)), [9] * 12, [44]]
    stop_of_first = oracle.continuation(tiny.prompts[0])[6]  # a token the first continuation reaches
    requests = [
        Request(prompts[0], 30, stop=(stop_of_first,)),
        Request(prompts[1], 12),
        Request(prompts[2], 60),  # runs into the context end
        Request(prompts[3], 25, sampling=Sampling(0.9, 10, 1.0, 11)),
        Request(prompts[4], 5),
        Request(prompts[5], 40, sampling=Sampling(1.2, 0, 0.8, 3)),
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
    executor = Executor(tiny.ort, max_sessions=2, max_cycles=2)  # the first chunk comes before a request ends
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
        request = Request(tokenizer.encode(text), 9, (0,), Sampling(0.8, 0, 1.0, 40 + i))
        assert (completion.tokens, completion.finish) == expected(oracle, request)
        assert completion.text == tokenizer.decode(completion.tokens)
    with pytest.raises(InputError, match="no tokenizer"):
        generate(executor, ["text"])


def burst_requests(oracle: Oracle, prompts: list[list[int]]) -> list[Request]:
    """Requests whose stop tokens land a few tokens into a continuation (mid-burst for multi-cycle
    executes), one cut by length, sampled ones, and one that runs into the context end."""
    conts = [oracle.continuation(p) for p in prompts[:3]]
    return [
        Request(prompts[0], 40, stop=(conts[0][6],)),
        Request(prompts[1], 40, stop=(conts[1][9],)),
        Request(prompts[2], 60),  # context end
        Request([5, 6, 7], 13),
        Request(list(range(10, 30)), 30, sampling=Sampling(0.9, 10, 1.0, 11)),
        Request([9] * 12, 25, stop=(3, 4), sampling=Sampling(1.2, 0, 0.8, 3)),
    ]


def collect(executor: Executor, requests: list[Request]) -> list[tuple[list[int], str]]:
    got = [([], None) for _ in requests]
    for chunk in stream(executor, requests):
        got[chunk.index] = (got[chunk.index][0] + chunk.tokens, chunk.finish)
    return got


def oracle_backend(tiny, oracle: Oracle, requests: list[Request]):
    """ONNX Runtime whose draft proposes the reference's continuation (a wrong token at varying
    places): cycles accept 0..P, so stops land inside multi-token cycles. Request i runs in row i."""
    from executor_fixtures import RecordingBackend

    backend = RecordingBackend(tiny.ort)
    for row, r in enumerate(requests):
        sampling = r.sampling
        backend.truth[row] = list(r.prompt) + oracle.continuation(list(r.prompt), sampling)
    return backend


@pytest.mark.parametrize("backend", ["onnxruntime", pytest.param("torch-cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("lag", [1, 0, 2])
def test_multi_cycle_executes_equal_one_cycle_at_a_time(tiny, oracle, backend, lag):
    """Guards against the multi-cycle loop changing output: stop tokens and max_new_tokens found a
    cycle late (the next cycle already launched) or inside a multi-token cycle, extra tokens discarded
    and sessions rewound, device-side anchors/positions/sampling positions, pinned-memory reads; outputs
    must equal the one-cycle-per-call executor's and the reference's, with lag 0, 1 and 2 (on CUDA:
    the torch backend, one captured graph per cycle)."""
    requests = burst_requests(oracle, tiny.prompts)
    want = [expected(oracle, r) for r in requests]
    assert collect(Executor(tiny.ort, max_sessions=3, max_cycles=1, lag=False), requests) == want
    if backend == "onnxruntime":
        executor = Executor(oracle_backend(tiny, oracle, requests[:3]), tiny.dims, max_sessions=3, max_cycles=6, lag=lag)
    else:
        import copy

        from dflash_trt.runtime.backends.torch_backend import TorchBackend

        # The backend moves its models to the GPU: copies, so the CPU oracle keeps the originals.
        gpu = TorchBackend(copy.deepcopy(tiny.target), copy.deepcopy(tiny.draft), tiny.dims, 3, device="cuda")
        executor = Executor(gpu, max_sessions=3, max_cycles=6, lag=lag)
    assert collect(executor, requests) == want
    cycles = executor.cycle_stats()
    per_call = cycles.group_by("batch_id", "session").agg(cycles=cycles["cycle_id"].n_unique())
    assert per_call["cycles"].max() > 1  # executes really ran several cycles
    # A stop read a cycle late (lag) discards the cycle in flight: the stats count only what callers received.
    assert cycles["emitted"].sum() == sum(len(tokens) for tokens, _ in want)
    if backend == "onnxruntime":
        assert cycles["accepted"].max() >= 3  # multi-token cycles
    else:
        assert executor.loop.captured and executor.loop.timeline.launches > len(executor.loop.captured)  # replays
        executor.close()
        executor.backend.close()


def test_plain_decoding_mode_equals_reference_and_never_drafts(tiny, oracle):
    """Guards against the autoregressive baseline (speculate=False) diverging from the target, drafting
    anyway (draft graphs run, taps kept) or logging anything but plain-decode rows."""
    from executor_fixtures import RecordingBackend

    requests = burst_requests(oracle, tiny.prompts)
    backend = RecordingBackend(tiny.ort)
    executor = Executor(backend, tiny.dims, max_sessions=3, speculate=False, max_cycles=5)
    assert collect(executor, requests) == [expected(oracle, r) for r in requests]
    assert set(backend.counts) == {"target_prefill", "target_decode", "sample"}  # sample: every token choice but the argmax
    assert set(executor.cycle_stats()["mode"]) == {"target"}
    assert int(executor.execute_stats()["hidden_rows_d2d"].sum()) == 0


def test_a_burst_of_prompts_is_prefilled_over_several_steps(tiny, oracle):
    """Guards against a burst of joining prompts stalling every running request for one huge prefill:
    a step takes joined prompts only up to the Batcher's prefill budget (the first always), the rest
    join in the next steps, and every output is still the reference's."""
    from dflash_trt.runtime.serving.batcher import Batcher

    executor = Executor(tiny.ort, tiny.dims, TINY_ROWS)
    batcher = Batcher(executor, prefill_tokens=20)
    prompts = {key: list(range(3 + key, 15 + key)) for key in range(TINY_ROWS)}  # 12 tokens each: one, then one more per step
    for key, prompt in prompts.items():
        batcher.join(key, Request(prompt, 40))
    admitted_per_step, tokens = [], {key: [] for key in prompts}
    while batcher.running:
        chunks = batcher.step()
        admitted_per_step.append(len(chunks))
        for chunk in chunks:
            tokens[chunk.index] += chunk.tokens
    assert admitted_per_step[:2] == [1, 2]  # 12 + 12 > 20: one prompt a step
    for key, prompt in prompts.items():
        assert tokens[key] == oracle.continuation(prompt)[:40]
    executor.close()


def test_a_queued_request_joins_as_soon_as_a_session_frees(tiny, oracle):
    """Guards against a waiting request sitting out the rest of an execute (its neighbour decoding alone
    for up to max_cycles rounds) after a request finished and freed a session: the execute ends after its
    round (early join), the next one takes the queued request, and every output still equals the reference."""
    executor = Executor(tiny.ort, max_sessions=2, max_cycles=8)
    requests = [Request(tiny.prompts[0], 1), Request(tiny.prompts[1], 24), Request(tiny.prompts[2], 24)]
    chunks = list(stream(executor, requests))
    first_cycles = executor.execute_stats()["cycles"].to_list()[0]
    assert first_cycles == 1  # request 0 ended at its prediction: request 1's first round, then the gap
    joined = next(i for i, chunk in enumerate(chunks) if chunk.index == 2)
    assert joined <= 3  # request 2's first tokens come in the second step (one chunk per request per step)
    for i, request in enumerate(requests):
        tokens = [token for chunk in chunks if chunk.index == i for token in chunk.tokens]
        assert tokens == expected(oracle, request)[0]
