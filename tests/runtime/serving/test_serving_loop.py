"""the serving loop (runtime.serving.loop) over the exported tiny pair: threads and coroutines against the
reference, cancel, backpressure, failure isolation, close — no HTTP."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import polars as pl
import pytest
from hypothesis import given, settings, strategies as st

from dflash_trt.errors import InputError, PoisonedError, QueueFullError, SamplingError, ServingClosedError, TokenizerError
from dflash_trt.export import contract as c
from dflash_trt.export.pair import DEFAULT_PAIR_DIR
from dflash_trt.export.sampling import Sampling
from dflash_trt.export.tokenizer import Tokenizer
from dflash_trt.runtime.executor import Executor
from dflash_trt.runtime.finish import CONTEXT, LENGTH, STOP
from dflash_trt.runtime.serving.loop import CANCELLED, ServingLoop
from dflash_trt.runtime.serving.metrics import LATENCY_BUCKETS_S, RATE_BUCKET_S, RATE_WINDOW_S, WINDOW_S, WINDOW_SAMPLES, ExecuteTotals, MetricsRecorder
from executor_fixtures import SERVING_REQUESTS as REQUESTS, CharTokenizer, RecordingBackend


TINY_ROWS = 4  # cache rows of the module's Tiny (conftest)


class GatedBackend(RecordingBackend):
    """Runs block while the gate is closed (``entered`` is set once a run waits): the serving loop is
    held inside one execute() while the test submits, cancels or fills the queue."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.gate, self.entered = threading.Event(), threading.Event()
        self.gate.set()

    def run(self, graph, feeds, first_row):
        if not self.gate.is_set():
            self.entered.set()
            assert self.gate.wait(30), "gate never opened"
        return super().run(graph, feeds, first_row)


def serving_over(tiny, **options) -> tuple[ServingLoop, GatedBackend]:
    backend = GatedBackend(tiny.ort)
    return ServingLoop(Executor(backend, tiny.dims, 4), **options), backend


def reference(oracle, prompt, max_new, stop=(), sampling=Sampling()) -> tuple[list[int], str]:
    tokens = oracle.continuation(list(prompt), sampling)[:max_new]
    cut = next((i + 1 for i, t in enumerate(tokens) if t in stop), None)
    if cut is not None:
        return tokens[:cut], STOP
    return tokens, LENGTH if len(tokens) == max_new else CONTEXT


def submit(serving, prompt, max_new, sampling):
    return serving.submit(prompt, max_new, temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p, seed=sampling.seed)


def test_requests_from_threads_and_coroutines_equal_the_reference(tiny, oracle):
    """Guards against continuous batching across threads changing outputs (greedy or sampled), against
    a consumer mode (blocking iterator, async iterator, future) losing or reordering deltas, and
    against sessions leaking after requests finish."""
    requests = REQUESTS + [(p, 20, Sampling()) for p in tiny.prompts[:2]]  # the draft accepts on these
    serving, _ = serving_over(tiny, max_running=3)
    with ThreadPoolExecutor(len(requests)) as pool:
        handles = list(pool.map(lambda r: submit(serving, *r), requests))
    iterated = {}

    def consume(i):
        iterated[i] = [t for delta in handles[i] for t in delta.tokens]

    async def consume_async(i):
        deltas = [delta async for delta in handles[i]]
        return [t for d in deltas for t in d.tokens], deltas[-1].finish, await handles[i]

    readers = [threading.Thread(target=consume, args=(i,)) for i in range(0, len(requests), 2)]
    for reader in readers:
        reader.start()

    async def gather():
        return await asyncio.gather(*(consume_async(i) for i in range(1, len(requests), 2)))

    awaited = dict(zip(range(1, len(requests), 2), asyncio.run(gather())))
    for reader in readers:
        reader.join(60)
    for i, ((prompt, max_new, sampling), handle) in enumerate(zip(requests, handles)):
        tokens, finish = reference(oracle, prompt, max_new, sampling=sampling)
        completion = handle.result(60)
        assert (completion.tokens, completion.finish) == (tokens, finish), i
        if i % 2 == 0:
            assert iterated[i] == tokens, i
        else:
            assert awaited[i][:2] == (tokens, finish) and awaited[i][2] == completion, i
    serving.close()
    metrics = serving.metrics()
    assert serving.executor.sessions() == [] and not serving.healthy
    assert (metrics.submitted, metrics.completed, metrics.running, metrics.queued) == (len(requests), len(requests), 0, 0)
    assert metrics.output_tokens == sum(len(h.result().tokens) for h in handles)
    assert metrics.ttft_s.count == len(requests) and metrics.queue_wait_s.count == len(requests)
    speculative = serving.executor.cycle_stats().filter(pl.col("mode") != "target")
    assert metrics.cycles == speculative.height and metrics.tau == pytest.approx((speculative["accepted"] + 1).mean()) and metrics.tau > 1
    assert metrics.executes == serving.executor.execute_stats().height and metrics.itl_s.p99 >= metrics.itl_s.p50 > 0


