"""Where the device's time goes in gpu_e2e's workload: its kernels under torch.profiler, busy and idle.

    python benchmarks/device_timeline.py                 # the default pair, bf16, 16 sessions, both modes
    python benchmarks/device_timeline.py --sessions 1 4 16 --record
    python benchmarks/device_timeline.py --loop-glue torch     # the device loop's torch glue (``Executor(loop_glue=)``)

Runs ``gpu_e2e.py``'s default-pair workload (its prompts, 128 new tokens, three prompts per session,
greedy, exact kernels, the adaptive policy) on the torch backend, one mode at a time (plain decoding,
then DFlash): two untimed passes (every program captured, the policy trained), then one pass under
torch.profiler (CUDA activity). From the trace: the pass's wall time, the kernels' busy time (the union of
their intervals), by what launched them (a CUDA-graph replay, an eager launch, a copy), and the device's
idle gaps (every gap between kernels, those over 20 µs and over 100 µs apart: inside a CUDA graph the
gaps are sub-microsecond, so the long ones are where the device waited for the host), and the kernels by
name (count, total and mean µs: at the default pair's size a program's time follows its launch count).
gpu_e2e's own ``device_ms_per_launch`` times only the loop's launches (events around each): this is the
whole pass, prefills and the gaps between executes included. Prints a table and ends with one JSON
line; ``--record`` appends the rows to benchmarks/results.jsonl. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_e2e  # noqa: E402  (the pair, its prompts and dims)
import record  # noqa: E402  (benchmarks/record.py: results.jsonl)

LONG_GAPS_US = (20.0, 100.0)


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (µs).

    >>> union_us([(0, 10), (5, 15), (20, 25)])
    20.0
    """
    total, end = 0.0, float("-inf")
    for start, finish in sorted(intervals):
        if finish > end:
            total += finish - max(start, end)
            end = finish
    return float(total)


def gaps_us(intervals: list[tuple[float, float]]) -> list[float]:
    """The idle gaps between the intervals' union's pieces (µs), in time order.

    >>> gaps_us([(0, 10), (5, 15), (20, 25), (26, 30)])
    [5.0, 1.0]
    """
    gaps, end = [], None
    for start, finish in sorted(intervals):
        if end is not None and start > end:
            gaps.append(float(start - end))
        end = finish if end is None else max(end, finish)
    return gaps


def by_name(events: list[dict], most: int = 25) -> list[dict]:
    """Device activities grouped by name (Triton kernels by function, others cut at their first '<' or '('):
    count, total and mean µs, the ``most`` largest totals first.

    >>> by_name([{"name": "_linear_kernel", "dur": 3.0}, {"name": "_linear_kernel", "dur": 5.0}, {"name": "void at::f<int>(x)", "dur": 1.0}])
    [{'name': '_linear_kernel', 'count': 2, 'total_us': 8.0, 'mean_us': 4.0}, {'name': 'void at::f', 'count': 1, 'total_us': 1.0, 'mean_us': 1.0}]
    """
    groups: dict[str, list[float]] = collections.defaultdict(list)
    for e in events:
        name = e["name"]
        for cut in ("<", "("):
            name = name.split(cut)[0]
        groups[name.strip()].append(float(e["dur"]))
    rows = [{"name": n, "count": len(d), "total_us": round(sum(d), 1), "mean_us": round(sum(d) / len(d), 2)} for n, d in groups.items()]
    return sorted(rows, key=lambda r: -r["total_us"])[:most]


def trace_figures(events: list[dict]) -> dict:
    """A chrome trace's device activities -> busy, by launcher, and idle gaps (µs)."""
    launcher = {e["args"].get("correlation"): e["name"] for e in events if e.get("cat") == "cuda_runtime"}
    device = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in device]
    by = collections.defaultdict(list)
    for e, span in zip(device, spans):
        by[launcher.get(e["args"].get("correlation"), "other")].append(span)
    gaps = gaps_us(spans)
    figures = {
        "activities": len(device),
        "window_ms": round((max(f for _, f in spans) - min(s for s, _ in spans)) / 1e3, 3),
        "busy_ms": round(union_us(spans) / 1e3, 3),
        "by_launcher_ms": {name: round(union_us(s) / 1e3, 3) for name, s in sorted(by.items(), key=lambda kv: -len(kv[1]))},
        "gaps_ms": round(sum(gaps) / 1e3, 3),
        "by_kernel": by_name(device),
    }
    for least in LONG_GAPS_US:
        long = [g for g in gaps if g > least]
        figures[f"gaps_over_{least:g}us"] = len(long)
        figures[f"gaps_over_{least:g}us_ms"] = round(sum(long) / 1e3, 3)
    return figures


