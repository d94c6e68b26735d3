"""The serving loop alone under load: closed-loop clients on threads, no HTTP, requests joining at the gap or mid-execute.

    python benchmarks/serve_engine.py [--clients 16 64] [--seconds 6] [--max-new-tokens 64] [--max-sessions 128]
        [--joins gap running] [--modes on off] [--device cuda] [--kernels auto] [--launch-rounds 1 2] [--lag 1 2]
        [--policies always adaptive 3 7] [--record]

The default pair (bf16 on CUDA, fp32 on the CPU) on the torch backend, one ``ServingLoop`` per (mode,
join): DFlash (the default policy) or plain decoding, with queued requests joining between executes
(``gap``: ``join_running=False``, the early join) or the running execute (``running``). ``--clients``
threads each submit a held-out prompt (token ids), wait for its completion and submit the next, for a
warm-up of ``--seconds`` / 2, then a window of ``--seconds``. What the engine and its serving loop
deliver without the HTTP fronts, and how its launches are shaped: per row tokens/s (completed requests'
tokens over the window), requests/s, executes/s, loop launches per second and the rounds each ran
(``--launch-rounds``: the executor's most per launch, default 1; ``--lag``: the launches each lane keeps
queued beyond the one read, default 1, adjacent windows per mode; ``--policies``: DFlash's speculation policies,
each in turn: ``always``, the executor's default, cycling at the draft's P, ``adaptive``, serve's default, or a
verify length k of the export's (``Dims.verify_proposals``: every drafting lane cycles verifying the first k
proposals, for what a shorter verify costs the device), owners per round (lanes per loop round:
the executes' cycle and decode-step lane counts over their rounds), the rounds' padded owner counts' mean
(from the cycle table: DFlash's cycle rounds; none in plain decoding, whose table gives each request's first
token, read with its prefill, a round of one of its own: ``-``), device ms per loop
launch and the device's busy share of the window (loop launches only: the joining prompts' prefills
are not timed), TTFT p50 / p99 (the loop's own), and the serving thread's CPU share.

Prints one table and ends with one JSON line; ``--record`` appends a row per (mode, join, clients).
"""

from __future__ import annotations

import argparse
import math
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import record  # noqa: E402  (benchmarks/record.py: results.jsonl)
from gpu_e2e import default_pair, dims_of, machine  # noqa: E402

from dflash_trt.runtime.backends.torch_backend import TorchBackend  # noqa: E402
from dflash_trt.runtime.device_loop import padded  # noqa: E402
from dflash_trt.runtime.executor import Executor  # noqa: E402
from dflash_trt.runtime.policy import CYCLE, FIXED, Choice
from dflash_trt.runtime.serving.loop import ServingLoop  # noqa: E402
from dflash_trt.runtime.serving.metrics import MetricsRecorder  # noqa: E402
from dflash_trt.runtime import stats


class FixedVerify:
    """A speculation policy for measuring: every drafting lane cycles, verifying the first ``k`` proposals."""

    def __init__(self, k: int) -> None:
        self.k = k

    def observe(self, *args, **kwargs) -> None:
        pass

    def choose(self, owners: int) -> Choice:
        return Choice(CYCLE, FIXED, math.nan, CYCLE, owners, proposals=self.k)


def policy_of(name: str, dims) -> str | FixedVerify:
    """``--policies``' value as ``Executor(policy=)`` takes it: a policy's name, or ``FixedVerify`` for a verify length."""
    if not name.isdigit():
        return name
    if int(name) not in dims.verify_proposals:
        raise SystemExit(f"--policies: a verify length must be one of the export's {list(dims.verify_proposals)}, got {name}")
    return FixedVerify(int(name))


def clients_for(serving: ServingLoop, prompts: list[list[int]], clients: int, seconds: float, max_new: int) -> tuple[int, int]:
    """``clients`` threads submitting back to back for ``seconds``: (tokens, requests) of those that completed."""
    stop_at, done = time.perf_counter() + seconds, [[0, 0] for _ in range(clients)]

    def client(index: int) -> None:
        n = index
        while time.perf_counter() < stop_at:
            tokens = serving.submit(prompts[n % len(prompts)], max_new).result(120).tokens
            if time.perf_counter() <= stop_at:
                done[index][0] += len(tokens)
                done[index][1] += 1
            n += clients

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(d[0] for d in done), sum(d[1] for d in done)


def lane_rounds_of(executes) -> int:
    """The lanes' rounds the execute rows count (``stats.lane_rounds``: no prompt rows)."""
    return stats.lane_rounds(int(executes["cycles"].sum()), int(executes["target_decode_steps"].sum()))


def thread_cpu_s(thread: threading.Thread) -> float:
    """CPU seconds of a Python thread so far (Linux), 0.0 where unknown."""
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    except (AttributeError, OSError, TypeError):
        return 0.0