def test_cancel_queued_now_running_at_the_next_gap(tiny, oracle):
    """Guards against a cancelled request keeping its session (cache row) or its place in the queue,
    against cancel racing the loop (a running request must stop between executes, keeping the
    tokens it already got), and against the serving loop stalling after cancels."""
    serving, backend = serving_over(tiny, max_running=1)
    backend.gate.clear()
    running = serving.submit([5, 6, 7], 40)
    assert backend.entered.wait(30)
    queued = serving.submit([8, 9], 40)
    queued.cancel()
    assert queued.result(5).finish == CANCELLED and queued.result().tokens == []
    running.cancel()
    backend.gate.set()
    result = running.result(30)
    expected, _ = reference(oracle, [5, 6, 7], 40)
    assert result.finish == CANCELLED and 1 <= len(result.tokens) < 40 and result.tokens == expected[: len(result.tokens)]
    assert serving.executor.sessions() == []
    after = serving.submit([8, 9], 6)
    assert after.result(30).tokens == reference(oracle, [8, 9], 6)[0]
    running.cancel()  # finished: a no-op
    assert serving.metrics().cancelled == 2
    serving.close()


def test_a_cancel_ends_the_running_execute_after_its_round(tiny, oracle):
    """Guards against a cancelled request decoding for nobody until its execute's end: with 32 cycles per execute
    its lane kept launching cycle after cycle after the cancel (device time its neighbours lose, its session held
    as long), and close(drain=False) waited for the same. The execute ends after the round the cancel came in;
    the tokens delivered are still the reference's prefix."""
    for close in (False, True):
        backend = GatedBackend(tiny.ort)
        serving = ServingLoop(Executor(backend, tiny.dims, 4, max_cycles=32), max_running=1)
        backend.gate.clear()
        running = serving.submit([5, 6, 7], 40)
        assert backend.entered.wait(30)  # held in the execute's first graph (the prefill)
        if close:
            serving.close(drain=False, timeout=0)
        else:
            running.cancel()
        backend.gate.set()
        result = running.result(30)
        serving.close()  # the execute ended: every launch counted
        expected, _ = reference(oracle, [5, 6, 7], 40)
        assert result.finish == CANCELLED and result.tokens == expected[: len(result.tokens)]
        assert backend.counts.get(c.DRAFT, 0) <= 2, (close, backend.counts)  # one round, and a launch read ahead
        assert serving.executor.sessions() == []


def test_a_stop_string_ends_the_running_execute_after_its_round(tiny, oracle):
    """Guards against a request cut at a stop string while its execute streams decoding on for nobody until
    the execute's end (its lane still launching, up to max_cycles cycles): the execute ends after the round
    the stop string was found in, so its cycles are those up to the stop and at most one read ahead."""
    tokenizer = CharTokenizer()
    prompt = "def f(x):"
    tokens, _ = reference(oracle, tokenizer.encode(prompt), 40)
    text = tokenizer.decode(tokens)
    stop = text[6:9]
    drafts = {}
    for stops in ([], [stop]):
        backend = GatedBackend(tiny.ort)
        serving = ServingLoop(Executor(backend, tiny.dims, 4, max_cycles=32), tokenizer=tokenizer, stream_interval=0.0)
        completion = serving.submit(prompt, 40, stop=stops).result(30)  # returns as the stop string streams
        serving.close()  # the execute ended: every launch counted
        drafts[bool(stops)] = backend.counts.get(c.DRAFT, 0)
        assert completion.tokens == tokens[: len(completion.tokens)]
    cut = text.index(stop) + len(stop)  # tokens (characters) up to the stop string's end
    assert drafts[True] <= cut + 2 < drafts[False], drafts  # a cycle yields >= 1 token: <= cut cycles, + the read-ahead


