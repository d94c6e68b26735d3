"""``dflash-trt serve --replicas 2`` as a live subprocess: a local Ray cluster with two ONNX Runtime replicas
of the shipped default pair on the CPU (2 sessions each), driven by the official openai client; every
answer against one in-process ``ServingLoop`` over the same export (greedy and seeded sampling, streamed
or not). Skipped without the ``ray`` extra. Every wait is bounded."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("ray.serve", reason="needs the ray extra (pip install 'dflash-trt[serve,ray]')")
openai = pytest.importorskip("openai")

from prometheus_client.parser import text_string_to_metric_families

from dflash_trt.cli import build_parser
from dflash_trt.errors import UsageError
from dflash_trt.export.pair import DEFAULT_PAIR_DIR
from dflash_trt.server import command, replicas, schema
from dflash_trt.server.command import DEFAULT_PAIR_MODEL as MODEL

FLAGS = ("--threads", "1", "--max-sessions", "2", "--shutdown-timeout", "2", "--log-interval", "0")
READY_S = 150.0
STOP_S = 40.0
LONG = 900  # tokens: ~3 s of decoding for two requests on one CPU replica here (the default pair's context is 1024)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Cluster:
    """One ``dflash-trt serve --replicas 2`` subprocess (its own session: Ray's processes go with it)."""

    def __init__(self, cache: Path, log: Path) -> None:
        self.port, self.log = free_port(), log
        argv = [sys.executable, "-m", "dflash_trt.cli", "serve", "--cache", str(cache), "--port", str(self.port), "--replicas", "2", *FLAGS]
        env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1"}
        self.process = subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.base = f"http://127.0.0.1:{self.port}"

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_S
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"serve --replicas exited:\n{self.log.read_text()[-3000:]}"
            try:
                if self.get("/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"serve --replicas not ready after {READY_S} s:\n{self.log.read_text()[-3000:]}")

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base}/v1", api_key="unused", max_retries=0, timeout=120)

    def get(self, path: str) -> tuple[int, str]:
        with urllib.request.urlopen(self.base + path, timeout=30) as response:
            return response.status, response.read().decode()

    def requests(self, outcome: str) -> int:
        """The request count by ``outcome`` of the replica this /metrics request reached."""
        families = text_string_to_metric_families(self.get("/metrics")[1])
        return next(int(s.value) for f in families for s in f.samples if s.name == "dflash_trt_requests_total" and s.labels["outcome"] == outcome)

    def per_replica(self, outcome: str, total: int, timeout: float = 30.0) -> set[int]:
        """The two replicas' counts (distinct: ``total`` is odd), read until they add up to ``total`` or
        ``timeout`` passes: 24 /metrics requests, each reaching a replica the router draws."""
        deadline = time.monotonic() + timeout
        while True:
            seen = {self.requests(outcome) for _ in range(24)}
            if (len(seen) == 2 and sum(seen) == total) or time.monotonic() > deadline:
                return seen
            time.sleep(0.5)

    def stop(self) -> int | None:
        """SIGTERM (the drain), then the whole session killed if it outlives STOP_S."""
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(STOP_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            return None


@pytest.fixture(scope="module")
def cluster(default_pair_cache, tmp_path_factory):
    log = tmp_path_factory.mktemp("replicas") / "serve.log"
    cluster = Cluster(default_pair_cache, log)
    try:
        cluster.wait_ready()
        yield cluster
    finally:
        code = cluster.stop()
    assert code == 0, f"serve --replicas did not stop cleanly on SIGTERM (code {code}):\n{log.read_text()[-3000:]}"


@pytest.fixture(scope="module")
def single(default_pair_cache):
    """One in-process ServingLoop over the same export, flags and tokenizer: what one server answers."""
    args = build_parser("serve").parse_args(["serve", "--cache", str(default_pair_cache), *FLAGS])
    serving, backend, _ = command._load(args)
    yield serving
    serving.close(drain=False, timeout=30)
    backend.close()


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    rows = [json.loads(line) for line in (DEFAULT_PAIR_DIR / "prompts.jsonl").read_text().splitlines() if line.strip()]
    return [row["prompt"][-120:] for row in rows][:5]


def expected(single, prompt: str, max_tokens: int, **sampling) -> tuple[str, str]:
    result = single.submit(prompt, max_tokens, **sampling).result(timeout=120)
    return result.text, schema.FINISH.get(result.finish)


def test_two_replicas_answer_as_one_server(cluster, single, prompts):
    """Guards against the replicas changing what a client gets: a replica that loads another export,
    other flags or another tokenizer, a lost or mixed-up concurrent request, a stream that Ray's proxy
    buffers or cuts, and a router that sends everything to one replica — four concurrent requests
    (greedy and seeded sampling) and a stream, each equal to one in-process serving loop's answer, the
    completions spread over both replicas."""
    client = cluster.client()
    assert [m.id for m in client.models.list()] == [MODEL]
    jobs = [(p, {"temperature": 0.0}) if i % 2 == 0 else (p, {"temperature": 0.8, "top_p": 0.95, "seed": 7 + i}) for i, p in enumerate(prompts[:4])]

    def ask(job):
        prompt, sampling = job
        done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, **sampling)
        return done.choices[0].text, done.choices[0].finish_reason

    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(ask, jobs, timeout=180))
    assert answers == [expected(single, prompt, 12, **sampling) for prompt, sampling in jobs]

    events = list(client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=12, temperature=0.8, seed=3, stream=True))
    assert len(events) > 1  # streamed, not one block
    streamed = "".join(e.choices[0].text for e in events), events[-1].choices[0].finish_reason
    assert streamed == expected(single, prompts[0], 12, temperature=0.8, seed=3)

    # Both replicas' counts appear among /metrics answers (each reaches one replica; an odd total: the two
    # counts differ), and they add up.
    seen = cluster.per_replica("completed", len(jobs) + 1)
    if 0 in seen:  # Ray's router draws two replicas per request and takes the less busy: one burst can land on one by chance
        with ThreadPoolExecutor(len(jobs)) as pool:
            assert list(pool.map(ask, jobs, timeout=180)) == answers
        seen = cluster.per_replica("completed", 2 * len(jobs) + 1)
    assert len(seen) == 2 and sum(seen) in (len(jobs) + 1, 2 * len(jobs) + 1) and min(seen) > 0, seen


