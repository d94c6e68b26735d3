"""What the HTTP front costs per request and per streamed event, with the engine taken out.

``dflash-trt serve`` runs its HTTP front (FastAPI + uvicorn: parsing, tokenizing, detokenizing,
SSE) in one process beside the serving process. At many streams that one process may be the limit
while the engine is not (on the H200 at 64 streams the serving process's own TTFT / ITL p99 were
10.8 / 15.8 ms, the clients' 261 / 35.8 ms). This benchmark measures the front alone, on any machine:

- the front is the product's own (``server.app.create_app`` over ``server.front.ServingClient``,
  ``ServeConfig`` / ``GracefulServer``, the default pair's tokenizer), in a process of its own;
- the serving process is a stand-in speaking ``server.wire``: every ``--round-ms`` it delivers
  ``--tokens-per-round`` tokens (ids of real held-out completions: real detokenization) to each of up to
  ``--max-sessions`` open requests, and keeps the product's ``MetricsRecorder`` for /metrics;
- the clients are serve_load's (the official openai client, streaming, over ``--client-procs`` processes).

Per client count it prints requests/s, streamed events/s, tokens/s, client TTFT / ITL p50 / p99, the
server-side (stand-in) TTFT / ITL p99, and each role's busiest process's CPU (% of one core): the
fronts' CPU per request and per event is what limits the server (``front CPU ms / request`` = every
front's CPU seconds over the window / requests; ``µs / event`` = the same over SSE events). ``--fronts N``
runs the product's ``serve --fronts N`` layout (``server.fronts``) over the stand-in; ``--http`` its parser.

    python benchmarks/front_cost.py [--clients 16 64] [--seconds 10] [--round-ms 5] [--tokens-per-round 3]
        [--max-tokens 64] [--max-sessions 64] [--client-procs 4] [--fronts 1] [--http h11|httptools] [--record]

The last line printed is one JSON object; ``--record`` appends one row per client count to
benchmarks/results.jsonl.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import record  # results.jsonl
import serve_load  # the clients, the window, the CPU shares

from dflash_trt.server.command import HTTP_PARSERS  # noqa: E402  (serve --http's choices)


# ---------------------------------------------------------------------- the stand-in serving process


class StandIn:
    """The serving process's side of the pipes (one per front) without an engine: rounds of tokens on a
    clock. A request is known by (front, key), as in ``server.serving_process``."""

    def __init__(self, conns: list, max_sessions: int, per_round: int, token_ids: list[int]) -> None:
        from dflash_trt.runtime.serving.metrics import MetricsRecorder

        self.conns, self.max_sessions, self.per_round, self.token_ids = conns, max_sessions, per_round, token_ids
        self.recorder = MetricsRecorder()
        self.queue: deque = deque()  # ((front, key), max_new_tokens, submitted)
        self.running: dict[tuple[int, int], list] = {}  # -> [left, submitted, last delivery or None, next token index]
        self.accepting = True

    def serve(self, round_s: float) -> None:
        from multiprocessing.connection import wait

        from dflash_trt.server import wire

        for conn in self.conns:
            conn.send(wire.Ready(True, self.max_sessions, 4096, 151_936, None, os.getpid()))
        handlers = {wire.Submit: self._submit, wire.Cancel: self._cancel, wire.Close: self._close, wire.MetricsQuery: self._metrics}
        live = {conn: i for i, conn in enumerate(self.conns)}
        next_round = time.perf_counter() + round_s
        while live:
            for conn in wait(list(live), max(0.0, next_round - time.perf_counter())):
                try:
                    message = conn.recv()
                except EOFError:
                    del live[conn]
                    continue
                if isinstance(message, wire.Exit):
                    return
                handlers[type(message)](message, live[conn])
            if time.perf_counter() >= next_round:
                self._round()
                next_round = max(next_round + round_s, time.perf_counter())  # never a burst of late rounds

    def _submit(self, message, front: int) -> None:
        from dflash_trt.errors import ServingClosedError
        from dflash_trt.server import wire

        if not self.accepting:
            self.conns[front].send(wire.Refused(message.key, wire.WireError.of(ServingClosedError("closed"))))
            return
        self.queue.append(((front, message.key), message.max_new_tokens, time.perf_counter()))
        self.recorder.count("submitted")
        self.conns[front].send(wire.Deliveries((), (), (message.key,)))  # accepted (serve batches these with tokens)

    def _cancel(self, message, front: int) -> None:
        job = self.running.pop((front, message.key), None)
        if job is not None:
            self.recorder.finished("cancelled", time.perf_counter() - job[1])
        self.queue = deque(item for item in self.queue if item[0] != (front, message.key))

    def _close(self, message, front: int) -> None:
        self.accepting = False

    def _metrics(self, message, front: int) -> None:
        from dflash_trt.server import wire

        self.conns[front].send(wire.MetricsReply(message.seq, self.recorder.snapshot(len(self.running), len(self.queue))))

    def _round(self) -> None:
        """One round: queued requests take free sessions, every running one gets its tokens (one
        Deliveries message per front)."""
        from dflash_trt.runtime.finish import LENGTH
        from dflash_trt.runtime.serving.metrics import ExecuteTotals
        from dflash_trt.server import wire

        now = time.perf_counter()
        while self.queue and len(self.running) < self.max_sessions:
            request, budget, submitted = self.queue.popleft()
            self.recorder.joined(now - submitted)
            self.running[request] = [budget, submitted, None, request[1] * 7]
        items: dict[int, list] = {}
        for (front, key), job in list(self.running.items()):
            count = min(self.per_round, job[0])
            tokens = [self.token_ids[(job[3] + i) % len(self.token_ids)] for i in range(count)]
            job[0] -= count
            job[3] += count
            finish = LENGTH if job[0] == 0 else None
            items.setdefault(front, []).append((key, tokens, finish))
            self.recorder.delivered(now, count, now - job[1] if job[2] is None else None, None if job[2] is None else now - job[2])
            job[2] = now
            if finish is not None:
                del self.running[(front, key)]
                self.recorder.finished("completed", now - job[1])
        delivered = [item for front_items in items.values() for item in front_items]
        if delivered:
            self.recorder.executed(ExecuteTotals(cycles=len(delivered), accepted=sum(len(t) for _, t, _ in delivered) - len(delivered), executes=1))
        for front, front_items in items.items():
            try:
                self.conns[front].send(wire.Deliveries(tuple(front_items)))
            except OSError:
                pass  # that front is gone


def stand_in_main(conns: list, max_sessions: int, per_round: int, token_ids: list[int], round_s: float) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    StandIn(conns, max_sessions, per_round, token_ids).serve(round_s)


# ---------------------------------------------------------------------- the front


def serve_args(fronts: int, http: str = HTTP_PARSERS[0]) -> argparse.Namespace:
    """``dflash-trt serve``'s arguments for the default pair's tokenizer (what the product's fronts read)."""
    from dflash_trt.server import command

    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    tokenizer = str(ROOT / "export" / "default_pair" / "target")
    return parser.parse_args(["--tokenizer", tokenizer, "--served-model-name", "front-cost", "--fronts", str(fronts), "--http", http, "--log-level", "warning"])


def front_main(port: int, args: argparse.Namespace, token_ids: list[int], pid_file: str) -> None:
    """The product's fronts (``serve --fronts``: this one and ``args.fronts - 1`` more, sharing the port)
    over the stand-in, on 127.0.0.1:``port`` until SIGINT."""
    from dflash_trt.server import command, front
    from dflash_trt.server.fronts import Fronts

    serve = serve_args(args.fronts, args.http)
    logging_config = command._logging_config(serve.log_level)
    context = multiprocessing.get_context("spawn")
    pipes = [context.Pipe(duplex=True) for _ in range(args.fronts)]
    process = context.Process(target=stand_in_main, args=([b for _, b in pipes], args.max_sessions, args.tokens_per_round, token_ids, args.round_ms / 1000.0))
    process.start()
    conns = [a for a, _ in pipes]
    for _, child in pipes:
        child.close()
    ready = conns[0].recv()
    Path(pid_file).write_text(str(ready.pid))  # the stand-in's pid, for the CPU shares
    client = front.ServingClient(process, conns[0], ready, command._tokenizer(serve))
    listener = command.bind("127.0.0.1", port)
    others = Fronts(conns[1:], listener, serve, logging_config) if args.fronts > 1 else None

    def prepare(server) -> None:
        server.on_signal = others.signal if others is not None else None

    command.serve_http(client, ["front-cost"], serve, logging_config, listener, 0, prepare)
    if others is not None:
        others.join(5.0)
    client.stop()


def completion_ids() -> list[int]:
    """Token ids of the default pair's held-out completions (what the stand-in streams)."""
    from dflash_trt.export.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(ROOT / "export" / "default_pair" / "target")
    rows = [json.loads(line) for line in (ROOT / "export" / "default_pair" / "prompts.jsonl").read_text().splitlines() if line.strip()]
    text = "".join(row.get("completion", row["prompt"][-200:]) for row in rows[:64])
    return tokenizer.encode(text)


def start_front(args, token_ids: list[int], pid_file: Path) -> tuple[multiprocessing.Process, str]:
    port = serve_load.free_port()
    process = multiprocessing.get_context("spawn").Process(target=front_main, args=(port, args, token_ids, str(pid_file)), name="front")
    process.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            import urllib.request

            with urllib.request.urlopen(base + "/health", timeout=2) as response:
                if response.status == 200:
                    return process, base
        except OSError:
            time.sleep(0.2)
    process.kill()
    raise SystemExit("the front did not answer /health within 120 s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--warmup-seconds", type=float, default=2.0)
    parser.add_argument("--round-ms", type=float, default=5.0, help="the stand-in's round: every open request gets tokens this often")
    parser.add_argument("--tokens-per-round", type=int, default=3, help="tokens per request per round (~ tau)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="the requests' temperature (the stand-in ignores it)")
    parser.add_argument("--max-sessions", type=int, default=64)
    parser.add_argument("--client-procs", type=int, default=4)
    parser.add_argument("--fronts", type=int, default=1, help="HTTP front processes (serve --fronts)")
    parser.add_argument("--http", choices=HTTP_PARSERS, default=HTTP_PARSERS[0], help="the fronts' HTTP parser (serve --http)")
    parser.add_argument("--prompt-chars", type=int, default=600)
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()
    rows = [json.loads(line) for line in (ROOT / "export" / "default_pair" / "prompts.jsonl").read_text().splitlines() if line.strip()]
    prompts = [row["prompt"][-args.prompt_chars :] for row in rows]
    pid_file = Path(tempfile.mkdtemp()) / "stand_in.pid"
    process, base = start_front(args, completion_ids(), pid_file)
    stand_in = int(pid_file.read_text())
    roles = {"front": [process.pid] + [p for p in serve_load.children(process.pid) if p != stand_in], "serving": [stand_in]}
    results = {}
    print("| clients | requests/s | events/s | tokens/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | stand-in TTFT / ITL p99 ms "
          "| CPU % front / stand-in / client | front CPU ms / request | front CPU µs / event |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |", flush=True)
    try:
        for clients in args.clients:
            figures = serve_load.load(base, args, prompts, clients, roles)
            front_s = (figures["front_cpu_total_pct"] or 0.0) / 100.0 * args.seconds  # every front's CPU
            events = figures["events"]
            figures |= {
                "events_per_s": round(events / args.seconds, 1),
                "front_cpu_ms_per_request": round(1000.0 * front_s / figures["requests"], 3) if figures["requests"] else None,
                "front_cpu_us_per_event": round(1e6 * front_s / events, 1) if events else None,
            }
            results[str(clients)] = {"clients": clients, **figures}
            print(f"| {clients} | {figures['requests_per_s']} | {figures['events_per_s']} | {figures['output_tokens_per_s']} "
                  f"| {figures['ttft_p50_ms']} / {figures['ttft_p99_ms']} | {figures['itl_p50_ms']} / {figures['itl_p99_ms']} "
                  f"| {figures['server_ttft_p99_ms']} / {figures['server_itl_p99_ms']} "
                  f"| {figures['front_cpu_pct']} / {figures['serving_cpu_pct']} / {figures['client_cpu_pct']} "
                  f"| {figures['front_cpu_ms_per_request']} | {figures['front_cpu_us_per_event']} |", flush=True)
    finally:
        os.kill(process.pid, signal.SIGINT)
        process.join(30)
        if process.is_alive():
            process.kill()
    summary = {"name": "front_cost", "date": time.strftime("%Y-%m-%d"), "machine": serve_load.machine(),
               "command": " ".join(["python", "benchmarks/front_cost.py", *sys.argv[1:]]), "round_ms": args.round_ms,
               "tokens_per_round": args.tokens_per_round, "fronts": args.fronts, "http": args.http, "max_tokens": args.max_tokens, "max_sessions": args.max_sessions,
               "seconds": args.seconds, "runs": results}
    if args.record:
        record.append_rows({**{k: v for k, v in summary.items() if k != "runs"}, **figures} for figures in results.values())
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
