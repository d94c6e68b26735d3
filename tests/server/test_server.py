"""``dflash-trt serve`` as a live subprocess on 127.0.0.1, driven by the official openai client and raw
HTTP: outputs against the reference decoder, streaming, stop sequences, 32 concurrent clients,
disconnects, OpenAI-style errors and backpressure, the bounds on what a client can make the server read
(body size, read deadline, text length), strict types, the drain on SIGTERM, vLLM's conventions, and
``dflash-trt bench --serve``. The shipped default pair, exported once per run (conftest
``default_pair_cache``); a failing backend is served in-process over the tiny export. Every loop is
bounded in count and time. The main server runs the default mode (the HTTP front and the serving
process apart: ``--front-process``), the small one a single process (``--no-front-process``, what Ray
replicas run), so each test of a route runs in the mode of the server it uses; the serving process's
death is tested on a server of its own."""

from __future__ import annotations

import argparse
import math
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dflash_trt.cli import main as cli_main
from dflash_trt.errors import ServingError, UsageError
from dflash_trt.export import contract as c
from dflash_trt.export.pair import DEFAULT_PAIR_DIR, load_pair
from dflash_trt.export.reference import ReferenceDecoder
from dflash_trt.export.sampling import Sampling
from dflash_trt.export.tokenizer import Tokenizer
from dflash_trt.server import command
from dflash_trt.server.command import DEFAULT_PAIR_MODEL as MODEL

ALIAS = "dflash-alias"
BODY_LIMIT = 1_000_000
READ_TIMEOUT_S = 1.0
TEMPLATE = "{% for m in messages %}### {{ m['role'] }}:\n{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}### assistant:\n{% endif %}"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Server:
    """One ``dflash-trt serve`` subprocess over the cached default-pair export."""

    def __init__(self, cache: Path, log: Path, *flags: str) -> None:
        self.port, self.log = free_port(), log
        self.flags = flags
        command = [sys.executable, "-m", "dflash_trt.cli", "serve", "--cache", str(cache), "--port", str(self.port), "--threads", "1", "--shutdown-timeout", "2", *flags]
        self.process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=os.environ.copy())
        self.base = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"server exited:\n{self.log.read_text()[-3000:]}"
            try:
                if self.get("/health")[0] == 200:
                    return
            except OSError:
                time.sleep(0.3)
        raise AssertionError(f"server not ready after {timeout} s:\n{self.log.read_text()[-3000:]}")

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base}/v1", api_key="unused", max_retries=0, timeout=120)

    def get(self, path: str) -> tuple[int, str]:
        with urllib.request.urlopen(self.base + path, timeout=30) as response:
            return response.status, response.read().decode()

    def post(self, path: str, body: bytes) -> tuple[int, dict]:
        request = urllib.request.Request(self.base + path, data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())

    def metrics(self) -> dict[tuple[str, str], float]:
        """(sample name, outcome label or '') -> value."""
        families = text_string_to_metric_families(self.get("/metrics")[1])
        return {(s.name, s.labels.get("outcome", "")): s.value for f in families for s in f.samples}

    def wait_queued(self, count: int, timeout: float = 30.0) -> bool:
        """Whether the server reports ``count`` accepted requests waiting for a session within ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while self.metrics().get(("dflash_trt_requests_queued", "")) != count:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True

    @contextmanager
    def reaped(self):
        """The body's server process is killed if it still runs when the body ends (a test that failed
        before the server exited must not leave it behind)."""
        try:
            yield
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()

    def stop(self) -> None:
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@pytest.fixture(scope="module")
def servers(default_pair_cache, tmp_path_factory):
    """(main server: the front in its own process (the default), 8 sessions, a chat template, two served
    names, a 1 MB body limit, a throughput line a second; small server: one process, 1 session, queue of 1,
    the torch backend straight from the checkpoints, --no-draft, the shipped chat template, a 1 s read
    deadline, HTTP parsed by httptools), started together."""
    root = tmp_path_factory.mktemp("serve")
    (root / "chat.jinja").write_text(TEMPLATE)
    main = Server(default_pair_cache, root / "main.log", "--max-sessions", "8", "--chat-template", str(root / "chat.jinja"),
                  "--served-model-name", MODEL, ALIAS, "--max-body-bytes", str(BODY_LIMIT), "--log-interval", "1")
    small = Server(default_pair_cache, root / "small.log", "--no-front-process", "--max-sessions", "1", "--max-queue", "1", "--backend", "torch", "--no-draft",
                   "--read-timeout", str(READ_TIMEOUT_S), "--http", "httptools")
    try:
        main.wait_ready()
        small.wait_ready()
        yield main, small
    finally:
        main.stop()
        small.stop()
    assert main.process.returncode == 0, main.log.read_text()[-3000:]
    assert small.process.returncode == 0, small.log.read_text()[-3000:]  # one process stops cleanly too


@pytest.fixture(scope="module")
def server(servers):
    return servers[0]


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = Tokenizer.from_dir(DEFAULT_PAIR_DIR / "target")
    tokenizer.chat_template = TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def reference(tokenizer):
    """(prompt text or ids, max_tokens, temperature, top_p, seed) -> (text, finish, completion tokens): the
    target-only reference decoder (PyTorch eager), stopping at the tokenizer's stop ids."""
    decoder = ReferenceDecoder(load_pair(DEFAULT_PAIR_DIR / "target", DEFAULT_PAIR_DIR / "draft")[0])

    def expected(prompt, max_tokens, temperature=0.0, top_p=1.0, seed=0):
        ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        tokens = decoder.generate_target(ids, max_tokens, Sampling(temperature, 0, top_p, seed), stop=tokenizer.stop_ids).tokens
        stopped = bool(tokens) and tokens[-1] in tokenizer.stop_ids
        return tokenizer.decode(tokens[:-1] if stopped else tokens), "stop" if stopped else "length", len(tokens)

    return expected


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    rows = [json.loads(line) for line in (DEFAULT_PAIR_DIR / "prompts.jsonl").read_text().splitlines() if line.strip()]
    return [row["prompt"][-160:] for row in rows]


