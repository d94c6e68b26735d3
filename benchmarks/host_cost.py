"""The serving loop's host work per lane and round, and per request, on the CPU: the device's part taken out.

    python benchmarks/host_cost.py [--clients 64] [--seconds 6] [--modes on off] [--tau 2.8] [--max-new-tokens 64]
        [--stream-interval-ms 20] [--launch-rounds 1] [--lag 1] [--max-cycles 32] [--device-us 390 230 7.5] [--profile 25]
        [--profile-out STEM] [--repeats R] [--record]

What a serving thread spends in Python between launches decides the engine's throughput once the device is
fast (benchmarks/RESULTS.md: at 64 streams on the H200 the device is busy a half or less). This measures it
without a GPU: a tiny random pair on the torch backend (fast kernels' CPU twin, row-indexed programs) under a
``ServingLoop`` with ``--clients`` closed-loop client threads (``serve_engine.clients_for``), with the loop's
programs and its batched prefills' programs replaced by stand-ins that write their results at once: a
cycle accepts a ~ Geometric proposals (mean τ - 1, ``--tau``), a decode step and a prefill choose one token
each (requests have no stop tokens). The stand-ins' time (small) is taken out, so the serving thread's CPU
time left is host work only: planning, staging, launching, reading, stats, streaming, admissions.
``--device-us CYCLE DECODE OWNER`` gives the stand-in device a queue: a launch ends CYCLE (or DECODE) + OWNER ×
its padded owners µs per round after the later of its launch and the previous launch's end, and a read sleeps
until its launch has ended (the GIL free, as in a CUDA event wait); a prefill adds CYCLE µs. The device's busy share
and how the host's rounds overlap it then show, as on a GPU (``--lag``: launches queued per lane). Per
row: lane-rounds (the loop's owner-cycles and decode steps, from the execute rows' counters; the executor keeps no
cycle rows, as the server's does not: before 2026-12-06 each was a cycle-table row, one prompt row per request
counted too) and requests in the window, lanes per launch,
host µs per lane-round, per token returned and per request (the same host time over each count), tokens per lane-round, the serving thread's CPU
share, and the gaps between a request's deliveries (the loop's own ITL, ``--stream-interval-ms`` apart at
best; default the server's); the JSON rows also the loop's TTFT and end-to-end p50 per request. The client threads share the serving thread's GIL, as a serving process's pipe and sender threads do.
``--profile N`` prints the serving thread's N largest functions by own time (cProfile, which inflates them);
``--profile-out STEM`` writes its whole profile to STEM.MODE.pstats (``python -m pstats``).

Per row also the policy's choices in the window (drafting lanes' launches run as cycles / decode steps).
``--repeats R`` runs every mode's window R times, the modes interleaved (on, off, on, off, ..): single windows on a
shared 2-core box differ by ~15%, so the summary gives each mode's median host µs per token and lane-round with
their spread, and plain decoding's host µs per token over DFlash's, per repeat (> 1: DFlash's host work per token is
the smaller: where the serving thread is the limit, its throughput ratio at best).
Prints one table (and with ``--repeats``, the summary) and ends with one JSON line; ``--record`` appends a row per
window.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import record  # noqa: E402  (benchmarks/record.py: results.jsonl)
from serve_engine import clients_for, lane_rounds_of, thread_cpu_s  # noqa: E402

from dflash_trt.export.config import DraftConfig, RopeConfig, TargetConfig  # noqa: E402
from dflash_trt.export.draft import DraftModel  # noqa: E402
from dflash_trt.export.exporter import ExportOptions, contract_dims  # noqa: E402
from dflash_trt.export.target import TargetModel  # noqa: E402
from dflash_trt.runtime import device_loop  # noqa: E402
from dflash_trt.runtime.backends.torch_backend import TorchBackend  # noqa: E402
from dflash_trt.runtime.executor import Executor  # noqa: E402
from dflash_trt.runtime.limits import DEFAULT_MAX_CYCLES  # noqa: E402
from dflash_trt.runtime.prefill import PrefillPrograms  # noqa: E402
from dflash_trt.runtime.serving.loop import DEFAULT_STREAM_INTERVAL, ServingLoop  # noqa: E402
from dflash_trt.runtime.serving.metrics import MetricsRecorder  # noqa: E402
from dflash_trt.server.command import freeze_heap  # noqa: E402

VOCAB = 512  # the tiny pair's vocabulary (requests run without stop tokens: each returns --max-new-tokens)
PROMPT_TOKENS = 64


def tiny_pair(sessions: int):
    """A random 2-layer target and 1-layer draft (hidden 64, blocks of 16) and their dims for ``sessions`` owners."""
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16,
                  rms_norm_eps=1e-6, rope=RopeConfig(theta=1e4), attention_bias=False, mlp_bias=False, qk_norm=True)
    torch.manual_seed(0)
    target = TargetModel(TargetConfig(num_layers=2, windows=(0, 0), max_position_embeddings=256, **common), (0, 1)).eval()
    draft = DraftModel(DraftConfig(num_layers=1, windows=(0,), block_size=16, num_target_layers=2, target_layer_ids=(0, 1),
                                   mask_token_id=VOCAB - 1, **common)).eval()
    options = ExportOptions(max_owners=sessions, max_context=256, max_chunk=128, proposals=15, dtype="fp32")
    return target, draft, contract_dims(target, draft, options)


class DeviceClock:
    """The seconds the serving thread spent in the stand-in programs (taken out of its CPU)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def timed(self, run):
        def wrapper(*args, **kwargs):
            started = time.thread_time()
            try:
                return run(*args, **kwargs)
            finally:
                self.seconds += time.thread_time() - started

        return wrapper


