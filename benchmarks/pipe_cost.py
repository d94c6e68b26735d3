"""The serving process's pipe side on the CPU: what its main and sender threads take from the serving thread.

    python benchmarks/pipe_cost.py [--clients 64] [--fronts 4] [--seconds 5] [--modes on off] [--tau 2.8]
        [--max-new-tokens 64] [--launch-rounds 1] [--device-us 390 230 7.5] [--record]

``dflash-trt serve`` runs the executor in a serving process whose main thread reads the fronts' pipes (submits,
cancels) and whose sender threads (one per front) pickle and send the deliveries. They share the serving thread's
GIL: at 64 streams on an H100 (benchmarks/RESULTS.md) the serving process ran at ~100% of one core, its GIL held
~34% of the time by them, and its device busy ~27%. ``host_cost.py`` measures the serving thread alone (client
threads in its process); this runs the product's ``server.serving_process.ServingProcess`` (its main thread's loop
in a thread here, the product's senders, ``ForwardingHandle``) over host_cost's tiny pair and stand-in device,
fed by ``--fronts`` processes speaking ``server.wire`` as the HTTP fronts do: ``--clients`` closed-loop requests
in all (each finished request is submitted again at once), greedy, no stop tokens.

Per mode it prints tokens/s and requests/s the fronts received in the window, the lanes' rounds per loop launch
(the whole run's: how whole the served load keeps a launch), the CPU of the serving thread and of the pipe threads
(the main loop and the senders), each per request and per token, and the CPU of the whole process. The pipe
threads' CPU per request is what a serving process spends beside the serving thread for each request; where the
process is bound by its GIL (the serving thread's CPU + the pipe threads' ≈ one core), every µs of it comes out
of the serving thread's time.
Prints one table and ends with one JSON line; ``--record`` appends a row per mode.
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import record  # noqa: E402  (benchmarks/record.py: results.jsonl)
from host_cost import PROMPT_TOKENS, VOCAB, DeviceClock, DeviceQueue, stand_in_prefill, stand_in_program, tiny_pair, with_device  # noqa: E402
from serve_engine import lane_rounds_of, thread_cpu_s  # noqa: E402

from dflash_trt.export.sampling import GREEDY  # noqa: E402
from dflash_trt.runtime import device_loop  # noqa: E402
from dflash_trt.runtime.backends.torch_backend import TorchBackend  # noqa: E402
from dflash_trt.runtime.executor import Executor  # noqa: E402
from dflash_trt.runtime.prefill import PrefillPrograms  # noqa: E402
from dflash_trt.runtime.serving.loop import ServingLoop  # noqa: E402
from dflash_trt.server import wire  # noqa: E402
from dflash_trt.server.serving_process import ServingProcess  # noqa: E402


def front(conn, clients: int, max_new: int, prompts: list[list[int]], window: tuple[float, float], results) -> None:
    """A front's stand-in (its own process): ``clients`` requests open at once, each resubmitted as it
    finishes, from the serving process's ``Ready`` until ``warm-up + seconds`` (``window``) later; puts
    (tokens, requests) received inside the window on ``results``."""
    results.put(None)  # up: the serving process starts once every front is
    conn.recv()  # wire.Ready
    start = time.perf_counter() + window[0]
    stop = start + window[1]
    key, tokens, requests = 0, 0, 0

    def submit() -> None:
        nonlocal key
        conn.send(wire.Submit(key, prompts[key % len(prompts)], max_new, GREEDY, None))
        key += 1

    for _ in range(clients):
        submit()
    while (now := time.perf_counter()) < stop:
        if not conn.poll(0.01):
            continue
        message = conn.recv()
        if isinstance(message, wire.Refused):
            submit()
            continue
        if not isinstance(message, wire.Deliveries):
            continue
        inside = now >= start
        for _, new, finish in message.items:
            tokens += len(new) if inside else 0
            if finish is not None:
                requests += inside
                submit()
    results.put((tokens, requests))
    while conn.poll(0.2):  # drain what is in flight, so the serving process's senders never block on a full pipe
        conn.recv()


def measure(mode: str, args, context) -> dict:
    sessions = args.max_sessions or args.clients
    target, draft, dims = tiny_pair(sessions)
    backend = TorchBackend(target, draft, dims, sessions, device="cpu", kernels="fast")
    clock = DeviceClock()
    saved = device_loop.DeviceLoop._program, PrefillPrograms._program, device_loop.DeviceLoop.launch, device_loop.DeviceLoop.read
    device_loop.DeviceLoop._program = clock.timed(stand_in_program(args.tau, torch.Generator().manual_seed(0)))
    PrefillPrograms._program = clock.timed(stand_in_prefill(torch.Generator().manual_seed(2)))
    device = DeviceQueue(*args.device_us) if args.device_us else None
    if device is not None:
        with_device(device, clock)
    prompts = torch.randint(1, VOCAB - 1, (64, PROMPT_TOKENS), generator=torch.Generator().manual_seed(1)).tolist()
    pipes = [context.Pipe() for _ in range(args.fronts)]
    results = context.Queue()
    window = (args.warmup_seconds, args.seconds)
    shares = [args.clients // args.fronts + (i < args.clients % args.fronts) for i in range(args.fronts)]
    fronts = [context.Process(target=front, args=(pipe[1], share, args.max_new_tokens, prompts, window, results), daemon=True)
              for pipe, share in zip(pipes, shares)]
    try:
        executor = Executor(backend, max_sessions=sessions, stats_rows=None, speculate=mode == "on", policy=args.policy,
                            launch_rounds=args.launch_rounds)
        process = ServingProcess([pipe[0] for pipe in pipes])
        serving = ServingLoop(executor, max_running=sessions, stop_ids=(), handles=process.handle, flush=process.flush)
        ready = wire.Ready(executor.speculate, sessions, dims.max_context, dims.vocab_size, None, 0)
        for f in fronts:
            f.start()
        for _ in fronts:
            results.get(timeout=120)
        main = threading.Thread(target=process.run, args=(serving, ready), name="pipes-main", daemon=True)
        main.start()
        time.sleep(args.warmup_seconds)
        threads = {"serving": [serving.thread], "main": [main], "senders": [f.sender for f in process.fronts]}
        cpu = {role: sum(thread_cpu_s(t) for t in ts) for role, ts in threads.items()}
        process_cpu, stand_in = time.process_time(), clock.seconds
        time.sleep(args.seconds)
        cpu = {role: sum(thread_cpu_s(t) for t in ts) - cpu[role] for role, ts in threads.items()}
        process_cpu, stand_in = time.process_time() - process_cpu, clock.seconds - stand_in
        got = [results.get(timeout=30) for _ in fronts]
        if not serving.healthy:
            raise RuntimeError("the serving loop failed")
        for f in fronts:
            f.join(30)  # their pipes close: the main loop returns
        main.join(30)
        process.stop()
        executor.close()
    finally:
        device_loop.DeviceLoop._program, PrefillPrograms._program, device_loop.DeviceLoop.launch, device_loop.DeviceLoop.read = saved
        for f in fronts:
            f.join(5)
        backend.close()
    tokens, requests = sum(g[0] for g in got), sum(g[1] for g in got)
    executes = executor.execute_stats()  # the whole run's launches (warm-up and drain too): their shape, not a rate
    launches, lane_rounds = int(executes["loop_launches"].sum()), lane_rounds_of(executes)
    serving_cpu = cpu["serving"] - stand_in  # the stand-in device's own CPU is no host work
    cpu["pipes"] = cpu["main"] + cpu["senders"]
    return {
        "mode": mode, "clients": args.clients, "fronts": args.fronts, "max_sessions": sessions, "tau_asked": args.tau, "launch_rounds": args.launch_rounds, "device_us": args.device_us,
        "tok_s": round(tokens / args.seconds), "requests_per_s": round(requests / args.seconds, 1),
        "serving_cpu_pct": round(100 * serving_cpu / args.seconds, 1), "pipes_cpu_pct": round(100 * cpu["pipes"] / args.seconds, 1),
        "process_cpu_pct": round(100 * (process_cpu - stand_in) / args.seconds, 1),
        "serving_us_per_request": round(1e6 * serving_cpu / max(requests, 1), 1), "pipes_us_per_request": round(1e6 * cpu["pipes"] / max(requests, 1), 1),
        "main_us_per_request": round(1e6 * cpu["main"] / max(requests, 1), 1), "senders_us_per_request": round(1e6 * cpu["senders"] / max(requests, 1), 1),
        "serving_us_per_token": round(1e6 * serving_cpu / max(tokens, 1), 2), "pipes_us_per_token": round(1e6 * cpu["pipes"] / max(tokens, 1), 2),
        "lane_rounds_per_launch": round(lane_rounds / max(launches, 1), 2), "rounds_per_launch": round(int(executes["loop_rounds"].sum()) / max(launches, 1), 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64, help="requests open at once, over all fronts")
    parser.add_argument("--fronts", type=int, default=4, help="front processes (pipes), as serve --fronts N")
    parser.add_argument("--max-sessions", type=int, default=0, help="the executor's sessions (default: --clients)")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--warmup-seconds", type=float, default=2.0)
    parser.add_argument("--modes", nargs="+", choices=("on", "off"), default=["on", "off"])
    parser.add_argument("--tau", type=float, default=2.8, help="the stand-in's mean tokens per cycle (> 1)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--policy", default="adaptive")
    parser.add_argument("--launch-rounds", type=int, default=1, help="the executor's rounds per launch (default 1; serve's on CUDA: 4)")
    parser.add_argument("--device-us", type=float, nargs=3, metavar=("CYCLE", "DECODE", "OWNER"),
                        help="a stand-in device queue (host_cost's): µs per cycle and per decode step, plus per padded owner")
    parser.add_argument("--record", action="store_true", help="append the rows to benchmarks/results.jsonl")
    args = parser.parse_args()
    if args.clients < 1 or args.fronts < 1 or args.seconds <= 0 or args.tau <= 1 or (args.max_sessions and args.max_sessions < args.clients):
        parser.error(f"--clients >= 1, --fronts >= 1, --max-sessions 0 or >= --clients, --seconds > 0 and --tau > 1, got {args.clients}, "
                     f"{args.fronts}, {args.max_sessions}, {args.seconds}, {args.tau}")
    torch.set_num_threads(1)
    context = multiprocessing.get_context("spawn")
    rows = [measure(mode, args, context) for mode in args.modes]
    print("| mode | clients | fronts | tok/s | requests/s | lane-rounds / launch | serving thread CPU % | pipe threads CPU % | process CPU % "
          "| serving µs / request | pipes µs / request (main + senders) | serving µs / token | pipes µs / token |")
    print("|" + " --- |" * 13)
    for r in rows:
        print(f"| {r['mode']} | {r['clients']} | {r['fronts']} | {r['tok_s']:,} | {r['requests_per_s']} | {r['lane_rounds_per_launch']} | {r['serving_cpu_pct']} | {r['pipes_cpu_pct']} "
              f"| {r['process_cpu_pct']} | {r['serving_us_per_request']} | {r['pipes_us_per_request']} ({r['main_us_per_request']} + {r['senders_us_per_request']}) | {r['serving_us_per_token']} | {r['pipes_us_per_token']} |")
    meta = {"date": time.strftime("%Y-%m-%d"), "machine": "CPU", "command": " ".join(["python", *sys.argv])}
    if args.record:
        record.append_rows([{"name": "pipe_cost", **meta, "seconds": args.seconds, "max_new_tokens": args.max_new_tokens, **row} for row in rows])
    return record.finish({"name": "pipe_cost_summary", **meta, "rows": rows}, args.record)


if __name__ == "__main__":
    sys.exit(main())