def test_models_health_and_metrics(server):
    """Guards against the discovery and monitoring routes missing or not in their formats (OpenAI list,
    Prometheus text a Prometheus parser reads), latencies exposed as quantile gauges where Prometheus
    users expect histograms, and --served-model-name not listing (or not accepting) every name."""
    assert [m.id for m in server.client().models.list()] == [MODEL, ALIAS]
    assert server.client().models.list().data[0].max_model_len == 1024
    assert server.get("/health") == (200, '{"status":"ok","speculate":true}')
    metrics = server.metrics()
    assert ("dflash_trt_requests_running", "") in metrics and ("dflash_trt_requests_total", "rejected") in metrics
    kinds = {f.name: f.type for f in text_string_to_metric_families(server.get("/metrics")[1])}
    for name in ("time_to_first_token", "inter_token_latency", "queue_wait", "e2e_request_latency"):
        assert kinds[f"dflash_trt_{name}_seconds"] == "histogram", name
    assert kinds["dflash_trt_policy_choices"] == "counter"  # the speculation policy's choices reach the front's /metrics
    before = server.metrics()
    done = server.client().completions.create(model=ALIAS, prompt="def f(x):", max_tokens=6, temperature=0)
    assert done.model == ALIAS
    after = server.metrics()
    for name in ("time_to_first_token", "e2e_request_latency", "queue_wait"):
        key = (f"dflash_trt_{name}_seconds_count", "")
        assert after[key] - before[key] == 1, name


def test_completions_chat_and_streams_equal_the_reference(server, reference, prompts, tokenizer):
    """Guards against the HTTP layer changing outputs: text and token-id prompts, greedy and seeded
    sampling, chat through the template, SSE streams (deltas must concatenate to the same text, with the
    finish reason and usage) — each equal to the target-only reference."""
    client = server.client()
    greedy = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=24, temperature=0)
    text, finish, count = reference(prompts[0], 24)
    assert (greedy.choices[0].text, greedy.choices[0].finish_reason, greedy.usage.completion_tokens) == (text, finish, count)
    assert greedy.usage.prompt_tokens == len(tokenizer.encode(prompts[0]))
    ids = tokenizer.encode(prompts[1])
    sampled = client.completions.create(model=MODEL, prompt=ids, max_tokens=20, temperature=0.8, top_p=0.95, seed=7)
    assert sampled.choices[0].text == reference(ids, 20, 0.8, 0.95, 7)[0]
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    chat_text = reference(tokenizer.apply_chat(messages), 20)[0]
    assert chat.choices[0].message.content == chat_text and chat.choices[0].message.role == "assistant"

    events = list(client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=24, temperature=0, stream=True, stream_options={"include_usage": True}))
    assert "".join(e.choices[0].text for e in events if e.choices) == text
    assert [e.choices[0].finish_reason for e in events if e.choices][-1] == finish and events[-1].usage.completion_tokens == count
    assert len([e for e in events if e.choices]) > 1  # streamed, not one block
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat_text and chunks[0].choices[0].delta.role == "assistant"


def test_stop_sequences_cut_the_text_streamed_or_not(server, reference, prompts):
    """Guards against stop strings matched per token instead of on the detokenized text, text past the
    stop being returned (or streamed before the stop was recognised), or a wrong finish reason."""
    client = server.client()
    full = reference(prompts[2], 40)[0]
    stop = full[12:16]
    cut = full[: full.index(stop)]
    done = client.completions.create(model=MODEL, prompt=prompts[2], max_tokens=40, temperature=0, stop=[stop, "\x00never"])
    assert (done.choices[0].text, done.choices[0].finish_reason) == (cut, "stop")
    events = list(client.completions.create(model=MODEL, prompt=prompts[2], max_tokens=40, temperature=0, stop=stop, stream=True))
    assert "".join(e.choices[0].text for e in events) == cut and events[-1].choices[0].finish_reason == "stop"


def test_no_draft_server_equals_speculation_and_the_reference(servers, reference, prompts):
    """Guards against --no-draft not switching speculation off, or plain decoding through the serving loop
    changing outputs: the server started with --no-draft (torch backend from the checkpoints) says so in
    /health and /v1/models, runs no speculative cycle, and returns the same greedy completions as the
    speculative server and the target-only reference."""
    main, plain = servers
    assert plain.get("/health") == (200, '{"status":"ok","speculate":false}')
    listed = plain.client().models.list().data[0]
    assert (listed.id, listed.speculate, listed.max_sessions) == (MODEL, False, 1)
    assert main.client().models.list().data[0].speculate is True
    for prompt in prompts[5:7]:
        text, finish, count = reference(prompt, 24)
        for server in (main, plain):
            done = server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
            assert (done.choices[0].text, done.choices[0].finish_reason, done.usage.completion_tokens) == (text, finish, count), server.log
    assert plain.metrics()[("dflash_trt_cycles_total", "")] == 0 < main.metrics()[("dflash_trt_cycles_total", "")]