class DeviceQueue:
    """The stand-in device's time (``--device-us``): when each launch ends, and a read's wait for it."""

    def __init__(self, cycle_us: float, decode_us: float, owner_us: float) -> None:
        self.cycle, self.decode, self.owner = cycle_us / 1e6, decode_us / 1e6, owner_us / 1e6
        self.end, self.busy, self.ends = 0.0, 0.0, {}

    def queue(self, seconds: float) -> float:
        """Work of ``seconds`` queued now: the time it ends."""
        self.end = max(time.perf_counter(), self.end) + seconds
        self.busy += seconds
        return self.end

    def launched(self, launch) -> None:
        key = launch.key
        self.ends[launch.entry] = self.queue(((self.cycle if key.kind == device_loop.CYCLE else self.decode) + self.owner * key.owners) * key.rounds)

    def wait(self, launch) -> None:
        """Sleep until the launch has ended (the last 0.2 ms in short sleeps: a plain sleep overshoots)."""
        end = self.ends.pop(launch.entry)
        while (left := end - time.perf_counter()) > 0:
            time.sleep(left - 2e-4 if left > 4e-4 else 0)


def with_device(queue: DeviceQueue, clock: DeviceClock):
    """``DeviceLoop.launch`` / ``read`` and ``PrefillPrograms._program`` wrapped to run on ``queue``'s clock (the
    caller puts them back); the CPU a read's wait spends goes to ``clock`` (taken out of the host's)."""
    launch, read, prefill = device_loop.DeviceLoop.launch, device_loop.DeviceLoop.read, PrefillPrograms._program
    wait = clock.timed(queue.wait)

    def timed_launch(self, *args, **kwargs):
        launched = launch(self, *args, **kwargs)
        queue.launched(launched)
        return launched

    def timed_read(self, launched):
        wait(launched)
        return read(self, launched)

    def timed_prefill(self, *args, **kwargs):
        queue.queue(queue.cycle)
        return prefill(self, *args, **kwargs)

    device_loop.DeviceLoop.launch, device_loop.DeviceLoop.read, PrefillPrograms._program = timed_launch, timed_read, timed_prefill


