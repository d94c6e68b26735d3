"""``dflash-trt serve`` under attack, at shutdown, and left alone: the goals of issue 25, measured.

Starts the server as a subprocess on 127.0.0.1 (the embedded default pair on
ONNX Runtime, unless ``--serve-args`` say otherwise; the server's default
bounds) and runs up to three scenarios, each on a fresh server. Clients are
raw HTTP (``http.client`` and sockets: light on the CPU the server shares).

- ``attack``: 4 streaming clients (back-to-back completions) and a /health
  probe every 20 ms run for ``--quiet-seconds`` (the baseline), then for
  ``--attack-seconds`` while an attacker sends a 50 MB body with its length
  declared, a 50 MB chunked body, a text prompt and a token-id prompt
  just under the body limit (``--body-limit``), and holds 200 sockets with half-sent
  requests. Reports /health latency p50 / p99 / max and the streams' event
  gaps p99 in both windows, and the server's RSS before and at its peak
  during the attack (sampled every 20 ms from /proc). Goal: /health and the
  streams answer within 50 ms p99 (stream gaps: their p99 grows by <= 50 ms
  over the quiet baseline) and the peak adds <= 50 MB.
- ``shutdown``: ``--streams`` streaming requests (max_tokens 600; more than
  the sessions, so some wait in the queue), SIGTERM once the first half have
  tokens. Reports how many got a final event (finish_reason) and ``[DONE]``,
  the exit code, whether the log has a traceback, and the seconds from the
  signal to the process's exit. Goal: every stream gets its final event; exit
  within ``--shutdown-timeout`` + 1 s.
- ``memory``: 8 streaming clients for ``--warmup-seconds``, then for
  ``--memory-minutes`` with /metrics never scraped, the RSS every 5 s. Goal:
  flat within ± 10 MB after the warm-up.

    python benchmarks/serve_adversarial.py [--scenarios attack shutdown memory] [--memory-minutes 10]
        [--streams 32] [--shutdown-timeout 3] [--serve-args "..."] [--record]

Prints a table per scenario and, last, one JSON line with every figure;
``--record`` appends one row per scenario to benchmarks/results.jsonl.
"""

from __future__ import annotations

import argparse
import http.client
import json
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

import record  # benchmarks/record.py: results.jsonl
import serve_load  # machine(): the benchmarks' one name for the machine a server runs on

ROOT = Path(__file__).resolve().parent.parent
MODEL = "dflash-trt-default-pair"
MB = 1 << 20


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:  # it exited meanwhile
        return 0.0
    return 0.0


def _children(pid: int) -> list[int]:
    try:
        return [int(child) for task in Path(f"/proc/{pid}/task").iterdir() for child in (task / "children").read_text().split()]
    except OSError:
        return []