CONCURRENT, NEW_TOKENS = 32, 16


@pytest.fixture(scope="module")
def concurrent(server, prompts) -> list[tuple[dict, str]]:
    """32 clients at once (a barrier releases them together): (request, text) each; odd ones greedy,
    even ones sampled (seed 100 + i, top_p 1 or 0.9)."""
    client = server.client()
    requests = [dict(prompt=prompts[i], max_tokens=NEW_TOKENS, temperature=0.0 if i % 2 else 0.9, top_p=1.0 if i % 4 < 2 else 0.9, seed=100 + i) for i in range(CONCURRENT)]
    barrier = threading.Barrier(CONCURRENT)

    def send(request):
        barrier.wait(30)
        return client.completions.create(model=MODEL, **request).choices[0].text

    with ThreadPoolExecutor(CONCURRENT) as pool:
        return list(zip(requests, pool.map(send, requests)))


def test_32_concurrent_clients_equal_alone_and_the_reference(server, concurrent, reference):
    """Guards against batching across concurrent HTTP requests changing any output (lossless and
    batch-independent): each response, greedy or sampled, equals the target-only reference with the same
    seed, and equals the same request sent alone."""
    for i, (request, text) in enumerate(concurrent):
        assert text == reference(request["prompt"], NEW_TOKENS, request["temperature"], request["top_p"], request["seed"])[0], i
    client = server.client()
    for i in (1, 3, 0, 2, 20, 24):
        request, text = concurrent[i]
        assert client.completions.create(model=MODEL, **request).choices[0].text == text, i


def test_client_disconnect_mid_stream_cancels_and_frees_the_session(server, prompts):
    """Guards against a vanished streaming client keeping its session decoding to max_tokens (a cache row
    and compute lost per dropped connection)."""
    before = server.metrics()
    stream = server.client().completions.create(model=MODEL, prompt=prompts[3], max_tokens=800, temperature=0, stream=True)
    for _, _event in zip(range(2), stream):
        pass
    stream.close()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        metrics = server.metrics()
        if metrics[("dflash_trt_requests_running", "")] == 0:
            break
        time.sleep(0.1)
    assert metrics[("dflash_trt_requests_running", "")] == 0
    assert metrics[("dflash_trt_requests_total", "cancelled")] == before[("dflash_trt_requests_total", "cancelled")] + 1
    assert metrics[("dflash_trt_output_tokens_total", "")] - before[("dflash_trt_output_tokens_total", "")] < 800


def test_client_gone_before_a_whole_completion_cancels_it(servers, prompts):
    """Guards against a non-streaming request decoding to max_tokens after its client went away (the
    handler waited on the completion alone, never on the connection)."""
    plain = servers[1]  # plain decoding on one session: 900 tokens take seconds
    before = plain.metrics()
    with pytest.raises(openai.APITimeoutError):
        plain.client().with_options(timeout=0.5).completions.create(model=MODEL, prompt=prompts[3], max_tokens=900, temperature=0)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        metrics = plain.metrics()
        if metrics[("dflash_trt_requests_running", "")] + metrics[("dflash_trt_requests_queued", "")] == 0:
            break
        time.sleep(0.1)
    assert metrics[("dflash_trt_requests_running", "")] + metrics[("dflash_trt_requests_queued", "")] == 0
    assert metrics[("dflash_trt_requests_total", "cancelled")] == before[("dflash_trt_requests_total", "cancelled")] + 1
    assert metrics[("dflash_trt_output_tokens_total", "")] - before[("dflash_trt_output_tokens_total", "")] < 900
    assert plain.get("/health")[0] == 200