def stand_in_prefill(generator: torch.Generator):
    """``PrefillPrograms._program``'s stand-in: the n prompts' first tokens, chosen at once."""

    def program(self, n: int, T: int, drafting: bool) -> None:
        self.chosen[:n] = torch.randint(1, VOCAB - 1, (n,), generator=generator)

    return program


def stand_in_program(tau: float, generator: torch.Generator):
    """``DeviceLoop._program``'s stand-in: each round's record [n, P+2] written at once (see the module docstring)."""
    keep = 1 - 1 / tau  # Geometric acceptance: P(a >= i) = keep ** i, E[a + 1] ≈ tau while P is long

    def program(self, key) -> None:
        for verdicts in self.records[key.owners][: key.rounds]:
            n, width = verdicts.shape
            verdicts[:, device_loop.PROPOSALS_COLUMN :] = torch.randint(1, VOCAB - 1, (n, width - 2), generator=generator)
            verdicts[:, device_loop.NEXT_COLUMN] = torch.randint(1, VOCAB - 1, (n,), generator=generator)
            if key.kind == device_loop.CYCLE:
                runs = (torch.rand((n, key.proposals), generator=generator) < keep).int().cumprod(dim=1)
                verdicts[:, device_loop.ACCEPTED_COLUMN] = runs.sum(dim=1)
            else:
                verdicts[:, device_loop.ACCEPTED_COLUMN] = 0

    return program


def measure(mode: str, args) -> dict:
    sessions = args.max_sessions or args.clients  # the server's --max-sessions: spare sessions let requests join a running execute
    target, draft, dims = tiny_pair(sessions)
    backend = TorchBackend(target, draft, dims, sessions, device="cpu", kernels="fast")
    clock = DeviceClock()
    real_program, real_prefill = device_loop.DeviceLoop._program, PrefillPrograms._program
    device_loop.DeviceLoop._program = clock.timed(stand_in_program(args.tau, torch.Generator().manual_seed(0)))
    PrefillPrograms._program = clock.timed(stand_in_prefill(torch.Generator().manual_seed(2)))
    real_launch, real_read = device_loop.DeviceLoop.launch, device_loop.DeviceLoop.read
    device = DeviceQueue(*args.device_us) if args.device_us else None
    if device is not None:
        with_device(device, clock)
    prompts = torch.randint(1, VOCAB - 1, (64, PROMPT_TOKENS), generator=torch.Generator().manual_seed(1)).tolist()
    profile = cProfile.Profile() if args.profile or args.profile_out else None
    try:
        # Stats unbounded: a window's execute rows count its lane-rounds. No cycle rows: the server keeps none.
        executor = Executor(backend, max_sessions=sessions, stats_rows=None, speculate=mode == "on", policy=args.policy, launch_rounds=args.launch_rounds,
                            lag=args.lag, cycle_table=False, max_cycles=args.max_cycles)
        serving = ServingLoop(executor, max_running=sessions, stop_ids=(), stream_interval=args.stream_interval_ms / 1000)
        freeze_heap()  # as the serving process does once loaded: without it a full collection stalls every stream ~0.1 s now and then
        try:
            clients_for(serving, prompts, args.clients, args.seconds / 2, args.max_new_tokens)  # warm-up
            executor.clear_stats()
            if profile is not None:
                profile_thread(serving, profile)
            serving.recorder = MetricsRecorder()  # the window's latencies only
            clock.seconds, cpu, started = 0.0, thread_cpu_s(serving.thread), time.perf_counter()
            busy = device.busy if device is not None else 0.0
            tokens, requests = clients_for(serving, prompts, args.clients, args.seconds, args.max_new_tokens)
            wall, cpu = time.perf_counter() - started, thread_cpu_s(serving.thread) - cpu
            busy = device.busy - busy if device is not None else None
            metrics = serving.metrics()
        finally:
            serving.close()
            executor.close()
    finally:
        device_loop.DeviceLoop._program, PrefillPrograms._program = real_program, real_prefill
        device_loop.DeviceLoop.launch, device_loop.DeviceLoop.read = real_launch, real_read
        backend.close()
    executes = executor.execute_stats()
    rows = lane_rounds_of(executes)
    host = cpu - clock.seconds
    row = {
        "mode": mode, "clients": args.clients, "max_sessions": sessions, "tau_asked": args.tau, "launch_rounds": args.launch_rounds, "lag": args.lag, "max_cycles": args.max_cycles,
        "device_us": args.device_us, "device_busy_pct": None if busy is None else round(100 * busy / wall, 1), "requests": requests, "lane_rounds": rows,
        "tokens_per_lane_round": round(tokens / max(rows, 1), 2), "lanes_per_launch": round(rows / max(int(executes["loop_launches"].sum()), 1), 2), "host_us_per_lane_round": round(1e6 * host / max(rows, 1), 2),
        "host_us_per_request": round(1e6 * host / max(requests, 1), 1), "host_us_per_token": round(1e6 * host / max(tokens, 1), 2), "device_stand_in_s": round(clock.seconds, 3),
        "serving_cpu_pct": round(100 * cpu / wall, 1), "tok_s": round(tokens / wall),
        "itl_p50_ms": round(metrics.itl_s.p50 * 1e3, 2), "itl_p99_ms": round(metrics.itl_s.p99 * 1e3, 2),
        "ttft_p50_ms": round(metrics.ttft_s.p50 * 1e3, 3), "e2e_p50_ms": round(metrics.e2e_s.p50 * 1e3, 3),
        "policy_cycles": int(executes["policy_cycles"].sum()), "policy_decodes": int(executes["policy_decodes"].sum()),
    }
    if profile is not None and args.profile_out:
        profile.dump_stats(f"{args.profile_out}.{mode}.pstats")
    if profile is not None and args.profile:
        row["profile"] = top_functions(profile, args.profile)
    return row


