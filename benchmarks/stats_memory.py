"""Process memory over many execute() calls: flat when stats are drained, bounded when not.

Serves ``--sessions`` sessions through one executor over ONNX Runtime (CPU) on a
tiny random pair (the tests' shapes, exported once into a temporary folder, or
``--export DIR``): every call decodes every session's pending token (the
serving loop's common call, one draft/verify cycle per session); a session
whose context is full is closed and a new one opens with a prompt, so opens,
closes and prefills run throughout. Stats are drained to Parquet every
``--drain-every`` calls (``Executor.drain_stats``), as a service would.

RSS (``/proc/self/statm``) is sampled every ``--sample-every`` calls; the
first sample comes after ``--warmup`` calls (default: after the first drain,
whose Parquet writer and thread pool are a one-time ~18 MB; allocators and
ONNX Runtime's arenas settle by then too). Modes:

- ``drained``: stats drained (the goal: RSS flat within 5 MB);
- ``kept``: nothing drained and no bound (``stats_rows=None``), to show what
  a log that only grows costs per call.

Prints a table per mode and ends with one JSON line; appends it to
``benchmarks/results.jsonl`` with ``--record``.

    python benchmarks/stats_memory.py [--calls 100000] [--modes drained kept] [--kept-calls 20000] [--record]
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45]


def rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 2**20


def export_tiny(out: Path) -> Path:
    """The tests' tiny Qwen3 target + block-8 draft, exported fp32 (max_owners 4, max_context 64)."""
    sys.path.insert(0, str(ROOT / "tests"))
    import tiny_models

    from dflash_trt.export.exporter import ExportOptions, export_pair

    target = tiny_models.write_target(out / "target")
    draft = tiny_models.write_draft(out / "draft", target)
    export_pair(target, draft, out / "graphs", ExportOptions(max_owners=4, max_context=64, dtype="fp32", shared_weights=True))
    return out / "graphs"


def serve(export_dir: Path, calls: int, sessions: int, drain_every: int | None, sample_every: int, warmup: int, parts: Path) -> dict:
    from dflash_trt.runtime.backends.ort_backend import OrtBackend
    from dflash_trt.runtime.executor import Executor, Input

    samples: list[tuple[int, float]] = []
    started = time.perf_counter()
    with OrtBackend.from_export(export_dir, max_sessions=sessions, threads=1) as backend:
        executor = Executor(backend, max_sessions=sessions, stats_rows=None if drain_every is None else 1 << 19)
        block, limit = executor.dims.block_size, executor.dims.max_context
        pending = {executor.open_session(): None for _ in range(sessions)}
        drained_rows = 0
        for call in range(1, calls + 1):
            batch = []
            for s, token in list(pending.items()):
                if token is not None and executor.session(s).frontier + 1 + block > limit:
                    executor.close_session(s)
                    del pending[s]
                    s, token = executor.open_session(), None
                    pending[s] = None
                batch.append(Input(s, PROMPT if token is None else [token]))
            for item, out in zip(batch, executor.execute(batch)):
                pending[item.session] = out[-1]
            if drain_every and call % drain_every == 0:
                cycles, _ = executor.drain_stats(parts / f"stats-{call:08d}")
                drained_rows += cycles.height
            if call >= warmup and (call - warmup) % sample_every == 0:
                gc.collect()
                samples.append((call, rss_mib()))
        rows = drained_rows + executor.cycle_stats().height
        executor.close()
    seconds = time.perf_counter() - started
    rss = [r for _, r in samples]
    span = samples[-1][0] - samples[0][0] if len(samples) > 1 else 0
    return {
        "calls": calls,
        "cycle_rows": rows,
        "seconds": round(seconds, 1),
        "calls_per_s": round(calls / seconds, 1),
        "rss_first_mib": round(rss[0], 2),
        "rss_last_mib": round(rss[-1], 2),
        "rss_growth_mib": round(rss[-1] - rss[0], 2),
        "rss_range_mib": round(max(rss) - min(rss), 2),
        "bytes_per_call": round((rss[-1] - rss[0]) * 2**20 / span, 1) if span else None,
        "samples": [[c, round(r, 2)] for c, r in samples],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=100_000, help="execute() calls of the drained mode")
    parser.add_argument("--kept-calls", type=int, default=20_000, help="execute() calls of the kept mode")
    parser.add_argument("--modes", nargs="+", choices=("drained", "kept"), default=["drained", "kept"])
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--drain-every", type=int, default=10_000)
    parser.add_argument("--sample-every", type=int, default=5_000)
    parser.add_argument("--warmup", type=int, default=None, help="calls before the first sample (default: --drain-every, so the first drain is behind it)")
    parser.add_argument("--export", type=Path, help="an existing export directory (default: export the tiny pair)")
    parser.add_argument("--record", action="store_true", help="append the JSON line to benchmarks/results.jsonl")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        export_dir = args.export or export_tiny(Path(tmp))
        for mode in args.modes:
            calls = args.calls if mode == "drained" else args.kept_calls
            drain = args.drain_every if mode == "drained" else None
            parts = Path(tmp) / f"parts-{mode}"
            warmup = args.warmup if args.warmup is not None else args.drain_every
            results[mode] = serve(export_dir, calls, args.sessions, drain, args.sample_every, min(warmup, calls // 2), parts)
            r = results[mode]
            print(f"\n{mode}: {calls} calls, {r['cycle_rows']} cycle rows, {r['seconds']} s ({r['calls_per_s']} calls/s)")
            print("| calls | RSS MiB |\n| ---: | ---: |")
            for call, rss in r["samples"]:
                print(f"| {call} | {rss:.2f} |")
            print(f"growth {r['rss_growth_mib']:+.2f} MiB, range {r['rss_range_mib']:.2f} MiB, {r['bytes_per_call']} bytes/call")
    line = {
        "name": "stats_memory",
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()} CPU, {platform.python_version()}, ONNX Runtime CPU, 1 thread",
        "command": "python benchmarks/stats_memory.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "goal_rss_flat_mib": 5,
        "met": abs(results["drained"]["rss_growth_mib"]) <= 5 and results["drained"]["rss_range_mib"] <= 5 if "drained" in results else None,
        **{f"{mode}_{key}": value for mode, r in results.items() for key, value in r.items() if key != "samples"},
    }
    if args.record:
        with open(ROOT / "benchmarks" / "results.jsonl", "a") as handle:
            handle.write(json.dumps(line) + "\n")
    print(json.dumps(line))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