BAD = [  # (body, status, words in the message, param, code)
    (b'{"model": "m", "prompt": "x",', 400, "parse the JSON", None, None),
    (b'{"model": "%s", "prompt": "a\\ud800"}' % MODEL.encode(), 400, "parse the JSON", None, None),  # a lone surrogate
    (json.dumps({"model": MODEL, "prompt": "x", "max_tokens": True}).encode(), 400, "valid integer", "max_tokens", None),
    (json.dumps({"model": MODEL, "prompt": "x", "max_tokens": "4"}).encode(), 400, "valid integer", "max_tokens", None),
    (json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 4.0}).encode(), 400, "valid integer", "max_tokens", None),
    (json.dumps({"model": MODEL, "prompt": "x", "temperature": True}).encode(), 400, "valid number", "temperature", None),
    (json.dumps({"model": MODEL, "prompt": "x", "stream": "yes"}).encode(), 400, "valid boolean", "stream", None),
    (json.dumps({"model": MODEL, "prompt": "x", "stop": list("abcde")}).encode(), 400, "at most 4 strings", "stop", None),
    (json.dumps({"model": MODEL, "prompt": ""}).encode(), 400, "got 0", "prompt", "invalid_value"),
    (json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 1024}).encode(), 400, "maximum context length is 1024", "max_tokens", "context_length_exceeded"),
    (json.dumps({"model": MODEL, "prompt": [7] * 1000, "max_tokens": 25}).encode(), 400, "1025 tokens", "max_tokens", "context_length_exceeded"),
    (json.dumps({"model": MODEL, "prompt": "def f():\n" * 12000}).encode(), 400, "108000 characters", "prompt", "context_length_exceeded"),
    (json.dumps({"model": MODEL, "prompt": "x", "frobnicate": 1}).encode(), 400, "Unrecognized request argument supplied: frobnicate", "frobnicate", None),
    (json.dumps({"model": MODEL, "prompt": "x", "temperature": 5}).encode(), 400, "temperature", "temperature", None),
    (json.dumps({"model": MODEL, "prompt": "x", "n": 2}).encode(), 400, "n:", "n", None),
    (json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 0}).encode(), 400, "max_tokens", "max_tokens", None),
    (json.dumps({"model": MODEL, "prompt": "x", "top_p": 0}).encode(), 400, "top_p", "top_p", None),
    (json.dumps({"model": MODEL, "prompt": "x", "seed": -1}).encode(), 400, "seed", "seed", None),
    (json.dumps({"model": MODEL, "prompt": ["a", "b"]}).encode(), 400, "one string or one list of token ids", "prompt", None),
    (json.dumps({"model": MODEL, "prompt": [1, 99999]}).encode(), 400, "99999", "prompt", None),
    (json.dumps({"model": MODEL, "prompt": [5] * 1024}).encode(), 400, "your prompt has 1024 tokens", "prompt", "context_length_exceeded"),
    (json.dumps({"model": "other", "prompt": "x"}).encode(), 404, "does not exist", "model", "model_not_found"),
    (json.dumps({"prompt": "x"}).encode(), 400, "model", "model", None),
]


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, reference, prompts):
    """Guards against malformed or out-of-range requests crashing a handler, reaching the serving loop, being
    silently clamped, or answered in a shape the openai client cannot read; against loose types (true or
    "4" for max_tokens, true for temperature, "yes" for stream), a lone surrogate answered with a
    plain-text 500, an empty prompt reported as too long, five stop strings named as another problem,
    max_tokens past the context silently capped (vLLM answers 400), a text far past the context
    tokenized before it is refused; every error names its field (param) and reason (code) from the
    typed errors. The server must serve on."""
    for body, status, words, param, api_code in BAD:
        code, error = server.post("/v1/completions", body)
        assert code == status and words in error["error"]["message"], (body[:80], code, error)
        assert set(error["error"]) == {"message", "type", "param", "code"}
        assert (error["error"]["param"], error["error"]["code"]) == (param, api_code), (body[:80], error)
    code, error = server.post("/v1/chat/completions", json.dumps({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}).encode())
    assert code == 400 and "messages.0.role" == error["error"]["param"]
    code, error = server.post("/v1/chat/completions", b'{"model": "%s", "messages": [{"role": "user", "content": "\\udc00"}]}' % MODEL.encode())
    assert code == 400 and "parse the JSON" in error["error"]["message"]
    code, error = server.post("/v1/chat/completions", json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * 70000}]}).encode())
    assert code == 400 and (error["error"]["param"], error["error"]["code"]) == ("messages", "context_length_exceeded")
    with pytest.raises(openai.BadRequestError, match="Unrecognized request argument"):
        server.client().completions.create(model=MODEL, prompt="x", extra_body={"logit_bias_v2": {}})
    with pytest.raises(openai.NotFoundError):
        server.client().completions.create(model="gpt-4", prompt="x")
    assert server.get("/health")[0] == 200
    done = server.client().completions.create(model=MODEL, prompt=prompts[4], max_tokens=8, temperature=0)
    assert done.choices[0].text == reference(prompts[4], 8)[0]


def test_queue_full_gets_429_and_no_accepted_request_is_lost(servers, reference, prompts):
    """Guards against an unbounded queue under overload, a refusal without a retryable status, and an
    accepted request lost or changed while others were refused."""
    small = servers[1]
    client = small.client()
    before = small.metrics()
    barrier = threading.Barrier(6)

    def send(i):
        barrier.wait(30)
        try:
            return client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=48, temperature=0).choices[0].text
        except openai.RateLimitError as error:
            assert error.status_code == 429 and "queue is full" in error.message
            return None

    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(send, range(6)))
    accepted = [i for i, text in enumerate(results) if text is not None]
    assert 2 <= len(accepted) < 6, results
    for i in accepted:
        assert results[i] == reference(prompts[i], 48)[0], i
    metrics = small.metrics()
    for outcome, count in (("rejected", 6 - len(accepted)), ("completed", len(accepted))):
        assert metrics[("dflash_trt_requests_total", outcome)] - before[("dflash_trt_requests_total", outcome)] == count, outcome


@pytest.mark.parametrize("flags", [["--dtype", "bf16"], ["--max-owners", "2", "--backend", "onnxruntime"], ["--dtype", "fp16", "--backend", "torch", "--artifacts", "x"]])
def test_dtype_and_max_owners_only_where_they_apply(flags):
    """Guards against --dtype / --max-owners being silently ignored where an artifact set (or the default
    ONNX export) fixes the geometry: refused before anything is exported or loaded."""
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    with pytest.raises(UsageError, match="--dtype and --max-owners apply to --backend torch without --artifacts"):
        command.run(parser.parse_args(flags))