def profile_thread(serving: ServingLoop, profile: cProfile.Profile) -> None:
    """Profile the serving loop's thread from its next execute on (``sys.setprofile`` reaches the calling thread only)."""
    step = serving._step  # one execute and its deliveries

    def profiled() -> None:
        profile.enable()
        try:
            step()
        finally:
            profile.disable()

    serving._step = profiled


def top_functions(profile: cProfile.Profile, count: int) -> str:
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(count)
    return out.getvalue()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--max-sessions", type=int, default=0,
                        help="the executor's sessions (default: --clients); more leave requests room to join a running execute, as the server's")
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--modes", nargs="+", choices=("on", "off"), default=["on", "off"])
    parser.add_argument("--tau", type=float, default=2.8, help="the stand-in's mean tokens per cycle (> 1)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--policy", default="adaptive")
    parser.add_argument("--launch-rounds", type=int, default=1, help="the executor's rounds per launch (default 1)")
    parser.add_argument("--lag", type=int, default=1, help="the executor's launches queued per lane beyond the one read (default 1)")
    parser.add_argument("--max-cycles", type=int, default=DEFAULT_MAX_CYCLES, help=f"the executor's rounds per execute (default {DEFAULT_MAX_CYCLES})")
    parser.add_argument("--device-us", type=float, nargs=3, metavar=("CYCLE", "DECODE", "OWNER"),
                        help="a stand-in device queue: µs per cycle and per decode step, plus per padded owner (default: none)")
    parser.add_argument("--stream-interval-ms", type=float, default=DEFAULT_STREAM_INTERVAL * 1000, help="the serving loop's delivery tick")
    parser.add_argument("--profile", type=int, default=0, help="print the serving thread's N largest functions (cProfile)")
    parser.add_argument("--profile-out", help="write the serving thread's profile to PROFILE_OUT.MODE.pstats")
    parser.add_argument("--repeats", type=int, default=1, help="windows per mode, the modes interleaved; the summary gives medians")
    parser.add_argument("--record", action="store_true", help="append the rows to benchmarks/results.jsonl")
    args = parser.parse_args()
    if args.clients < 1 or args.seconds <= 0 or args.tau <= 1 or (args.max_sessions and args.max_sessions < args.clients) or args.repeats < 1:
        parser.error(f"--clients >= 1, --max-sessions 0 or >= --clients, --seconds > 0, --tau > 1 and --repeats >= 1, got {args.clients}, "
                     f"{args.max_sessions}, {args.seconds}, {args.tau}, {args.repeats}")
    torch.set_num_threads(1)
    rows = [{**measure(mode, args), "repeat": repeat} for repeat in range(1, args.repeats + 1) for mode in args.modes]
    print("| mode | repeat | clients | lag | requests | lane-rounds | lanes / launch | tokens / lane-round | host µs / lane-round | host µs / token | host µs / request "
          "| serving CPU % | device busy % | tok/s | ITL p50 / p99 ms | policy cycles / decodes |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['mode']} | {r['repeat']} | {r['clients']} | {r['lag']} | {r['requests']} | {r['lane_rounds']} | {r['lanes_per_launch']} | {r['tokens_per_lane_round']} "
              f"| {r['host_us_per_lane_round']} | {r['host_us_per_token']} | {r['host_us_per_request']} | {r['serving_cpu_pct']} | {r['device_busy_pct']} | {r['tok_s']:,} "
              f"| {r['itl_p50_ms']} / {r['itl_p99_ms']} | {r['policy_cycles']} / {r['policy_decodes']} |")
    for r in rows:
        if "profile" in r:
            print(f"\n{r['mode']} (repeat {r['repeat']}):\n{r.pop('profile')}")
    summary = host_medians(rows)
    if args.repeats > 1:
        print("\n| mode | windows | host µs / token, median (min – max) | host µs / lane-round, median (min – max) | tok/s, median | plain's host µs / token over this mode's, per repeat |")
        print("| --- | --- | --- | --- | --- | --- |")
        for m in summary:
            ratios = " / ".join(f"{x}×" for x in m["plain_over_mode"])  # empty for off
            print(f"| {m['mode']} | {m['windows']} | {m['host_us_per_token']} ({m['host_us_per_token_min']} – {m['host_us_per_token_max']}) "
                  f"| {m['host_us_per_lane_round']} ({m['host_us_per_lane_round_min']} – {m['host_us_per_lane_round_max']}) | {m['tok_s']:,} | {ratios} |")
    meta = {"date": time.strftime("%Y-%m-%d"), "machine": "CPU", "command": " ".join(["python", *sys.argv])}
    if args.record:
        record.append_rows([{"name": "host_cost", **meta, "seconds": args.seconds, "max_new_tokens": args.max_new_tokens, **row} for row in rows])
    return record.finish({"name": "host_cost_summary", **meta, "rows": rows, "medians": summary}, args.record)