class Server:
    """One ``dflash-trt serve`` subprocess; its RSS from /proc (the server's process and its children:
    the serving process beside the HTTP front, and the spawn's resource tracker)."""

    def __init__(self, args, *flags: str) -> None:
        self.port = free_port()
        self.log = Path(tempfile.gettempdir()) / f"serve_adversarial_{self.port}.log"
        command = [sys.executable, "-m", "dflash_trt.cli", "serve", "--port", str(self.port), *flags, *shlex.split(args.serve_args)]
        self.process = subprocess.Popen(command, stdout=self.log.open("w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"server exited:\n{self.log.read_text()[-3000:]}")
            try:
                if get(self.port, "/health")[0] == 200:
                    return
            except OSError:
                time.sleep(0.3)
        raise SystemExit("server not ready after 900 s")

    def rss_mb(self) -> float:
        return sum(_rss_mb(pid) for pid in (self.process.pid, *_children(self.process.pid)))

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def get(port: int, path: str, connection: http.client.HTTPConnection | None = None) -> tuple[int, bytes]:
    conn = connection or http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", path)
    response = conn.getresponse()
    return response.status, response.read()


def prompts() -> list[str]:
    rows = [json.loads(line) for line in (ROOT / "export" / "default_pair" / "prompts.jsonl").read_text().splitlines() if line.strip()]
    return [row["prompt"][-600:] for row in rows]


def stream_once(port: int, prompt: str, max_tokens: int, gaps: list | None = None, timeout: float = 120, on_first=None) -> dict:
    """One streaming completion over raw HTTP: its events' finish reason, whether [DONE] came, gaps between
    events (appended to ``gaps`` as (time, seconds)); ``on_first()`` at its first event."""
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    outcome = {"finish": None, "done": False, "events": 0, "status": None, "error": None}
    try:
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        outcome["status"] = response.status
        last = None
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            now = time.monotonic()
            if line == "data: [DONE]":
                outcome["done"] = True
                break
            event = json.loads(line[6:])
            outcome["events"] += 1
            if outcome["events"] == 1 and on_first is not None:
                on_first()
            if event.get("choices"):
                outcome["finish"] = event["choices"][0].get("finish_reason") or outcome["finish"]
            if gaps is not None and last is not None:
                gaps.append((now, now - last))
            last = now
    except OSError as error:
        outcome["error"] = f"{type(error).__name__}: {error}"
    finally:
        conn.close()
    return outcome


# ---------------------------------------------------------------------- scenario: attack


def attack(args) -> dict:
    server = Server(args, "--max-sessions", "16")
    stop, health, gaps, rss = threading.Event(), [], [], []
    texts = prompts()

    def streamer(i: int) -> None:
        n = i
        while not stop.is_set():
            stream_once(server.port, texts[n % len(texts)], 64, gaps)
            n += 4

    def prober() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        while not stop.is_set():
            started = time.monotonic()
            status, _ = get(server.port, "/health", conn)
            health.append((started, time.monotonic() - started, status))
            time.sleep(0.02)

    def sampler() -> None:
        while not stop.is_set():
            rss.append((time.monotonic(), server.rss_mb()))
            time.sleep(0.02)

    workers = [threading.Thread(target=streamer, args=(i,), daemon=True) for i in range(4)]
    workers += [threading.Thread(target=prober, daemon=True), threading.Thread(target=sampler, daemon=True)]
    try:
        for worker in workers:
            worker.start()
        time.sleep(args.quiet_seconds)
        attack_start = time.monotonic()
        answers, sockets = attacker(server.port, args.body_limit)
        time.sleep(max(0.0, attack_start + args.attack_seconds - time.monotonic()))
        attack_end = time.monotonic()
        for sock in sockets:
            sock.close()
        stop.set()
        for worker in workers:
            worker.join(180)
    finally:
        server.stop()
    return attack_figures((health, gaps, rss), attack_start, attack_end, answers, args)


def attacker(port: int, body_limit: int) -> tuple[dict, list[socket.socket]]:
    """200 half-open sockets (held), then each large body once; the server's answer to each body."""
    sockets = []
    for i in range(200):
        sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{" if i % 2 else b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        sockets.append(sock)
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    chunk = b" " * (1 << 16)
    bodies = {
        "declared_50mb": ((head + f"Content-Length: {50 * MB}\r\n\r\n").encode(), [chunk] * (50 * MB // len(chunk))),
        "chunked_50mb": ((head + "Transfer-Encoding: chunked\r\n\r\n").encode(), [b"%x\r\n%s\r\n" % (len(chunk), chunk)] * (50 * MB // len(chunk))),
    }
    near = body_limit - 4096  # just under the server's body limit: parsed, then refused
    text = json.dumps({"model": MODEL, "prompt": "def f(x):\n    return x\n" * (near // 25)}).encode()
    ids = json.dumps({"model": MODEL, "prompt": [5] * (near // 3)}).encode()
    for name, body in (("text_under_limit", text), ("token_ids_under_limit", ids)):
        bodies[name] = ((head + f"Content-Length: {len(body)}\r\n\r\n").encode(), [body])
    answers = {}
    for name, (request_head, chunks) in bodies.items():
        started = time.monotonic()
        answer, first_byte = send_raw(port, request_head, chunks)
        answers[name] = {"status": answer.split(b" ", 2)[1].decode() if answer else None, "answer_s": round(first_byte - started, 3),
                         "bytes_sent": sum(len(c) for c in chunks)}
    return answers, sockets


def send_raw(port: int, head: bytes, chunks) -> tuple[bytes, float]:
    """The response's bytes (read until the server closes) and when its first byte came."""
    first = None
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(head)
        for chunk in chunks:
            try:
                sock.sendall(chunk)
            except OSError:  # answered and closed before the body ended
                break
        response = b""
        while True:
            try:
                data = sock.recv(1 << 16)
            except OSError:
                break
            if not data:
                break
            first = first or time.monotonic()
            response += data
        return response, first or time.monotonic()


def attack_figures(series, start: float, end: float, answers: dict, args) -> dict:
    health, gaps, rss = series

    def window(rows, inside):
        return [r for r in rows if (start <= r[0] < end) == inside]

    def ms(values, q):
        return round(float(np.percentile(values, q)) * 1000, 2) if values else None

    quiet_health, attack_health = [r[1] for r in health if r[0] < start], [r[1] for r in window(health, True)]
    quiet_gaps, attack_gaps = [g for t, g in gaps if t < start], [g for t, g in window(gaps, True)]
    before = [mb for t, mb in rss if start - 2 <= t < start]
    during = [mb for t, mb in window(rss, True)]
    result = {
        "quiet_seconds": args.quiet_seconds, "attack_seconds": args.attack_seconds,
        "health_quiet_p50_ms": ms(quiet_health, 50), "health_quiet_p99_ms": ms(quiet_health, 99),
        "health_attack_p50_ms": ms(attack_health, 50), "health_attack_p99_ms": ms(attack_health, 99),
        "health_attack_max_ms": round(max(attack_health) * 1000, 2) if attack_health else None,
        "health_attack_probes": len(attack_health), "health_attack_not_200": sum(r[2] != 200 for r in window(health, True)),
        "stream_gap_quiet_p50_ms": ms(quiet_gaps, 50), "stream_gap_attack_p50_ms": ms(attack_gaps, 50),
        "stream_gap_quiet_p99_ms": ms(quiet_gaps, 99), "stream_gap_attack_p99_ms": ms(attack_gaps, 99),
        "stream_gap_attack_max_ms": round(max(attack_gaps) * 1000, 2) if attack_gaps else None,
        "stream_events_attack": len(attack_gaps),
        "rss_before_mb": round(float(np.median(before)), 1) if before else None,
        "rss_attack_peak_mb": round(max(during), 1) if during else None,
        "answers": answers,
    }
    if before and during:
        result["rss_added_mb"] = round(max(during) - float(np.median(before)), 1)
    result["goal_health_p99_50ms"] = bool(result["health_attack_p99_ms"] is not None and result["health_attack_p99_ms"] <= 50)
    result["goal_streams_p99_within_50ms_of_quiet"] = bool(attack_gaps and quiet_gaps and ms(attack_gaps, 99) - ms(quiet_gaps, 99) <= 50)
    result["goal_memory_50mb"] = bool("rss_added_mb" in result and result["rss_added_mb"] <= 50)
    return result


# ---------------------------------------------------------------------- scenario: shutdown


def shutdown(args) -> dict:
    server = Server(args, "--max-sessions", "16", "--shutdown-timeout", str(args.shutdown_timeout))
    texts, outcomes, first = prompts(), {}, threading.Semaphore(0)

    def one(i: int) -> None:
        outcomes[i] = stream_once(server.port, texts[i % len(texts)], 600, on_first=first.release)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(args.streams)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 300
    for _ in range(args.streams // 2):
        if not first.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise SystemExit(f"streams did not start: {outcomes}")
    signalled = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    code = server.process.wait(120)
    exited = time.monotonic() - signalled
    for thread in threads:
        thread.join(60)
    log = server.log.read_text()
    finishes = [outcomes.get(i, {}).get("finish") for i in range(args.streams)]
    result = {
        "streams": args.streams, "shutdown_timeout_s": args.shutdown_timeout,
        "final_event": sum(f is not None for f in finishes), "done": sum(bool(outcomes.get(i, {}).get("done")) for i in range(args.streams)),
        "finish_reasons": {reason: finishes.count(reason) for reason in set(finishes)},
        "exit_code": code, "exit_seconds_after_sigterm": round(exited, 3), "traceback_in_log": "Traceback" in log,
    }
    result["goal_all_final_events"] = result["final_event"] == result["done"] == args.streams
    result["goal_exit_within_deadline_plus_1s"] = exited <= args.shutdown_timeout + 1
    return result


# ---------------------------------------------------------------------- scenario: memory


def memory(args) -> dict:
    server = Server(args, "--max-sessions", "16")
    stop, texts, samples, requests = threading.Event(), prompts(), [], [0]

    def streamer(i: int) -> None:
        n = i
        while not stop.is_set():
            stream_once(server.port, texts[n % len(texts)], 64)
            requests[0] += 1
            n += 8

    workers = [threading.Thread(target=streamer, args=(i,), daemon=True) for i in range(8)]
    try:
        for worker in workers:
            worker.start()
        started = time.monotonic()
        time.sleep(args.warmup_seconds)
        warm_requests = requests[0]
        end = time.monotonic() + args.memory_minutes * 60
        while time.monotonic() < end:
            samples.append((round(time.monotonic() - started, 1), round(server.rss_mb(), 2)))
            time.sleep(5)
        stop.set()
        for worker in workers:
            worker.join(180)
    finally:
        server.stop()
    values = [mb for _, mb in samples]
    slope = float(np.polyfit([t for t, _ in samples], values, 1)[0]) * 60 if len(samples) > 2 else None
    return {
        "warmup_seconds": args.warmup_seconds, "minutes": args.memory_minutes, "requests_measured": requests[0] - warm_requests,
        "rss_first_mb": values[0], "rss_last_mb": values[-1], "rss_min_mb": min(values), "rss_max_mb": max(values),
        "rss_spread_mb": round(max(values) - min(values), 2), "rss_slope_mb_per_min": round(slope, 3) if slope is not None else None,
        "rss_max_deviation_from_first_mb": round(max(abs(v - values[0]) for v in values), 2),
        "samples": samples, "goal_flat_10mb": max(abs(v - values[0]) for v in values) <= 10,
    }


# ---------------------------------------------------------------------- main


SCENARIOS = {"attack": attack, "shutdown": shutdown, "memory": memory}


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine() -> str:
    """``serve_load.machine``: the GPU where torch sees one (a server on CUDA runs there), the CPUs."""
    return serve_load.machine()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", nargs="+", choices=tuple(SCENARIOS), default=list(SCENARIOS))
    parser.add_argument("--quiet-seconds", type=float, default=20.0)
    parser.add_argument("--attack-seconds", type=float, default=20.0)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--shutdown-timeout", type=float, default=3.0)
    parser.add_argument("--warmup-seconds", type=float, default=60.0)
    parser.add_argument("--memory-minutes", type=float, default=10.0)
    parser.add_argument("--serve-args", default="", help="more dflash-trt serve flags, one string")
    parser.add_argument("--body-limit", type=int, default=1 << 20, help="the server's body limit (the default pair's default: 1 MiB)")
    parser.add_argument("--record", action="store_true", help="append one row per scenario to benchmarks/results.jsonl")
    args = parser.parse_args()
    results = {}
    for name in args.scenarios:
        results[name] = SCENARIOS[name](args)
        shown = {k: v for k, v in results[name].items() if k != "samples"}
        print(f"\n## {name}\n\n| figure | value |\n| --- | --- |")
        for key, value in shown.items():
            print(f"| {key} | {json.dumps(value)} |")
        sys.stdout.flush()
    summary = {"name": "serve_adversarial", "date": time.strftime("%Y-%m-%d"), "commit": commit(), "machine": machine(),
               "command": " ".join(["python", "benchmarks/serve_adversarial.py", *sys.argv[1:]]), **results}
    if args.record:
        record.append_rows({"name": f"serve_adversarial_{name}", **{k: summary[k] for k in ("date", "commit", "machine", "command")}, **figures}
                           for name, figures in results.items())
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
