"""Several serving loops on one GPU, each in a process of its own, against one loop serving every client.

    python benchmarks/engine_share.py [--plan 64x1 64x2 64x4 16x1 16x2] [--modes on off] [--seconds 5]
        [--warmup-seconds 4] [--max-new-tokens 64] [--max-sessions 64] [--device cuda] [--record]

Where one serving thread's host work is the limit (at 16 and 64 streams the device is busy a third to a half of
the time, benchmarks/RESULTS.md), a second process with a serving loop of its own would bring a second core, if
the GPU interleaved the processes' launches well. This measures it: per ``CLIENTSxPROCESSES`` of ``--plan``, that
many processes each run ``serve_engine``'s loop over the default pair (the torch backend, bf16 on CUDA; requests
joining the running execute) with CLIENTS / PROCESSES closed-loop client threads, warm up, meet at a barrier and
measure one window together. Per row: the tokens per second of all processes summed, and per process its own,
its device busy share (its launches' own events: time another process's work ran between them counts) and its
serving thread's CPU.

Prints one table and ends with one JSON line; ``--record`` appends a row per (mode, plan entry).
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import record  # noqa: E402  (benchmarks/record.py: results.jsonl)


def engine(mode: str, clients: int, args: argparse.Namespace, index: int, barrier, results) -> None:
    """One process's serving loop: warm-up, the shared window (between two barrier waits), its figures."""
    import torch
    from dflash_trt.runtime.backends.torch_backend import TorchBackend
    from dflash_trt.runtime.executor import Executor
    from dflash_trt.runtime.serving.loop import ServingLoop
    from gpu_e2e import default_pair, dims_of
    from serve_engine import clients_for, thread_cpu_s

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    target, draft, prompts, _ = default_pair(dtype)
    prompts = prompts[index:] + prompts[:index]  # each process its own order of the held-out prompts
    sessions = args.max_sessions
    backend = TorchBackend(target, draft, dims_of(target, draft, sessions, dtype), sessions, device=args.device)
    try:
        with Executor(backend, max_sessions=sessions, speculate=mode == "on") as executor:
            serving = ServingLoop(executor, max_running=sessions, join_running=True)
            try:
                clients_for(serving, prompts, clients, args.warmup_seconds, args.max_new_tokens)
                executor.loop.timeline.reset()
                barrier.wait()
                cpu, started = thread_cpu_s(serving.thread), time.perf_counter()
                tokens, requests = clients_for(serving, prompts, clients, args.seconds, args.max_new_tokens)
                wall = time.perf_counter() - started
                cpu = thread_cpu_s(serving.thread) - cpu
                results.put({"index": index, "tok_s": round(tokens / wall), "requests": requests,
                             "device_busy_pct": round(100 * executor.loop.timeline.busy_ms / 1e3 / wall, 1),
                             "serving_cpu_pct": round(100 * cpu / wall, 1)})
                barrier.wait()  # the others' windows end before this process's work stops
            finally:
                serving.close()
    finally:
        backend.close()


def trial(mode: str, clients: int, processes: int, args: argparse.Namespace) -> dict:
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(processes), context.Queue()
    shares = [clients // processes + (i < clients % processes) for i in range(processes)]
    children = [context.Process(target=engine, args=(mode, share, args, i, barrier, results)) for i, share in enumerate(shares)]
    for child in children:
        child.start()
    rows = sorted((results.get(timeout=600) for _ in children), key=lambda row: row["index"])
    for child in children:
        child.join(120)
    return {"mode": mode, "clients": clients, "processes": processes, "tok_s": sum(row["tok_s"] for row in rows), "per_process": rows}


def plan_entry(text: str) -> tuple[int, int]:
    clients, _, processes = text.partition("x")
    try:
        pair = int(clients), int(processes)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be CLIENTSxPROCESSES (e.g. 64x2), got {text!r}") from None
    if pair[1] < 1 or pair[0] < pair[1]:
        raise argparse.ArgumentTypeError(f"needs at least one process and a client per process, got {text!r}")
    return pair


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", type=plan_entry, nargs="+", default=[plan_entry(p) for p in ("64x1", "64x2", "64x4", "16x1", "16x2")])
    parser.add_argument("--modes", nargs="+", choices=("on", "off"), default=["on", "off"])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--warmup-seconds", type=float, default=4.0)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-sessions", type=int, default=64, help="each process's sessions (at least its clients)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--record", action="store_true", help="append the rows to benchmarks/results.jsonl")
    args = parser.parse_args()
    if any(-(-clients // processes) > args.max_sessions for clients, processes in args.plan):
        parser.error(f"--max-sessions {args.max_sessions} is below a process's clients in --plan")
    from gpu_e2e import machine

    rows = []
    print("| mode | clients | processes | tok/s (all) | per process: tok/s, device busy %, serving CPU % |")
    print("| --- | --- | --- | --- | --- |")
    for clients, processes in args.plan:
        for mode in args.modes:
            row = trial(mode, clients, processes, args)
            rows.append(row)
            each = "; ".join(f"{r['tok_s']:,}, {r['device_busy_pct']}, {r['serving_cpu_pct']}" for r in row["per_process"])
            print(f"| {mode} | {clients} | {processes} | {row['tok_s']:,} | {each} |", flush=True)
    meta = {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "command": " ".join(["python", *sys.argv])}
    if args.record:
        record.append_rows([{"name": "engine_share", **meta, "seconds": args.seconds, **row} for row in rows])
    return record.finish({"name": "engine_share_summary", **meta, "rows": rows}, args.record)


if __name__ == "__main__":
    sys.exit(main())
