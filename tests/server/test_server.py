"""``dflash-trt serve`` as a live subprocess on 127.0.0.1, driven by the official openai client: outputs
against the reference decoder, streaming, stop sequences, 32 concurrent clients, disconnects, OpenAI-style
errors and backpressure. The shipped default pair, exported once per run (conftest ``default_pair_cache``)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dflash_trt.export.pair import DEFAULT_PAIR_DIR, load_pair
from dflash_trt.export.reference import ReferenceDecoder
from dflash_trt.export.sampling import Sampling
from dflash_trt.export.tokenizer import Tokenizer
from dflash_trt.errors import UsageError
from dflash_trt.server import command
from dflash_trt.server.command import DEFAULT_PAIR_MODEL as MODEL

TEMPLATE = "{% for m in messages %}### {{ m['role'] }}:\n{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}### assistant:\n{% endif %}"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Server:
    """One ``dflash-trt serve`` subprocess over the cached default-pair export."""

    def __init__(self, cache: Path, log: Path, *flags: str) -> None:
        self.port, self.log = free_port(), log
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

    def stop(self) -> None:
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@pytest.fixture(scope="module")
def servers(default_pair_cache, tmp_path_factory):
    """(main server: 8 sessions and a chat template; small server: 1 session, queue of 1, the torch backend
    straight from the checkpoints, --no-draft), started together."""
    root = tmp_path_factory.mktemp("serve")
    (root / "chat.jinja").write_text(TEMPLATE)
    main = Server(default_pair_cache, root / "main.log", "--max-sessions", "8", "--chat-template", str(root / "chat.jinja"))
    small = Server(default_pair_cache, root / "small.log", "--max-sessions", "1", "--max-queue", "1", "--backend", "torch", "--no-draft")
    try:
        main.wait_ready()
        small.wait_ready()
        yield main, small
    finally:
        main.stop()
        small.stop()
    assert main.process.returncode == 0, main.log.read_text()[-3000:]


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
    Prometheus text a Prometheus parser reads)."""
    assert [m.id for m in server.client().models.list()] == [MODEL]
    assert server.get("/health") == (200, '{"status":"ok","speculate":true}')
    metrics = server.metrics()
    assert ("dflash_trt_requests_running", "") in metrics and ("dflash_trt_requests_total", "rejected") in metrics
    assert ("dflash_trt_time_to_first_token_seconds", "") in metrics


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


BAD = [
    (b'{"model": "m", "prompt": "x",', 400, "parse the JSON"),
    (json.dumps({"model": MODEL, "prompt": "x", "frobnicate": 1}).encode(), 400, "Unrecognized request argument supplied: frobnicate"),
    (json.dumps({"model": MODEL, "prompt": "x", "temperature": 5}).encode(), 400, "temperature"),
    (json.dumps({"model": MODEL, "prompt": "x", "n": 2}).encode(), 400, "n:"),
    (json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 0}).encode(), 400, "max_tokens"),
    (json.dumps({"model": MODEL, "prompt": "x", "top_p": 0}).encode(), 400, "top_p"),
    (json.dumps({"model": MODEL, "prompt": "x", "seed": -1}).encode(), 400, "seed"),
    (json.dumps({"model": MODEL, "prompt": ["a", "b"]}).encode(), 400, "prompt"),
    (json.dumps({"model": MODEL, "prompt": [1, 99999]}).encode(), 400, "99999"),
    (json.dumps({"model": MODEL, "prompt": [5] * 1024}).encode(), 400, "prompt must hold"),
    (json.dumps({"model": "other", "prompt": "x"}).encode(), 404, "does not exist"),
    (json.dumps({"prompt": "x"}).encode(), 400, "model"),
]


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, reference, prompts):
    """Guards against malformed or out-of-range requests crashing a handler, reaching the serving loop, being
    silently clamped, or answered in a shape the openai client cannot read; the server must serve on."""
    for body, status, words in BAD:
        code, error = server.post("/v1/completions", body)
        assert code == status and words in error["error"]["message"], (body, code, error)
        assert set(error["error"]) == {"message", "type", "param", "code"}
    code, error = server.post("/v1/chat/completions", json.dumps({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}).encode())
    assert code == 400 and "messages.0.role" == error["error"]["param"]
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