def profile_mode(backend, requests, sessions: int, speculate: bool, policy: str, loop_glue: str = "auto") -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from dflash_trt.runtime.executor import DEFAULT_MAX_CYCLES, Executor

    with Executor(backend, max_sessions=sessions, speculate=speculate, max_cycles=DEFAULT_MAX_CYCLES,
                  policy=policy if speculate else "always", loop_glue=loop_glue) as executor:
        for _ in range(2):  # captures, compiles, trains the policy
            gpu_e2e.serve(executor, requests, sessions)
        executor.clear_stats()
        executor.loop.timeline.reset()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            tokens, seconds = gpu_e2e.serve(executor, requests, sessions)
        torch.cuda.synchronize()
        timeline = executor.loop.timeline
        loop = {"loop_launches": timeline.launches, "loop_busy_ms": round(timeline.busy_ms, 3), "loop_idle_ms": round(timeline.idle_ms, 3),
                "executes": len(executor.log.executes.columns["wall_ms"])}
    with tempfile.TemporaryDirectory() as work:
        path = Path(work) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    wall_ms = seconds * 1e3
    figures = trace_figures(events)
    return {"mode": "dflash" if speculate else "plain", "sessions": sessions, "tokens": sum(len(t) for t in tokens),
            "wall_ms": round(wall_ms, 3), **figures, "busy_fraction": round(figures["busy_ms"] / wall_ms, 4), **loop}


def table(rows: list[dict]) -> str:
    keys = ("mode", "sessions", "wall_ms", "busy_ms", "busy_fraction", "gaps_over_100us", "gaps_over_100us_ms", "loop_busy_ms",
            "loop_launches", "executes")
    lines = ["| " + " | ".join(keys) + " |", "|" + " --- |" * len(keys)]
    return "\n".join(lines + ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, nargs="+", default=[16])
    parser.add_argument("--policy", default="adaptive", help="the DFlash mode's policy (default adaptive, as dflash-trt serve)")
    parser.add_argument("--loop-glue", choices=gpu_e2e.GLUES, default="auto", help="Executor(loop_glue=) (default auto)")
    parser.add_argument("--record", action="store_true", help="append the rows to benchmarks/results.jsonl")
    args = parser.parse_args()
    import torch

    from dflash_trt.export.sampling import Sampling
    from dflash_trt.runtime.backends.torch_backend import TorchBackend
    from dflash_trt.runtime.serving.batcher import Request

    if not torch.cuda.is_available():
        raise SystemExit("device_timeline needs a CUDA GPU")
    target, draft, prompts, stop = gpu_e2e.default_pair(torch.bfloat16)
    rows = []
    for sessions in args.sessions:
        count = sessions * gpu_e2e.PROMPTS_PER_SESSION.get(sessions, 2)
        requests = [Request(p, gpu_e2e.NEW_TOKENS, stop, Sampling(0.0, 0, 1.0, i)) for i, p in enumerate(prompts[:count])]
        dims = gpu_e2e.dims_of(target, draft, sessions, torch.bfloat16)
        backend = TorchBackend(target, draft, dims, sessions, device="cuda", kernels="exact")
        try:
            for speculate in (False, True):
                rows.append({"name": "device_timeline", "machine": gpu_e2e.machine(), "command": "python benchmarks/device_timeline.py "
                             + " ".join(sys.argv[1:]), "policy": args.policy if speculate else None,
                             "loop_glue": args.loop_glue, **profile_mode(backend, requests, sessions, speculate, args.policy, args.loop_glue)})
                print(json.dumps(rows[-1]), flush=True)
        finally:
            backend.close()
    print(table(rows))
    for r in rows:  # where each mode's device time goes, by kernel (the whole profiled pass, prefills included)
        print(f"\n{r['mode']}, {r['sessions']} sessions: {r['activities']} activities over {r['loop_launches']} loop launches")
        print("| kernel | count | total µs | mean µs |\n| --- | --- | --- | --- |")
        print("\n".join(f"| {k['name'][:60]} | {k['count']} | {k['total_us']} | {k['mean_us']} |" for k in r["by_kernel"]))
    if args.record:
        record.append_rows(rows)
    print(json.dumps({"name": "device_timeline_summary", "rows": [{k: r[k] for k in ("mode", "sessions", "wall_ms", "busy_ms")} for r in rows]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