def test_queue_full_refuses_and_loses_no_accepted_request(tiny, oracle):
    """Guards against an unbounded queue (no backpressure), a refusal that still queues the request,
    and accepted requests lost or changed when the queue was full."""
    serving, backend = serving_over(tiny, max_queue=2, max_running=1)
    backend.gate.clear()
    first = serving.submit([5, 6, 7], 10)
    assert backend.entered.wait(30)
    accepted = [first, serving.submit([8, 9], 10), serving.submit([30, 31, 32], 10, temperature=0.8, seed=4)]
    with pytest.raises(QueueFullError, match="max_queue 2"):
        serving.submit([1], 10)
    assert (serving.metrics().queued, serving.metrics().rejected) == (2, 1)
    backend.gate.set()
    for handle, (prompt, sampling) in zip(accepted, [([5, 6, 7], Sampling()), ([8, 9], Sampling()), ([30, 31, 32], Sampling(0.8, 0, 1.0, 4))]):
        assert handle.result(30).tokens == reference(oracle, prompt, 10, sampling=sampling)[0]
    serving.close()


def test_a_failed_execute_fails_its_requests_and_the_engine_keeps_serving(tiny, oracle):
    """Guards against one failing backend run killing the serving loop, leaving the poisoned session
    open (a lost cache row), hanging the failed request's readers, or changing later requests."""
    serving, backend = serving_over(tiny, max_running=1)
    backend.gate.clear()
    doomed = serving.submit([5, 6, 7], 20)
    assert backend.entered.wait(30)
    later = [serving.submit([8, 9], 12), serving.submit([40, 41], 12, temperature=1.0, seed=9)]
    backend.fail_on = (c.TARGET_VERIFY, backend.counts.get(c.TARGET_VERIFY, 0) + 1)  # doomed's first verify
    backend.gate.set()
    with pytest.raises(PoisonedError, match="injected failure"):
        doomed.result(30)
    with pytest.raises(PoisonedError):
        list(doomed)
    assert later[0].result(30).tokens == reference(oracle, [8, 9], 12)[0]
    assert later[1].result(30).tokens == reference(oracle, [40, 41], 12, sampling=Sampling(1.0, 0, 1.0, 9))[0]
    metrics = serving.metrics()
    assert serving.healthy and serving.executor.sessions() == []
    assert (metrics.failed, metrics.completed, metrics.failed_executes) == (1, 2, 1)
    serving.close()


def test_a_cancelled_await_leaves_the_request_and_the_engine_alone(tiny, oracle):
    """Guards against a cancelled coroutine awaiting a handle cancelling the handle's shared future: the
    serving loop then failed completing that request (InvalidStateError) and stopped serving everyone."""
    serving, backend = serving_over(tiny)
    backend.gate.clear()
    handle = serving.submit([5, 6, 7], 20)
    assert backend.entered.wait(30)

    async def waits():
        return await handle

    async def cancel_a_waiter():
        task = asyncio.ensure_future(waits())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_a_waiter())
    backend.gate.set()
    assert handle.result(30).tokens == reference(oracle, [5, 6, 7], 20)[0]
    assert serving.submit([8, 9], 12).result(30).tokens == reference(oracle, [8, 9], 12)[0]
    assert serving.healthy
    serving.close()


POISON = 13  # a prompt holding this token fails its target prefill, every time (PoisonBackend)


class PoisonBackend(GatedBackend):
    """Fails every target_prefill whose tokens hold POISON: one request that can never run."""

    def run(self, graph, feeds, first_row):
        if c.parse_graph_name(graph)[0] == c.TARGET_PREFILL and POISON in feeds[c.TOKENS].flatten().tolist():
            raise RuntimeError("poison token in the prompt")
        return super().run(graph, feeds, first_row)


def test_a_bad_request_fails_alone_its_batch_neighbours_are_replayed(tiny, oracle):
    """Guards against one bad request failing every request batched with it: the failed batch's requests
    are replayed alone (a running one from its prompt + the tokens it already received), so only the bad
    one fails and the others' outputs (greedy and sampled) equal the reference."""
    backend = PoisonBackend(tiny.ort)
    serving = ServingLoop(Executor(backend, tiny.dims, 4, max_cycles=2), max_running=4)
    backend.gate.clear()
    running = serving.submit([5, 6, 7], 45)  # mid-stream when the batch fails: replayed from what it received
    assert backend.entered.wait(30)
    neighbours = [([8, 9], 20, Sampling()), ([40, 41, 42], 18, Sampling(1.0, 0, 1.0, 9))]
    first = submit(serving, *neighbours[0])
    bad = serving.submit([30, POISON, 31], 10)
    second = submit(serving, *neighbours[1])
    backend.gate.set()
    with pytest.raises(PoisonedError, match="poison token"):
        bad.result(30)
    assert running.result(30).tokens == reference(oracle, [5, 6, 7], 45)[0]
    for handle, (prompt, max_new, sampling) in zip((first, second), neighbours):
        assert handle.result(30).tokens == reference(oracle, prompt, max_new, sampling=sampling)[0]
    metrics = serving.metrics()
    assert (metrics.failed, metrics.completed, metrics.failed_executes) == (1, 3, 2)  # the batch, then the bad one alone
    assert serving.healthy and serving.executor.sessions() == []
    serving.close()