def host_medians(rows: list[dict]) -> list[dict]:
    """Per mode (in first-seen order): its windows, the median host µs per token and per lane-round with their
    smallest and largest window, the median tok/s, and for a drafting mode ``plain_over_mode``: per repeat with an
    ``off`` window, off's host µs per token over this mode's (rounded to 3 places; empty for ``off``)."""
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    per_token = {(r["mode"], r["repeat"]): r["host_us_per_token"] for r in rows}
    out = []
    for mode in modes:
        mine = [r for r in rows if r["mode"] == mode]
        token, lane = [r["host_us_per_token"] for r in mine], [r["host_us_per_lane_round"] for r in mine]
        plain = [round(per_token["off", r["repeat"]] / r["host_us_per_token"], 3) for r in mine if mode != "off" and ("off", r["repeat"]) in per_token]
        out.append({"mode": mode, "windows": len(mine), "host_us_per_token": round(statistics.median(token), 2), "host_us_per_token_min": min(token),
                    "host_us_per_token_max": max(token), "host_us_per_lane_round": round(statistics.median(lane), 2),
                    "host_us_per_lane_round_min": min(lane), "host_us_per_lane_round_max": max(lane),
                    "tok_s": round(statistics.median(r["tok_s"] for r in mine)), "plain_over_mode": plain})
    return out


if __name__ == "__main__":
    sys.exit(main())