def test_errors_are_the_single_servers(cluster):
    """Guards against errors changing shape behind Ray Serve's proxy: a bad field and an unknown model
    answer OpenAI's error objects with the status, param and code the single server gives."""
    client = cluster.client()
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=-1)
    assert bad.value.status_code == 400 and bad.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="another-model", prompt="def f(x):", max_tokens=2)
    assert missing.value.body["code"] == "model_not_found" and missing.value.body["param"] == "model"


def test_a_client_that_goes_away_cancels_its_request_on_its_replica(cluster, prompts):
    """Guards against Ray Serve's proxy not passing a disconnect on to the replica: a stream closed after
    its first event and a request whose client timed out must be cancelled in their replica's serving
    loop (their sessions freed), not decoded to the end (three requests: an odd total over two replicas).
    The timeout is half what the same request took to its end just before, routing included: a fixed one
    (0.5 s) could expire before a loaded machine's proxy had handed the request to a replica (nothing
    there to cancel), or after an idle one had decoded it (~1.2 s for its 900 tokens here)."""
    client = cluster.client()
    started = time.monotonic()
    client.completions.create(model=MODEL, prompt=prompts[2], max_tokens=LONG, temperature=0)
    whole = time.monotonic() - started
    with pytest.raises(openai.APITimeoutError):
        client.with_options(timeout=whole / 2).completions.create(model=MODEL, prompt=prompts[2], max_tokens=LONG, temperature=0)
    for prompt in prompts[:2]:
        stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=LONG, temperature=0, stream=True)
        next(iter(stream))
        stream.close()
    seen = cluster.per_replica("cancelled", 3)  # cancelled at the next gap between executes
    assert len(seen) == 2 and sum(seen) == 3, seen


def test_replica_resources_follow_the_device():
    """Guards against replicas sharing a GPU (or a CPU server's replicas reserving one), Ray's proxy
    sending one replica more requests than its sessions and queue hold (or so few that its sessions
    idle), and the Serve config builder not reading ``dflash-trt serve``'s flags."""
    parse = build_parser("serve").parse_args
    gpu = parse(["serve", "--replicas", "3", "--backend", "torch", "--device", "cuda:1", "--max-sessions", "4", "--max-queue", "8"])
    deployment = replicas.deployment(gpu)
    assert (deployment.num_replicas, deployment.max_ongoing_requests) == (3, 12)
    assert deployment.ray_actor_options["num_gpus"] == 1
    cpu = parse(["serve", "--replicas", "2", "--threads", "2"])
    assert replicas.actor_options(cpu) == {"num_cpus": 2}
    with pytest.raises(UsageError, match="--max-sessions"):
        replicas.builder({"flags": "--replicas 2 --backend torch --max-sessions 0"})
    from ray import serve

    assert isinstance(replicas.builder({"flags": "--replicas 2 --backend torch --threads 2"}), serve.Application)