def test_close_drains_or_cancels_then_refuses(tiny, oracle):
    """Guards against close() dropping accepted requests (drain), hanging, or accepting new ones."""
    serving, _ = serving_over(tiny, max_running=2)
    handles = [serving.submit([5, 6, 7], 15), serving.submit([8, 9], 15), serving.submit([10], 15)]
    serving.close(drain=True)
    assert [h.result(0).tokens for h in handles] == [reference(oracle, p, 15)[0] for p in ([5, 6, 7], [8, 9], [10])]
    with pytest.raises(ServingClosedError):
        serving.submit([1], 3)

    serving, backend = serving_over(tiny, max_running=1)
    backend.gate.clear()
    handles = [serving.submit([5, 6, 7], 30), serving.submit([8, 9], 30)]
    assert backend.entered.wait(30)
    closer = threading.Thread(target=serving.close, kwargs={"drain": False})
    closer.start()
    backend.gate.set()
    closer.join(30)
    assert [h.result(0).finish for h in handles] == [CANCELLED, CANCELLED] and serving.executor.sessions() == []


def test_text_prompts_stop_strings_and_stop_tokens(tiny, oracle):
    """Guards against stop strings being matched on tokens instead of text, text after the stop being
    streamed, the request running on after its stop string (session kept), or the tokenizer's stop ids
    not being the default stop tokens."""
    tokenizer = CharTokenizer()
    serving, _ = serving_over(tiny, tokenizer=tokenizer)
    prompt = "def f(x):"
    tokens, _ = reference(oracle, tokenizer.encode(prompt), 30)
    text = tokenizer.decode(tokens)
    stop = text[9:12]
    cut = text.index(stop)
    handle = serving.submit(prompt, 30, stop=[stop, "never"])
    deltas = list(handle)
    completion = handle.result()
    assert completion.finish == STOP and completion.text == text[:cut] == "".join(d.text for d in deltas)
    assert completion.tokens == tokens[: cut + len(stop)]
    stop_token = tokens[4]
    by_token = serving.submit(prompt, 30, stop_ids=[stop_token]).result(30)
    assert by_token.tokens == tokens[: tokens.index(stop_token) + 1] and by_token.finish == STOP
    assert by_token.text == text[: tokens.index(stop_token)]  # the stop token's own text is not streamed
    serving.close()
    assert serving.executor.sessions() == []


@pytest.mark.parametrize(
    "kwargs, error, words, param, code",
    [
        (dict(prompt="text"), TokenizerError, "no tokenizer", "prompt", None),
        (dict(prompt=[1], stop="x"), TokenizerError, "stop strings need a tokenizer", "stop", None),
        (dict(prompt=[1], temperature=-1.0), SamplingError, "temperature", "temperature", None),
        (dict(prompt=[1], top_k=-1), SamplingError, "top_k", "top_k", None),
        (dict(prompt=[1], top_p=0.0), SamplingError, "top_p", "top_p", None),
        (dict(prompt=[1], seed=-3), SamplingError, "seed", "seed", None),
        (dict(prompt=[1] * 64), InputError, "got 64", "prompt", "context_length_exceeded"),
        (dict(prompt=[]), InputError, "got 0", "prompt", "invalid_value"),
        (dict(prompt=[1, 97]), InputError, "got 97", "prompt", None),
        (dict(prompt=[1], max_new_tokens=0), InputError, "max_new_tokens", "max_new_tokens", None),
        (dict(prompt=[1], stop_ids=[97]), InputError, "got 97", "stop", None),
    ],
)
def test_bad_submits_are_refused_in_the_callers_thread(tiny, kwargs, error, words, param, code):
    """Guards against a bad request reaching the serving loop (where it would fail a batch) instead of a
    typed error at submit naming the field, and against a server having to guess the field and the
    reason from the message (an empty prompt was reported as too long): the error carries ``param``
    and ``code``. Nothing is queued."""
    serving, _ = serving_over(tiny)
    with pytest.raises(error, match=words) as refused:
        serving.submit(**kwargs)
    assert (refused.value.param, refused.value.code) == (param, code)
    assert serving.metrics().submitted == 0
    serving.close()