def test_launch_rounds_default_to_several_on_cuda_and_one_on_the_cpu():
    """Guards against serve's rounds per launch ignoring where the engine runs: several back to back on a
    CUDA device (launches queue there, and the serving thread's work is per launch), one on the CPU (a
    launch computes before it returns: rounds back to back save nothing and discard more at a request's
    end), and against an asked --launch-rounds being overridden by either default."""
    import torch

    from dflash_trt.runtime.limits import SERVE_CUDA_LAUNCH_ROUNDS

    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    assert parser.parse_args([]).launch_rounds is None and parser.parse_args(["--launch-rounds", "2"]).launch_rounds == 2
    on = {kind: argparse.Namespace(device=torch.device(kind)) for kind in ("cpu", "cuda")}  # what the rule reads of a backend
    assert SERVE_CUDA_LAUNCH_ROUNDS > 1
    assert command.launch_rounds(None, on["cuda"]) == SERVE_CUDA_LAUNCH_ROUNDS and command.launch_rounds(None, on["cpu"]) == 1
    assert command.launch_rounds(1, on["cuda"]) == 1 and command.launch_rounds(3, on["cpu"]) == 3


def raw_request(port: int, head: bytes, body_chunks=(), timeout: float = 10.0) -> bytes:
    """Send a request head and body chunks on a fresh socket (stopping once the server answers or
    closes), then read until the server closes: the raw response bytes."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(head)
        for chunk in body_chunks:
            try:
                sock.sendall(chunk)
            except OSError:  # the server answered and closed while the body was still coming
                break
        response = b""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                data = sock.recv(65536)
            except OSError:
                break
            if not data:
                break
            response += data
        return response


def test_an_oversized_body_gets_413_before_it_is_read_and_the_server_serves_on(server, reference, prompts):
    """Guards against a body of any size being read into memory (and parsed on the event loop): a body
    over --max-body-bytes is answered 413 in OpenAI's format as soon as its declared length, or the bytes
    received so far, pass the limit; the connection closes and the server serves on."""
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {50 << 20}\r\n\r\n").encode()
    declared = raw_request(server.port, head, [b" " * 65536])
    assert declared.startswith(b"HTTP/1.1 413") and b"connection: close" in declared.lower()
    assert json.loads(declared.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_too_large"
    chunked = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    chunks = [b"%x\r\n%s\r\n" % (65536, b" " * 65536) for _ in range(2 * BODY_LIMIT // 65536)]
    streamed = raw_request(server.port, chunked, chunks)
    assert streamed.startswith(b"HTTP/1.1 413") and b"--max-body-bytes" in streamed
    assert server.get("/health")[0] == 200
    done = server.client().completions.create(model=MODEL, prompt=prompts[4], max_tokens=6, temperature=0)
    assert done.choices[0].text == reference(prompts[4], 6)[0]


def test_half_sent_and_idle_connections_are_closed_at_the_read_deadline(servers):
    """Guards against idle or half-sent connections staying open forever (170 sockets with partial
    headers were still open after 21 s): each is closed at --read-timeout while /health answers; a
    request sent in time is served."""
    small = servers[1]
    sockets = [socket.create_connection(("127.0.0.1", small.port), timeout=10) for _ in range(24)]
    try:
        for i, sock in enumerate(sockets):
            if i % 3 == 1:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")  # a head that never ends
            elif i % 3 == 2:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")  # a body that never ends
        assert small.get("/health")[0] == 200
        opened = time.monotonic()
        for sock in sockets:
            assert sock.recv(1024) == b""  # closed by the server (recv times out after 10 s otherwise)
        assert time.monotonic() - opened < READ_TIMEOUT_S + 5
    finally:
        for sock in sockets:
            sock.close()
    assert small.get("/health")[0] == 200


def test_the_default_pair_ships_a_chat_template(servers, reference, tokenizer):
    """Guards against chat completions answering 400 out of the box (no template shipped with the default
    pair): the server without --chat-template renders the pair's chat_template.jinja exactly as Hugging
    Face transformers does, and answers with the reference continuation."""
    from transformers import AutoTokenizer

    small = servers[1]
    messages = [{"role": "system", "content": "Add numbers.\nBe short."}, {"role": "user", "content": "def add(a, b):"}]
    rendered = AutoTokenizer.from_pretrained(DEFAULT_PAIR_DIR / "target").apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == Tokenizer.from_dir(DEFAULT_PAIR_DIR / "target").apply_chat(messages)
    chat = small.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    assert chat.choices[0].message.content == reference(rendered, 12)[0]
    assert chat.usage.prompt_tokens == len(tokenizer.encode(rendered))


def test_request_ids_are_unique_uuids_and_the_log_says_what_the_server_does(server):
    """Guards against request ids restarting at cmpl-0 on every start (ids must be unique across
    restarts: uuid4), and against a server silent at the default log level (vLLM logs its start and a
    throughput line periodically)."""
    client = server.client()
    ids = [client.completions.create(model=MODEL, prompt="import os", max_tokens=2, temperature=0).id for _ in range(3)]
    ids.append(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x = 1"}], max_tokens=2).id)
    assert len(set(ids)) == 4 and all(re.fullmatch(r"(cmpl|chatcmpl)-[0-9a-f]{32}", i) for i in ids), ids
    deadline = time.monotonic() + 5
    while "throughput: prompt" not in server.log.read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    log = server.log.read_text()
    assert f"serving {MODEL} (onnxruntime, 8 sessions, DFlash) on http://127.0.0.1:{server.port}/v1" in log
    assert re.search(r"INFO: .* throughput: prompt [\d.]+ tokens/s, generation [\d.]+ tokens/s; running \d+, queued \d+ requests", log)
    assert "Traceback" not in log


def test_bench_serve_measures_a_running_server(server, capsys):
    """Guards against the client benchmark miscounting: its completed requests and output tokens equal
    the server's own counters over the run, and every latency figure is present."""
    before = server.metrics()
    assert cli_main(["bench", "--serve", server.base, "--num-prompts", "5", "--concurrency", "2", "--max-new-tokens", "64"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    result = json.loads(lines[-1])
    after = server.metrics()
    assert "| TTFT |" in "\n".join(lines) and (result["completed"], result["failed"]) == (5, 0), result.get("errors")
    assert result["output_tokens"] == after[("dflash_trt_output_tokens_total", "")] - before[("dflash_trt_output_tokens_total", "")]
    assert result["requests"] == after[("dflash_trt_requests_total", "completed")] - before[("dflash_trt_requests_total", "completed")]
    assert all(result[f"{name}_p50_ms"] > 0 for name in ("ttft", "tpot", "itl", "e2e"))


def test_sigterm_drains_then_ends_every_open_request_and_exits_0(default_pair_cache, tmp_path, prompts):
    """Guards against SIGTERM cutting streams mid-body at the deadline (no finish reason, no [DONE]: the
    openai client raised APIConnectionError), non-stream requests getting a plain-text 500 instead of
    503, new requests being admitted while shutting down, a traceback, or a non-zero exit."""
    drained = Server(default_pair_cache, tmp_path / "drain.log", "--max-sessions", "4", "--shutdown-timeout", "1.5")
    with drained.reaped():
        drained.wait_ready()
        client, outcomes, started = drained.client(), {}, threading.Semaphore(0)

        def stream(i):
            try:
                finish = None
                for n, event in enumerate(client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=900, temperature=0, stream=True)):
                    started.release() if n == 0 else None
                    finish = event.choices[0].finish_reason or finish
                outcomes[i] = finish
            except openai.APIError as error:
                outcomes[i] = repr(error)

        def whole(i):
            try:
                outcomes[i] = client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=900, temperature=0).choices[0].finish_reason
            except openai.APIStatusError as error:
                outcomes[i] = (error.status_code, error.body["code"])

        def raw(i):
            body = json.dumps({"model": MODEL, "prompt": prompts[i], "max_tokens": 900, "stream": True}).encode()
            request = urllib.request.Request(drained.base + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=60) as response:
                outcomes[i] = [line for line in response.read().decode().splitlines() if line.startswith("data: ")][-1]

        threads = [threading.Thread(target=f, args=(i,)) for i, f in enumerate([stream] * 5 + [whole, whole, raw])]
        # The four sessions go to streams 0-4 (the fifth queues), then the other three requests queue behind
        # them: started all at once, a non-stream request could take a session first, and a stream would start
        # only once another finished (~6 s of 900 tokens on a 2-core box), after the signal's deadline.
        for thread in threads[:5]:
            thread.start()
        for _ in range(4):
            assert started.acquire(timeout=60)  # four streams hold the sessions
        for thread in threads[5:]:
            thread.start()
        assert drained.wait_queued(4), drained.metrics()  # the fifth stream and the three others
        drained.process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        time.sleep(0.3)
        with pytest.raises(openai.APIStatusError) as refused:
            client.completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert refused.value.status_code == 503 and refused.value.body["code"] == "shutting_down"
        for thread in threads:
            thread.join(60)
        code = drained.process.wait(30)
        exited = time.monotonic() - signalled
    log = drained.log.read_text()
    assert code == 0 and "Traceback" not in log, log[-3000:]
    assert [outcomes[i] for i in range(5)] == ["abort"] * 5, outcomes
    assert outcomes[5] == outcomes[6] == (503, "shutting_down")
    assert outcomes[7] == "data: [DONE]"
    assert exited < 1.5 + 10, exited  # the goal (deadline + 1 s) is measured in benchmarks/serve_adversarial.py
    assert "SIGTERM: shutting down" in log and "aborting 8 open requests" in log