def test_the_port_is_held_while_the_local_cluster_starts(monkeypatch):
    """Guards against Ray's own servers taking the serving port: bound only to check it, the port was free while
    ``ray.init`` started the cluster's gRPC servers on ports the kernel handed out, and one took a ``--port`` in
    that range (the health checks then read a gRPC frame, Serve's proxy could not bind it). A stand-in cluster binds
    the port as a gRPC server would (SO_REUSEADDR and SO_REUSEPORT) during ``ray.init`` and must be refused; Serve's
    proxy, started next, must find it free."""
    port = free_port()
    seen = {}

    def binds() -> bool:
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            try:
                sock.bind(("127.0.0.1", port))
                sock.listen()
            except OSError:
                return False
            return True

    class Ray:
        def init(self, **_):
            seen["during ray.init"] = binds()

        def shutdown(self):
            seen["stopped"] = True

    class Serve:
        def start(self, http_options):
            seen["at serve.start"] = binds()

        def run(self, *_, **__):
            raise KeyboardInterrupt  # as a signal would, once serving

        def shutdown(self):
            pass

    monkeypatch.setattr(replicas, "_ray", lambda: (Ray(), Serve()))
    monkeypatch.setattr(replicas, "prepare", lambda args: None)  # no artifacts: the port is what is tested
    monkeypatch.setattr(replicas, "application", lambda args: None)
    args = build_parser("serve").parse_args(["serve", "--replicas", "2", "--host", "127.0.0.1", "--port", str(port), *FLAGS])
    assert replicas.run(args) == 0
    assert seen == {"during ray.init": False, "at serve.start": True, "stopped": True}


def replica_pids(root: int) -> set[int]:
    """The Ray Serve replica processes under ``root`` (the serve subprocess), by their process titles."""
    parents, titles = {}, {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                titles[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except (OSError, IndexError, ValueError):
                continue

    def under_root(pid: int) -> bool:
        for _ in range(32):
            if pid == root:
                return True
            pid = parents.get(pid, 0)
            if pid <= 1:
                return False
        return False

    return {pid for pid, title in titles.items() if title.startswith("ray::ServeReplica") and under_root(pid)}


def test_a_killed_replica_fails_its_requests_cleanly_and_comes_back(cluster, single, prompts):
    """Guards against one replica's death hanging, truncating or corrupting streams: a replica killed
    (SIGKILL) while four streams decode on the two replicas ends its streams with a client error (the
    connection closed before ``[DONE]``: never a silent early end; not yet OpenAI's error event, nor a
    replay), the other replica's streams answer exactly as one serving loop does, and Ray starts a new
    replica that serves (bounded waits)."""
    before = replica_pids(cluster.process.pid)
    assert len(before) == 2, before
    client = cluster.client()
    streams = [iter(client.completions.create(model=MODEL, prompt=prompt, max_tokens=LONG, temperature=0, stream=True)) for prompt in prompts[:4]]
    texts = [next(stream).choices[0].text for stream in streams]  # each stream is decoding (or queued) on its replica
    victim = min(before)
    os.kill(victim, signal.SIGKILL)
    outcomes = []
    for text, stream in zip(texts, streams, strict=True):
        try:
            events = list(stream)
        except openai.APIError as error:
            outcomes.append(error)
            continue
        outcomes.append((text + "".join(e.choices[0].text for e in events), events[-1].choices[0].finish_reason if events else None))
    failed = [o for o in outcomes if isinstance(o, Exception)]
    served = [(o, prompt) for o, prompt in zip(outcomes, prompts, strict=False) if not isinstance(o, Exception)]
    assert failed, "no stream was in flight on the killed replica"
    assert served, "the other replica's streams failed too"
    assert all(o == expected(single, prompt, LONG, temperature=0.0) for o, prompt in served)

    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and len(replica_pids(cluster.process.pid) - {victim}) < 2:
        time.sleep(1.0)
    assert len(replica_pids(cluster.process.pid) - {victim}) == 2, "Ray did not start a new replica within 90 s"
    answers = [client.completions.create(model=MODEL, prompt=prompts[4], max_tokens=8, temperature=0) for _ in range(4)]
    assert all((a.choices[0].text, a.choices[0].finish_reason) == expected(single, prompts[4], 8, temperature=0.0) for a in answers)