def measure(executor: Executor, prompts: list[list[int]], clients: int, args, join_running: bool) -> dict:
    serving = ServingLoop(executor, max_running=args.max_sessions, join_running=join_running)
    try:
        clients_for(serving, prompts, clients, args.seconds / 2, args.max_new_tokens)  # warm-up: captures, allocator
        executor.clear_stats()
        executor.loop.timeline.reset()  # the window's loop launches only
        serving.recorder = MetricsRecorder()  # the window's latencies only
        cpu, started = thread_cpu_s(serving.thread), time.perf_counter()
        tokens, requests = clients_for(serving, prompts, clients, args.seconds, args.max_new_tokens)
        wall = time.perf_counter() - started
        cpu = thread_cpu_s(serving.thread) - cpu
        metrics = serving.metrics()
    finally:
        serving.close()
    cycles, executes = executor.cycle_stats(), executor.execute_stats()
    loop_rows = cycles.filter(cycles["mode"] != "target") if executor.speculate else cycles
    rounds = loop_rows["cycle_id"].n_unique()  # one cycle id per round read (a launch of several rounds: several)
    owners = loop_rows.group_by("cycle_id").len()["len"]
    device_ms = executor.loop.timeline.busy_ms  # the loop's launches (cycles and decode steps), from its own events
    launches, most = int(executes["loop_launches"].sum()), executor.dims.max_owners
    # Lanes per loop round from the executes' counters: the cycle table also holds a row per request for its
    # first token (a round id of its own), which would halve plain decoding's figure.
    lane_rounds, loop_rounds = lane_rounds_of(executes), int(executes["loop_rounds"].sum())
    return {
        "launch_rounds": executor.loop.most_rounds, "lag": executor.lag, "rounds_per_launch": round(loop_rounds / max(launches, 1), 2),
        "tok_s": round(tokens / wall), "requests_per_s": round(requests / wall, 1), "executes_per_s": round(executes.height / wall, 1),
        "launches_per_s": round(launches / wall), "owners_per_launch": round(lane_rounds / max(loop_rounds, 1), 2),
        "padded_owners": round(sum(padded(min(int(n), most), most) for n in owners) / max(rounds, 1), 2) if executor.speculate else None,
        "device_ms_per_launch": round(device_ms / max(launches, 1), 3), "device_busy_pct": round(100 * device_ms / 1e3 / wall, 1),
        "device_us_per_token": round(1e3 * device_ms / max(tokens, 1), 2), "serving_us_per_token": round(1e6 * cpu / max(tokens, 1), 2),
        "ttft_p50_ms": round(metrics.ttft_s.p50 * 1e3, 2), "ttft_p99_ms": round(metrics.ttft_s.p99 * 1e3, 2),
        "serving_cpu_pct": round(100 * cpu / wall, 1),
    }


def run(args: argparse.Namespace) -> list[dict]:
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    target, draft, prompts, _ = default_pair(dtype)
    dims = dims_of(target, draft, args.max_sessions, dtype)
    backend = TorchBackend(target, draft, dims, args.max_sessions, device=args.device, kernels=args.kernels)
    rows = []
    try:
        runs = [(r, m, lag, p) for r in args.launch_rounds for m in args.modes for lag in args.lag for p in (args.policies if m == "on" else ["-"])]
        for launch_rounds, mode, lag, policy in runs:
            with Executor(backend, max_sessions=args.max_sessions, speculate=mode == "on", launch_rounds=launch_rounds, lag=lag,
                          policy=policy_of(policy, dims) if mode == "on" else "always") as executor:
                for clients in args.clients:
                    for join in args.joins:
                        row = {"mode": mode, "policy": policy, "join": join, "clients": clients, "kernels": backend.kernels,
                               **measure(executor, prompts, clients, args, join == "running")}
                        rows.append(row)
                        print(row, flush=True)
    finally:
        backend.close()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-sessions", type=int, default=128)
    parser.add_argument("--joins", nargs="+", choices=("gap", "running"), default=["gap", "running"])
    parser.add_argument("--modes", nargs="+", choices=("on", "off"), default=["on", "off"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--kernels", default="auto", help="the torch backend's kernels (auto, exact, fast, ...)")
    parser.add_argument("--launch-rounds", type=int, nargs="+", default=[1], help="the executor's launch_rounds, each in turn (default 1)")
    parser.add_argument("--lag", type=int, nargs="+", default=[1], help="the executor's lag, each in turn per mode (default 1)")
    parser.add_argument("--policies", nargs="+", default=["always"],
                        help="DFlash's policies, each in turn: always (the executor's default), adaptive (serve's), or a verify length k")
    parser.add_argument("--record", action="store_true", help="append the rows to benchmarks/results.jsonl")
    args = parser.parse_args()
    if min(args.clients) < 1 or max(args.clients) > args.max_sessions or args.seconds <= 0:
        parser.error(f"--clients must lie in [1, --max-sessions {args.max_sessions}] and --seconds > 0, got {args.clients}, {args.seconds}")
    rows = run(args)
    print("| mode | policy | lag | join | clients | rounds / launch (most) | tok/s | requests/s | executes/s | launches/s | owners / round "
          "| padded owners | device ms / launch | device µs / token | serving µs / token | device busy % | TTFT p50 / p99 ms | serving CPU % |")
    print("|" + " --- |" * 18)
    for r in rows:
        print(f"| {r['mode']} | {r['policy']} | {r['lag']} | {r['join']} | {r['clients']} | {r['rounds_per_launch']} ({r['launch_rounds']}) | {r['tok_s']:,} "
              f"| {r['requests_per_s']} | {r['executes_per_s']} | {r['launches_per_s']:,} | {r['owners_per_launch']} | {'-' if r['padded_owners'] is None else r['padded_owners']} "
              f"| {r['device_ms_per_launch']} | {r['device_us_per_token']} | {r['serving_us_per_token']} | {r['device_busy_pct']} "
              f"| {r['ttft_p50_ms']} / {r['ttft_p99_ms']} | {r['serving_cpu_pct']} |")
    meta = {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "command": " ".join(["python", *sys.argv])}
    if args.record:
        record.append_rows([{"name": "serve_engine", **meta, "seconds": args.seconds, "max_new_tokens": args.max_new_tokens, **row} for row in rows])
    return record.finish({"name": "serve_engine_summary", **meta, "rows": rows}, args.record)


if __name__ == "__main__":
    sys.exit(main())