@pytest.mark.parametrize("flags", [["--fronts", "2", "--no-front-process"], ["--fronts", "3", "--replicas", "2"]])
def test_more_fronts_need_their_own_serving_process(flags):
    """Guards against ``--fronts N`` being accepted where no serving process of its own exists to share
    (one process, or Ray replicas): refused on one line before anything loads."""
    args = argparse.Namespace(front_process="--no-front-process" not in flags, fronts=int(flags[1]),
                              replicas=int(flags[-1]) if "--replicas" in flags else 1)
    with pytest.raises(UsageError, match=f"--fronts {flags[1]}"):
        command.check_front_flags(args)


@pytest.mark.parametrize(("cores", "flags", "fronts"), [
    (16, [], 4), (9, [], 2), (2, [], 1), (64, [], 4), (16, ["--no-front-process"], 1), (16, ["--replicas", "2"], 1),
])
def test_fronts_auto_follows_the_cores_and_is_one_where_only_one_can_run(monkeypatch, tmp_path, cores, flags, fronts):
    """Guards against one HTTP front by default on a many-core host (one front's CPU was the limit at 64
    streams: four served ~1.5x more) and against the default failing where an explicit count is refused
    (``--no-front-process``, ``--replicas``): ``auto``, the default, is one front per 4 cores this process
    may use, 1 to 4, and 1 where no serving process of its own is shared."""
    monkeypatch.setattr(command.os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    monkeypatch.setattr(command, "CGROUP_ROOT", tmp_path)  # no CPU quota, whatever this machine's cgroup says
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    args = parser.parse_args(flags)
    assert args.fronts == "auto"
    command.check_front_flags(args)
    assert args.fronts == fronts


@pytest.mark.parametrize(("files", "quota"), [
    ({"cpu.max": "250000 100000\n"}, 2.5), ({"cpu.max": "max 100000\n"}, None), ({"cpu.max": "garbage\n"}, None),
    ({"cpu/cpu.cfs_quota_us": "150000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 1.5),
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None), ({}, None),
])
def test_a_containers_cpu_quota_caps_the_cores_fronts_auto_counts(monkeypatch, tmp_path, files, quota):
    """Guards against ``--fronts auto`` counting every core of the host inside a container allowed a few
    cores' worth of time (``--cpus 2`` on a 64-core host: four fronts and the serving process on two cores'
    time): the cgroup's quota (v2 ``cpu.max``, v1 CFS quota over period) caps the affinity's count, rounded
    up; no quota, or none readable, leaves the affinity's."""
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    monkeypatch.setattr(command.os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert command.cgroup_cpu_quota(tmp_path) == quota
    cores = command.usable_cores(tmp_path)
    assert cores == (64 if quota is None else math.ceil(quota))
    assert command.auto_fronts(argparse.Namespace(front_process=True, replicas=1), cores) == (4 if quota is None else 1)


def test_a_front_count_is_auto_or_positive():
    """Guards against ``--fronts 0`` (or a typo) starting a server without a front: refused naming both forms."""
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    assert parser.parse_args(["--fronts", "3"]).fronts == 3
    for bad in ("0", "four"):
        with pytest.raises(argparse.ArgumentTypeError, match=f"must be auto or an int >= 1, got {bad!r}"):
            command.fronts_count(bad)


def test_two_http_fronts_answer_as_one_server_and_drain_together(default_pair_cache, tmp_path, prompts, reference):
    """Guards against ``--fronts 2`` (a second HTTP front process on the same port, its own pipe to the one
    serving process) answering wrongly or dropping requests, and against a shutdown that cuts the second
    front's streams, leaves it running after the server exited, or exits non-zero: concurrent requests
    over many connections equal the reference; the server answers only once the second front accepts too
    (connections made earlier would all stay with the first); at SIGTERM every open stream ends with a finish reason and
    the server exits 0 with no front process left, no process killed and no semaphore left to the resource
    tracker (each shutdown logged "leaked semaphore objects", the fronts' start barrier's). And against a
    front process that loads torch: it parses HTTP and (de)tokenizes, the runtime lives in the serving
    process, and importing it cost each front ~200 MB and ~1 s of start (it came in through the sampling
    value, the finish reasons, the serve command's module and the executor's flag defaults)."""
    served = Server(default_pair_cache, tmp_path / "fronts.log", "--fronts", "2", "--max-sessions", "4", "--shutdown-timeout", "1.5")
    with served.reaped():
        served.wait_ready()
        assert "HTTP front 1 (pid" in served.log.read_text()  # ready means every front accepts (none still starting)
        worker = int(served.log.read_text().split("HTTP front 1 (pid ")[1].split(")")[0])
        for front in (served.process.pid, worker):  # the command's own process is the first front
            assert "libtorch" not in Path(f"/proc/{front}/maps").read_text(), f"HTTP front (pid {front}) loaded torch"

        def one(i):
            client = served.client()  # a client (and connection) of its own
            return client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=12, temperature=0).choices[0].text

        with ThreadPoolExecutor(8) as pool:
            texts = list(pool.map(one, range(8)))
        assert texts == [reference(prompts[i], 12)[0] for i in range(8)]
        finishes, started = {}, threading.Semaphore(0)

        def stream(i):
            finish = None
            for n, event in enumerate(served.client().completions.create(model=MODEL, prompt=prompts[i], max_tokens=900, temperature=0, stream=True)):
                started.release() if n == 0 else None
                finish = event.choices[0].finish_reason or finish
            finishes[i] = finish

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]  # one per session, all streaming
        for thread in threads:
            thread.start()
        for _ in range(4):
            assert started.acquire(timeout=60)
        served.process.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(60)
        code = served.process.wait(30)
    assert sorted(finishes) == list(range(4)) and set(finishes.values()) <= {"abort", "length"}, finishes
    time.sleep(0.5)  # the resource tracker (a child of the server) reports what leaked once every process ended
    log = served.log.read_text()
    assert code == 0 and "Traceback" not in log, log[-3000:]
    assert "killing it" not in log and "leaked" not in log, log[-3000:]  # every process exited by itself, freeing its semaphores
    assert not Path(f"/proc/{worker}").exists() or "Z" in Path(f"/proc/{worker}/stat").read_text().split()[2], "front 1 outlived the server"


def test_the_serving_process_dying_fails_open_requests_and_the_server_exits_1(default_pair_cache, tmp_path, prompts):
    """Guards against the serving process's death leaving clients hanging (streams that never end, whole
    requests that never answer), /health still answering 200, or a server that lives on without its
    engine: open streams end with an error event (code serving_process_died), a whole request gets 503,
    /health answers 503, and the server exits 1 without a traceback."""
    server = Server(default_pair_cache, tmp_path / "died.log", "--max-sessions", "1")
    with server.reaped():
        server.wait_ready()
        pid = int(re.search(r"serving process (\d+) loaded", server.log.read_text()).group(1))
        client, outcomes, started = server.client(), {}, threading.Event()

        def stream(i):
            try:
                for _ in client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=900, temperature=0, stream=True):
                    started.set()
                outcomes[i] = "ended without an error"
            except openai.APIError as error:
                outcomes[i] = error.body.get("code") if isinstance(error.body, dict) else repr(error)

        def whole(i):
            try:
                client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=900, temperature=0)
                outcomes[i] = "answered"
            except openai.APIStatusError as error:
                outcomes[i] = (error.status_code, error.body["code"])

        threads = [threading.Thread(target=f, args=(i,)) for i, f in enumerate([stream, stream, whole])]
        for thread in threads[:2]:
            thread.start()
        assert started.wait(60)  # a stream holds the one session; the whole request queues behind it
        threads[2].start()
        server.wait_queued(2)
        os.kill(pid, signal.SIGKILL)
        health = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not health:
            try:
                server.get("/health")
            except urllib.error.HTTPError as error:
                health.append((error.code, json.loads(error.read())["status"]))
            except OSError:
                break
            time.sleep(0.05)
        for thread in threads:
            thread.join(60)
        code = server.process.wait(30)
    log = server.log.read_text()
    assert outcomes == {0: "serving_process_died", 1: "serving_process_died", 2: (503, "serving_process_died")}, outcomes
    assert health == [(503, "unavailable")]
    assert code == 1 and "Traceback" not in log and "the serving process stopped (exit code -9)" in log, log[-3000:]


