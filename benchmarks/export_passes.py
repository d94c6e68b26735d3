"""What the export's graph passes (``export/graph_passes.py``) buy on ONNX Runtime, graph by graph.

Exports the embedded pair three times with the main job's options (``dflash-trt
bench``'s export: fp32, 2 owners, chunk 256): without the passes, with the
norms as a division only, and with live keys too (the default for ONNX
Runtime), then times every graph a cycle or a decode step runs, and a
256-token prefill chunk, on each export. Runs are interleaved (one run of each
export in turn, ``--reps`` times, after one untimed run each) and the median
taken, so a noisy machine shifts all three alike. ``--start`` slots of the
cache are in use per owner (the context a verify attends to). The last line is
one JSON object (``--record``: appended to benchmarks/results.jsonl).

    python benchmarks/export_passes.py [--reps 60] [--start 300] [--record]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from dflash_trt import demo
from dflash_trt.export import contract as c
from dflash_trt.export import graph_passes
from dflash_trt.export.exporter import ExportOptions, export_pair
from dflash_trt.export.pair import DEFAULT_PAIR_DIR
from dflash_trt.runtime.backends.ort_backend import OrtBackend

import record  # benchmarks/record.py: results.jsonl

VARIANTS = ("none", "norms", "norms+live_keys")
PREFILL = 256  # tokens of the prefill chunk timed (the main job's chunk)


def export(out: Path, variant: str) -> Path:
    """The embedded pair exported as the main job exports it, with the passes ``variant`` names."""
    options = ExportOptions(max_owners=demo.DEMO_MAX_OWNERS, max_sessions=demo.DEMO_MAX_SESSIONS, max_chunk=demo.DEMO_MAX_CHUNK,
                            dtype="fp32", live_keys=variant == "norms+live_keys")
    divide = graph_passes.divide_by_root
    if variant == "none":
        graph_passes.divide_by_root = lambda graph: 0
    try:
        export_pair(DEFAULT_PAIR_DIR / "target", DEFAULT_PAIR_DIR / "draft", out, options, force=True)
    finally:
        graph_passes.divide_by_root = divide
    return out


def runs(dims, n: int, start: int) -> dict[str, tuple[str, dict]]:
    """(run graph, feeds) of every graph a cycle or a decode step of ``n`` owners runs (+ a prefill chunk at n = 1)."""
    ints = lambda shape, value: torch.full(shape, value, dtype=torch.int64)
    at = ints((n,), start)
    out = {"decode": (c.graph_name(c.TARGET_DECODE, n), {c.TOKENS: ints((n, 1), 5), c.START: at})}
    taps = torch.randn((n, dims.block_size, dims.tap_width))
    out["draft"] = (c.graph_name(c.DRAFT, n), {c.CTX_TAPS: taps, c.CTX_START: at - 4, c.CTX_COUNT: ints((n,), 4), c.ANCHOR: ints((n,), 5)})
    for k in dims.verify_proposals:
        out[f"verify_{k}"] = (c.verify_graph(dims, c.TARGET_VERIFY, n, k), {c.TOKENS: ints((n, k + 1), 5), c.START: at})
    if n == 1:
        out[f"prefill_{PREFILL}"] = (c.TARGET_PREFILL, {c.TOKENS: ints((1, PREFILL), 5), c.START: ints((1,), max(0, start - PREFILL))})
    return out


def interleaved(backends: list, graph: str, feeds: dict, reps: int) -> list[float]:
    """Median ms per backend of ``reps`` rounds, each running ``graph`` once on every backend in turn."""
    times: list[list[float]] = [[] for _ in backends]
    for backend in backends:
        backend.run(graph, feeds, 0)
    for _ in range(reps):
        for i, backend in enumerate(backends):
            started = time.perf_counter()
            backend.run(graph, feeds, 0)
            times[i].append((time.perf_counter() - started) * 1000.0)
    return [statistics.median(t) for t in times]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=60)
    parser.add_argument("--start", type=int, default=300, help="cache slots in use per owner (default 300)")
    parser.add_argument("--record", action="store_true", help="append the JSON line to benchmarks/results.jsonl")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as work:
        dirs = [export(Path(work) / variant, variant) for variant in VARIANTS]
        backends = [OrtBackend.from_export(d) for d in dirs]
        try:
            dims = backends[0].dims
            for n in range(1, dims.max_owners + 1):
                for name, (graph, feeds) in runs(dims, n, args.start).items():
                    rows.append({"owners": n, "graph": name, **dict(zip(VARIANTS, interleaved(backends, graph, feeds, args.reps)))})
        finally:
            for backend in backends:
                backend.close()
    print("| owners | graph | " + " | ".join(f"{v} ms" for v in VARIANTS) + " | norms+live_keys / none |\n|" + " --- |" * (len(VARIANTS) + 3))
    for row in rows:
        print(f"| {row['owners']} | {row['graph']} | " + " | ".join(f"{row[v]:.3f}" for v in VARIANTS) + f" | {row[VARIANTS[-1]] / row['none']:.3f} |")
    summary = {"name": "export_passes", "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()} {os.cpu_count()} CPUs",
               "command": " ".join(["python", "benchmarks/export_passes.py", *sys.argv[1:]]), "reps": args.reps, "start": args.start,
               "ms": [{k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()} for row in rows]}
    return record.finish(summary, args.record)


if __name__ == "__main__":
    sys.exit(main())
