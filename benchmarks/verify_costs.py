"""What a cycle of each verify length costs against a plain decode step, graph by graph, on one backend.

A cycle runs ``draft_n`` (the same whatever the verify length), ``target_verify_n`` of
k + 1 rows per owner and a verdict over them; a plain decode step runs
``target_decode_n``. This times each run graph alone (``--reps`` runs after one
untimed run, the mean in ms) for every owner count and verify length of an
export (``Dims.verify_proposals``), so the cost side of the policy's choice
(``runtime/policy.py``: E_k · C_decode / C_cycle(k)) can be read per graph:
the last columns are a k-cycle's graphs in decode steps. The embedded pair on
ONNX Runtime by default (the ``run`` flags); the last line is one JSON object.

    python benchmarks/verify_costs.py [--artifacts DIR] [--reps 30] [--record]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import torch

from dflash_trt.export import contract as c
from dflash_trt.runtime import command

import record  # benchmarks/record.py: results.jsonl

ROOT = Path(__file__).resolve().parent.parent
START = 300  # cache slots already filled per owner (attention over a realistic prefix)


def mean_ms(backend, graph: str, feeds: dict, reps: int) -> float:
    """Mean wall ms of ``reps`` runs of ``graph`` at row 0, after one untimed run."""
    backend.run(graph, feeds, 0)
    backend.synchronize()
    started = time.perf_counter()
    for _ in range(reps):
        backend.run(graph, feeds, 0)
    backend.synchronize()
    return (time.perf_counter() - started) / reps * 1000.0


def costs(backend, n: int, reps: int) -> dict[str, float]:
    """ms per run of every graph a cycle or a decode step of ``n`` owners runs."""
    dims, device = backend.dims, backend.device
    ints = lambda shape, value: torch.full(shape, value, dtype=torch.int64, device=device)
    start = ints((n,), START)
    row = {"decode": mean_ms(backend, c.graph_name(c.TARGET_DECODE, n), {c.TOKENS: ints((n, 1), 5), c.START: start}, reps)}
    taps = torch.randn((n, dims.block_size, dims.tap_width), device=device).to(getattr(torch, dims.dtype))
    draft = {c.CTX_TAPS: taps, c.CTX_START: start - 4, c.CTX_COUNT: ints((n,), 4), c.ANCHOR: ints((n,), 5)}
    row["draft"] = mean_ms(backend, c.graph_name(c.DRAFT, n), draft, reps)
    for k in dims.verify_proposals:
        tokens = ints((n, k + 1), 5)
        row[f"verify_{k}"] = mean_ms(backend, c.verify_graph(dims, c.TARGET_VERIFY, n, k), {c.TOKENS: tokens, c.START: start}, reps)
        logits = torch.randn((n, k + 1, dims.vocab_size), device=device)
        row[f"verdict_{k}"] = mean_ms(backend, c.verify_graph(dims, c.VERIFY_ARGMAX, n, k), {c.LOGITS: logits, c.CANDIDATES: tokens}, reps)
        row[f"cycle_{k}_in_decode_steps"] = (row["draft"] + row[f"verify_{k}"] + row[f"verdict_{k}"]) / row["decode"]
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    command.add_arguments(parser, out_required=False)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--record", action="store_true", help="append the JSON line to benchmarks/results.jsonl")
    args = parser.parse_args()
    command.check_flags(args)
    command.prepare_artifacts(args)
    with command.open_backend(args) as backend:
        lengths = backend.dims.verify_proposals
        rows = {n: costs(backend, n, args.reps) for n in range(1, backend.dims.max_owners + 1)}
    columns = list(rows[1])
    print("| owners | " + " | ".join(columns) + " |\n|" + " --- |" * (len(columns) + 1))
    for n, row in rows.items():
        print(f"| {n} | " + " | ".join(f"{row[name]:.2f}" for name in columns) + " |")
    summary = {"name": "verify_costs", "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()} {os.cpu_count()} CPUs",
               "command": " ".join(["python", "benchmarks/verify_costs.py", *sys.argv[1:]]), "backend": args.backend,
               "verify_proposals": list(lengths), "reps": args.reps, "ms": {n: {k: round(v, 3) for k, v in row.items()} for n, row in rows.items()}}
    return record.finish(summary, args.record)


if __name__ == "__main__":
    sys.exit(main())