def test_a_lone_surrogate_is_a_tokenizer_error_naming_the_prompt(tiny):
    """Guards against text that is not valid Unicode (a lone surrogate, which JSON can carry) escaping
    the tokenizer as a TypeError (a server's 500) instead of a typed error naming the prompt."""
    tokenizer = Tokenizer.from_dir(DEFAULT_PAIR_DIR / "target")
    serving, _ = serving_over(tiny, tokenizer=tokenizer)
    for text in ("a\ud800", "\udfff b"):
        with pytest.raises(TokenizerError, match="lone surrogate") as refused:
            serving.submit(text, 4)
        assert (refused.value.param, refused.value.code) == ("prompt", "invalid_value")
    assert serving.metrics().submitted == 0
    assert tokenizer.encode("def f():") == tokenizer.backend.encode("def f():", add_special_tokens=False).ids
    serving.close()


def test_max_queue_zero_accepts_exactly_while_a_session_is_free(tiny, oracle):
    """Guards against max_queue counting requests a free session takes at once as waiting: with
    max_queue=0 every request was refused, even with every session free."""
    serving, backend = serving_over(tiny, max_queue=0, max_running=2)
    backend.gate.clear()
    first = serving.submit([5, 6, 7], 6)
    assert backend.entered.wait(30)
    second = serving.submit([8, 9], 6)  # one session still free: taken at the next gap
    with pytest.raises(QueueFullError, match="max_queue 0"):
        serving.submit([1], 6)
    backend.gate.set()
    assert first.result(30).tokens == reference(oracle, [5, 6, 7], 6)[0]
    assert second.result(30).tokens == reference(oracle, [8, 9], 6)[0]
    assert serving.submit([1, 2], 4).result(30).tokens == reference(oracle, [1, 2], 4)[0]  # free again
    assert serving.metrics().rejected == 1
    serving.close()


def test_execute_counters_are_read_once_through_the_stats_api_and_old_rows_expire(tiny):
    """Guards against the serving loop's execute counters reading the stats log's private columns (a
    wall the stats API now owns), counting a row twice after a drain, or the log growing without bound
    by age when nobody drains it (a server's executor: rows older than stats_age_s are dropped)."""
    executor = Executor(RecordingBackend(tiny.ort), tiny.dims, 4, stats_age_s=0.2)
    serving = ServingLoop(executor)
    serving.submit([5, 6, 7], 12).result(30)
    first = executor.execute_stats()
    assert serving.metrics().executes == first.height and serving.metrics().cycles == int(first["cycles"].sum())
    executor.drain_stats()
    time.sleep(0.3)
    serving.submit([8, 9], 12).result(30)
    executes, cycles = executor.execute_stats(), executor.cycle_stats()
    assert executes.height >= 1 and executes["batch_id"].min() >= first.height  # drained rows never come back
    metrics = serving.metrics()
    assert metrics.executes == first.height + executes.height
    assert metrics.cycles == int(first["cycles"].sum()) + int(executes["cycles"].sum())
    rows = executor.execute_rows(0, ("batch_id",))
    assert rows.columns["batch_id"] == executes["batch_id"].to_list() and rows.next_batch == metrics.executes
    time.sleep(0.3)
    serving.submit([10], 1).result(30)  # one execute: the older batches expire at its end
    assert executor.execute_stats().height == 1 and set(executor.cycle_stats()["batch_id"].to_list()) <= {metrics.executes}
    assert executor.stats_dropped["executes"] == executes.height and executor.stats_dropped["cycles"] == cycles.height
    serving.close()