def test_port_checked_before_anything_loads(monkeypatch):
    """Guards against a busy or impossible port being found only after the model loaded (then a crash;
    "serving ..." printed before the bind error): --port 70000 is refused by the parser, a busy port by a
    ServingError before anything loads."""
    from dflash_trt.cli import build_parser

    with pytest.raises(UsageError, match="--port: must be a TCP port in"):
        build_parser("serve").parse_args(["serve", "--port", "70000"])
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    from dflash_trt.server import front

    monkeypatch.setattr(command, "_load", lambda *args, **kwargs: pytest.fail("loaded before the port was checked"))
    monkeypatch.setattr(front, "start", lambda *args: pytest.fail("the serving process started before the port was checked"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(ServingError, match=f"cannot listen on 127.0.0.1:{busy.getsockname()[1]}"):
            command.run(parser.parse_args(["--port", str(busy.getsockname()[1])]))


def test_the_model_id_comes_from_the_model(tmp_path):
    """Guards against the model id defaulting to the export cache's hash-named folder: the default pair is
    dflash-trt-default-pair wherever its export sits, another target its checkpoint's name, artifacts
    named by the user their folder's name, --served-model-name first of all."""
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    cache = tmp_path / "cache"
    cases = [([], MODEL), (["--artifacts", str(cache / "export" / "0123abcd4567")], MODEL),
             (["--artifacts", str(cache / "export" / "0123abcd4567"), "--target", str(tmp_path / "Qwen3-8B")], "Qwen3-8B"),
             (["--artifacts", str(tmp_path / "my-export")], "my-export")]
    for flags, name in cases:
        assert command._model_name(parser.parse_args(["--cache", str(cache), *flags])) == name, flags
    assert parser.parse_args(["--served-model-name", "a", "b"]).served_model_name == ["a", "b"]


def test_a_failed_request_gets_a_500_without_internal_text(tiny):
    """Guards against 500 bodies carrying internal exception text (types, messages, paths): a request the
    serving loop fails gets a 500 naming only its request id, streamed or not; the log keeps the cause."""
    import uvicorn

    from dflash_trt.runtime.executor import Executor
    from dflash_trt.runtime.serving.loop import ServingLoop
    from dflash_trt.server.app import create_app
    from dflash_trt.server.limits import Limits
    from dflash_trt.server.protocols import ServeConfig
    from executor_fixtures import RecordingBackend

    backend = RecordingBackend(tiny.ort)
    serving = ServingLoop(Executor(backend, tiny.dims, 2))
    listener = command.bind("127.0.0.1", 0)
    app = create_app(serving, "tiny", Limits(), log_interval_s=0)
    server = uvicorn.Server(ServeConfig(app, Limits(), log_level="critical"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{listener.getsockname()[1]}/v1", api_key="unused", max_retries=0, timeout=30)
        backend.fail_on = (c.TARGET_PREFILL, backend.counts.get(c.TARGET_PREFILL, 0) + 1)
        with pytest.raises(openai.InternalServerError) as failed:
            client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=4)
        message = failed.value.body["message"]
        assert re.fullmatch(r"the server failed this request \(request id cmpl-[0-9a-f]{32}\); see the server log", message), message
        backend.fail_on = (c.TARGET_PREFILL, backend.counts.get(c.TARGET_PREFILL, 0) + 1)
        with pytest.raises(openai.APIError) as streamed:  # the stream's last event is the error
            list(client.completions.create(model="tiny", prompt=[8, 9], max_tokens=4, stream=True))
        assert re.fullmatch(r"the server failed this request \(request id cmpl-[0-9a-f]{32}\); see the server log", streamed.value.message)
        assert client.completions.create(model="tiny", prompt=[8, 9], max_tokens=4).usage.completion_tokens == 4
    finally:
        server.should_exit = True
        thread.join(30)
        serving.close(drain=False, timeout=30)


def test_the_serve_delivery_tick_is_the_serving_loops_default():
    """Guards against `dflash-trt serve` and an embedded ``ServingLoop`` delivering on different ticks (the CLI
    keeps its own literal so that parsing flags does not load torch): the server would stream with gaps the
    embedded loop's measurements never showed."""
    from dflash_trt.runtime.serving.loop import DEFAULT_STREAM_INTERVAL

    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    assert parser.parse_args([]).stream_interval_ms / 1000 == DEFAULT_STREAM_INTERVAL
