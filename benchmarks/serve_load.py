"""Load on ``dflash-trt serve``: N concurrent streaming clients for a fixed time.

Starts the server as a subprocess on 127.0.0.1 (the embedded default pair,
exported to the cache as ``dflash-trt demo`` does, unless ``--artifacts``),
then runs N clients (the official openai client, asyncio, one event loop)
that each send streaming completions back to back: a prompt from the
default pair's held-out code prompts, ``--max-tokens`` new tokens, greedy.
Requests still running when the time is up are cancelled (disconnect): they
do not count as requests, but their tokens (the server's own output-token
counter over the window) and latencies do.

Per mode (DFlash on, and off where the server has the switch) it prints:
requests/s and output tokens/s over the window, TTFT and inter-token
latency (gap between two stream events of a request: a DFlash cycle's
accepted tokens arrive together) p50/p99, τ from the server's /metrics.

    python benchmarks/serve_load.py [--clients 8] [--seconds 30] [--max-tokens 64] [--modes on off]
        [--artifacts DIR --backend onnxruntime] [--threads N] [--record]

``--record`` appends one row per mode to benchmarks/results.jsonl. The last
line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

MODES = {"on": [], "off": ["--no-speculate"]}  # "off" is one serve flag (Executor(speculate=False))
ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def serve_flags() -> str:
    return subprocess.run([sys.executable, "-m", "dflash_trt.cli", "serve", "--help"], capture_output=True, text=True, check=True).stdout


def start_server(args, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "dflash_trt.cli", "serve", "--port", str(port), "--max-sessions", str(args.max_sessions), *extra]
    if args.artifacts:
        command += ["--artifacts", str(args.artifacts), "--backend", args.backend]
    if args.threads:
        command += ["--threads", str(args.threads)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"server exited: {process.stdout.read()}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as response:
                if response.status == 200:
                    return process, base
        except OSError:
            time.sleep(0.5)
    process.kill()
    raise SystemExit("server not ready after 900 s")


def server_metrics(base: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(base + "/metrics", timeout=30) as response:
        text = response.read().decode()
    return {s.name + (f"[{s.labels['outcome']}]" if "outcome" in s.labels else "") + (f"[{s.labels['quantile']}]" if "quantile" in s.labels else ""): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def client_loop(client, model: str, prompts: list[str], index: int, args, stop_at: float, record: dict) -> None:
    """Back-to-back streaming requests until ``stop_at``; completed ones are recorded."""
    n = index
    while time.perf_counter() < stop_at:
        prompt = prompts[n % len(prompts)]
        n += args.clients
        started, events, finished = time.perf_counter(), [], False
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=args.max_tokens, temperature=0, stream=True)
        try:
            async for event in stream:
                if event.choices and event.choices[0].text:
                    events.append(time.perf_counter())
                finished = bool(event.choices and event.choices[0].finish_reason)
                if time.perf_counter() > stop_at:
                    break  # cut off by the window (the disconnect cancels it): latencies count, the request does not
        finally:
            await stream.close()
        if events:
            record["ttft"].append(events[0] - started)
            record["itl"].extend(np.diff(events).tolist())
        record["requests"] += finished


async def load(base: str, args, prompts: list[str]) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=600)
    model = (await client.models.list()).data[0].id
    # Warm-up: one request so first-call costs (ORT allocations) are outside the window.
    await client.completions.create(model=model, prompt=prompts[0], max_tokens=8, temperature=0)
    record = {"requests": 0, "ttft": [], "itl": []}
    before = server_metrics(base)
    started = time.perf_counter()
    stop_at = started + args.seconds
    await asyncio.gather(*(client_loop(client, model, prompts, i, args, stop_at, record) for i in range(args.clients)))
    elapsed = time.perf_counter() - started
    after = server_metrics(base)
    await client.close()
    cycles = after["dflash_trt_cycles_total"] - before["dflash_trt_cycles_total"]
    tokens = after["dflash_trt_output_tokens_total"] - before["dflash_trt_output_tokens_total"]  # partial requests too
    return {
        "requests": record["requests"],
        "output_tokens": int(tokens),
        "seconds": round(elapsed, 3),
        "requests_per_s": round(record["requests"] / elapsed, 3),
        "output_tokens_per_s": round(tokens / elapsed, 2),
        "ttft_p50_ms": _ms(record["ttft"], 50),
        "ttft_p99_ms": _ms(record["ttft"], 99),
        "itl_p50_ms": _ms(record["itl"], 50),
        "itl_p99_ms": _ms(record["itl"], 99),
        "tau": round(after["dflash_trt_acceptance_length"], 3) if cycles else None,  # since the server started (warm-up included)
    }


def _ms(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)) * 1000.0, 2) if values else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-sessions", type=int, default=16)
    parser.add_argument("--modes", nargs="+", choices=tuple(MODES), default=["on", "off"])
    parser.add_argument("--artifacts", type=Path, help="serve this export/engine dir (default: the embedded pair)")
    parser.add_argument("--backend", default="onnxruntime")
    parser.add_argument("--threads", type=int, help="server CPU threads (ONNX Runtime / torch)")
    parser.add_argument("--prompt-chars", type=int, default=600, help="keep the last N characters of each prompt")
    parser.add_argument("--record", action="store_true", help="append rows to benchmarks/results.jsonl")
    args = parser.parse_args()
    rows = [json.loads(line) for line in (ROOT / "export" / "default_pair" / "prompts.jsonl").read_text().splitlines() if line.strip()]
    prompts = [row["prompt"][-args.prompt_chars :] for row in rows]
    available = serve_flags()
    results = {}
    print(f"| mode | clients | requests/s | output tokens/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | τ |\n| --- | --- | --- | --- | --- | --- | --- |")
    for mode in args.modes:
        if any(flag not in available for flag in MODES[mode]):
            results[mode] = {"skipped": f"dflash-trt serve has no {' '.join(MODES[mode])} yet"}
            print(f"| {mode} | skipped: the server has no {' '.join(MODES[mode])} switch yet | | | | | |")
            continue
        process, base = start_server(args, MODES[mode])
        try:
            figures = asyncio.run(load(base, args, prompts))
        finally:
            process.send_signal(signal.SIGINT)
            process.wait(60)
        results[mode] = figures
        print(f"| {mode} | {args.clients} | {figures['requests_per_s']} | {figures['output_tokens_per_s']} | {figures['ttft_p50_ms']} / {figures['ttft_p99_ms']} "
              f"| {figures['itl_p50_ms']} / {figures['itl_p99_ms']} | {figures['tau']} |", flush=True)
    summary = {"name": "serve_load", "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()} {os.cpu_count()} CPUs",
               "command": " ".join(["python", "benchmarks/serve_load.py", *sys.argv[1:]]), "clients": args.clients, "seconds": args.seconds,
               "max_tokens": args.max_tokens, "max_sessions": args.max_sessions, "modes": results}
    if args.record:
        with (ROOT / "benchmarks" / "results.jsonl").open("a") as file:
            for mode, figures in results.items():
                file.write(json.dumps({**{k: v for k, v in summary.items() if k != "modes"}, "name": f"serve_load_{mode}", **figures}) + "\n")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