def test_the_devices_busy_time_reaches_the_metrics_and_prometheus(tiny):
    """Guards against a server that cannot say whether its device or its host is the limit: the time of the
    loop's launches (what the device loop's timeline accounts per launch) must be the execute table's
    ``loop_device_us``, the serving metrics' ``device_s`` and /metrics' dflash_trt_device_seconds_total,
    each the same sum, within the executes' wall time."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from dflash_trt.server.prometheus import ServingCollector

    executor = Executor(RecordingBackend(tiny.ort), tiny.dims, 4)
    serving = ServingLoop(executor)
    for prompt in ([5, 6, 7], [9, 10, 11, 12]):
        serving.submit(prompt, 20).result(60)
    serving.close()  # joins the loop: every execute row is recorded
    executes = executor.execute_stats()
    device_us = int(executes["loop_device_us"].sum())
    assert device_us == pytest.approx(executor.loop.timeline.busy_ms * 1000.0, abs=executes["loop_launches"].sum())  # µs rounded per launch
    assert 0 < device_us <= executes["wall_ms"].sum() * 1000.0
    assert serving.metrics().device_s == pytest.approx(device_us / 1e6)
    registry = CollectorRegistry()
    registry.register(ServingCollector(serving, "tiny"))
    families = text_string_to_metric_families(generate_latest(registry).decode())
    assert [s.value for f in families for s in f.samples if s.name == "dflash_trt_device_seconds_total"] == [pytest.approx(device_us / 1e6)]


def test_the_launches_shape_reaches_the_metrics_and_prometheus(tiny):
    """Guards against a server that cannot say how its launches are shaped under load (lanes per round,
    rounds per launch: what the serving thread's work per launch is spread over): the execute table's
    ``loop_launches``, ``loop_rounds`` and lane-rounds (owner-cycles and decode steps) must reach the serving
    metrics and /metrics as the same sums, for a drafting executor of several rounds per launch and a plain one."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from dflash_trt.server.prometheus import ServingCollector

    for speculate in (True, False):
        executor = Executor(tiny.ort, tiny.dims, 4, speculate=speculate, launch_rounds=2)
        serving = ServingLoop(executor)
        handles = [serving.submit(prompt, 20) for prompt in ([5, 6, 7], [9, 10, 11, 12], [4, 4])]
        assert all(len(h.result(60).tokens) == 20 for h in handles)
        serving.close()  # joins the loop: every execute row is recorded
        executes = executor.execute_stats()
        expected = {"loop_launches": int(executes["loop_launches"].sum()), "loop_rounds": int(executes["loop_rounds"].sum()),
                    "lane_rounds": int(executes["cycles"].sum() + executes["target_decode_steps"].sum())}
        assert 0 < expected["loop_launches"] <= expected["loop_rounds"] <= expected["lane_rounds"], expected
        assert (expected["loop_rounds"] > expected["loop_launches"]) and ((executes["cycles"].sum() > 0) == speculate), expected
        metrics = serving.metrics()
        assert {key: getattr(metrics, key) for key in expected} == expected
        registry = CollectorRegistry()
        registry.register(ServingCollector(serving, "tiny"))
        families = text_string_to_metric_families(generate_latest(registry).decode())
        scraped = {s.name.removeprefix("dflash_trt_").removesuffix("_total"): s.value for f in families for s in f.samples}
        assert {key: scraped[key] for key in expected} == expected


_counts = st.integers(0, 10**6)
_reads = st.builds(ExecuteTotals, cycles=_counts, accepted=_counts, executes=_counts, failed=_counts,
                   choices=st.dictionaries(st.sampled_from(("cycle", "decode")), _counts), verified=_counts, stopped=_counts,
                   device_s=st.floats(0, 10, allow_nan=False), launches=_counts, rounds=_counts, lane_rounds=_counts)


@settings(max_examples=50, deadline=None)
@given(st.lists(_reads, max_size=6))
def test_the_recorders_executor_totals_are_the_sums_of_its_reads(reads):
    """Guards against an executor counter lost on its way to the metrics (a field of ``ExecuteTotals`` not added
    up, a choice kind missing from one read dropped or overwriting the other's, a total read from the wrong field):
    after any sequence of reads the snapshot must show each counter's plain sum over them."""
    recorder = MetricsRecorder()
    for read in reads:
        recorder.executed(read)
    metrics = recorder.snapshot(running=0, queued=0)

    def total(name):
        return sum(getattr(read, name) for read in reads)

    assert (metrics.cycles, metrics.executes, metrics.failed_executes) == (total("cycles"), total("executes"), total("failed"))
    assert (metrics.policy_verified, metrics.drafting_stopped) == (total("verified"), total("stopped"))
    assert (metrics.loop_launches, metrics.loop_rounds, metrics.lane_rounds) == (total("launches"), total("rounds"), total("lane_rounds"))
    assert metrics.device_s == pytest.approx(total("device_s"))
    assert metrics.policy_choices == {kind: sum(read.choices.get(kind, 0) for read in reads) for kind in ("cycle", "decode")}
    assert metrics.tau == (1.0 + total("accepted") / total("cycles") if total("cycles") else None)


def test_metrics_memory_is_bounded_by_count_and_age_without_reads():
    """Guards against the metrics recorder growing without bound when nobody reads it (deliveries were
    trimmed only by snapshot()), and against histograms that disagree with the samples they count."""
    recorder = MetricsRecorder()
    start = time.perf_counter()
    gaps = [0.0003 * (1 + i % 7) ** 3 for i in range(3 * WINDOW_SAMPLES)]
    for i, gap in enumerate(gaps):
        now = start + i * 0.05  # 10 minutes of deliveries, 20 a second
        recorder.delivered(now, 3, None, gap)
        assert len(recorder.deliveries) <= RATE_WINDOW_S / RATE_BUCKET_S + 1
    window = recorder.latencies["itl_s"].window
    assert len(window) == WINDOW_SAMPLES and window[0][0] >= start + len(gaps) * 0.05 - WINDOW_S - 0.05
    histogram = recorder.latencies["itl_s"].histogram()
    cumulative = dict(histogram.cumulative())
    for bound in LATENCY_BUCKETS_S:
        assert cumulative[repr(bound)] == sum(gap <= bound for gap in gaps)
    assert cumulative["+Inf"] == histogram.count == len(gaps) and histogram.sum == pytest.approx(sum(gaps))


def test_tokens_stream_after_each_launch_not_each_execute(tiny, oracle):
    """Guards against the stream gap growing with max_cycles: tokens reached the handle only when the
    whole execute (up to max_cycles launches) returned, so at high load a client waited for every
    cycle of every lane of the batch. Each launch's final tokens can be delivered as it is read
    (stream_interval 0); a longer interval coalesces them (one delivery per execute here), the
    tokens the same either way."""
    deliveries = {}
    for interval in (0.0, 60.0):
        serving = ServingLoop(Executor(GatedBackend(tiny.ort), tiny.dims, 4, max_cycles=8), stream_interval=interval)
        with serving:
            deltas = [d for d in serving.submit([5, 6, 7], 30) if d.tokens]
            executes = serving.metrics().executes
        tokens = [t for d in deltas for t in d.tokens]
        assert (tokens, deltas[-1].finish) == reference(oracle, [5, 6, 7], 30)
        deliveries[interval] = len(deltas)
    assert deliveries[0.0] > executes  # several deliveries inside one execute
    assert deliveries[60.0] <= executes + 1  # the first token at once, then one per execute


class EveryRunGated(GatedBackend):
    """``GatedBackend`` whose row-indexed runs (the torch fast path's programs) wait at the gate too."""

    def run_at(self, graph, feeds, slots):
        if not self.gate.is_set():
            self.entered.set()
            assert self.gate.wait(30), "gate never opened"
        return super().run_at(graph, feeds, slots)


@pytest.mark.parametrize("backend", ["onnxruntime", "torch-fast"])
def test_requests_arriving_during_an_execute_join_it_at_its_next_round(tiny, oracle, backend):
    """Guards against a request that arrives while an execute runs waiting for that execute's end (or
    ending it early: an execute boundary per arrival, host work with the device idle at many streams),
    and against joining changing any output: with ``join_running`` the requests submitted while the
    first request's execute is held join that same execute (its stats row counts their inputs) and every
    output, greedy and sampled, equals the reference; without it they join at the gap after it."""
    from executor_fixtures import tiny_dims

    dims = tiny.dims if backend == "onnxruntime" else tiny_dims(tiny.target, tiny.draft, tiny.dims.max_context)
    later = [([9, 4, 11, 3], 12, Sampling()), ([7, 7, 2], 12, Sampling(temperature=0.8, top_k=20, seed=3))]
    for join in (True, False):
        inner = tiny.ort if backend == "onnxruntime" else tiny.torch_backend(dims, TINY_ROWS, "fast")
        gated = EveryRunGated(inner)
        serving = ServingLoop(Executor(gated, dims, TINY_ROWS, max_cycles=16), join_running=join)
        gated.gate.clear()
        first = serving.submit([5, 6, 7], 40)
        assert gated.entered.wait(30)  # held inside the first execute
        handles = [submit(serving, *request) for request in later]
        gated.gate.set()
        assert (first.result(30).tokens, first.result().finish) == reference(oracle, [5, 6, 7], 40)
        for (prompt, max_new, sampling), handle in zip(later, handles):
            assert (handle.result(30).tokens, handle.result().finish) == reference(oracle, prompt, max_new, sampling=sampling)
        serving.close()
        inputs = serving.executor.execute_stats()["inputs"].to_list()
        assert inputs[0] == (3 if join else 1), (join, inputs)
        assert serving.executor.sessions() == []
        if inner is not tiny.ort:
            inner.close()


def test_held_tokens_of_every_request_go_out_on_one_tick(tiny, oracle, monkeypatch):
    """Guards against each request keeping its own delivery timer while an execute streams (requests that
    joined at different rounds then delivered in different rounds: with an HTTP front, one message per
    round rather than per tick, each a wake-up, pickle and send on threads sharing the serving loop's
    GIL; at 64 streams that cost the server a fifth of its throughput once executes ran long): a request
    admitted mid-execute delivers its held tokens on the same ticks as the one already running, its first
    token and its end at once, and both outputs equal the reference. Time is a fake clock advanced by
    each graph run, so which round a tick falls in is fixed."""
    from types import SimpleNamespace

    from dflash_trt.runtime import executor as executor_module
    from dflash_trt.runtime.serving import loop as loop_module
    from dflash_trt.runtime.serving.handle import RequestHandle

    clock = [0.0]
    for module in (loop_module, executor_module):  # the loop's clock, and the executor's, which holds the tokens
        monkeypatch.setattr(module, "time", SimpleNamespace(perf_counter=lambda: clock[0]))

    class Ticking(RecordingBackend):
        def run(self, graph, feeds, first_row):
            clock[0] += 1.0
            return super().run(graph, feeds, first_row)

    deliveries: dict[int, list[tuple[float, bool]]] = {}  # request -> (fake time, ended) per delivery
    later: list = []

    class Recorded(RequestHandle):
        def _push(self, delta):
            deliveries.setdefault(self.id, []).append((clock[0], delta.finish is not None))
            if self.id == 0 and len(deliveries[0]) == 1:  # the first request streams: the second arrives now
                later.append(serving.submit([9, 4, 11, 3], 30))
            super()._push(delta)

    serving = ServingLoop(Executor(Ticking(tiny.ort), tiny.dims, 4, max_cycles=32), stream_interval=10.0, handles=Recorded)
    first = serving.submit([5, 6, 7], 40)
    assert (first.result(30).tokens, first.result().finish) == reference(oracle, [5, 6, 7], 40)
    assert (later[0].result(30).tokens, later[0].result().finish) == reference(oracle, [9, 4, 11, 3], 30)
    serving.close()
    assert serving.executor.execute_stats()["inputs"].to_list()[0] == 2  # the second joined the running execute
    ended = {request: max(t for t, _ in times) for request, times in deliveries.items()}
    ticks_of_first = {t for t, done in deliveries[0][1:] if not done}
    middle = [t for t, done in deliveries[1][1:] if not done and t < ended[0]]  # while the first still streams
    assert middle and all(t in ticks_of_first for t in middle), (deliveries, middle)


def test_a_request_admitted_mid_execute_can_be_cancelled_there(tiny, oracle):
    """Guards against a request that joined a running execute being unknown at the next gap (its session is
    opened by the executor inside the call; the batcher learns it from the call's outputs): cancelled while
    that execute streams, it ends CANCELLED with a prefix of the reference, its session is closed at the
    gap, and the request it joined finishes as the reference."""
    from dflash_trt.runtime.serving.handle import RequestHandle

    later: list = []

    class Hooked(RequestHandle):
        def _push(self, delta):
            super()._push(delta)
            if self.id == 0 and not later:  # the first request streams: the second arrives now
                later.append(serving.submit([9, 4, 11, 3], 30))
            elif self.id == 1 and len(self._deltas) == 1:  # the second's first token: cancel it inside the execute
                self.cancel()

    serving = ServingLoop(Executor(RecordingBackend(tiny.ort), tiny.dims, 4, max_cycles=32), stream_interval=0.0, handles=Hooked)
    first = serving.submit([5, 6, 7], 40)
    assert (first.result(30).tokens, first.result().finish) == reference(oracle, [5, 6, 7], 40)
    cancelled = later[0].result(30)
    expected, _ = reference(oracle, [9, 4, 11, 3], 30)
    assert cancelled.finish == CANCELLED and 1 <= len(cancelled.tokens) < 30 and cancelled.tokens == expected[: len(cancelled.tokens)]
    serving.close()  # the loop's thread ended: the executor is free to ask
    assert serving.executor.execute_stats()["inputs"].to_list()[0] == 2  # it had joined the running execute
    assert serving.executor.sessions() == []
