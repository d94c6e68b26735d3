"""ONNX Runtime's intra-op threads idle between nodes: sleeping (woken per node) or spinning while a run lasts.

Opens the main job's export (``dflash-trt bench``'s cached export of the embedded
pair, made if absent) twice, once per setting, and times what a plain decode
step and a 7-proposal cycle run at ``--owners`` owners, the cycle with the
torch glue between its graphs (the candidates, the context rows, as the device
loop does): ``asleep`` (threads block between nodes: ``allow_spinning=0``) and
``in-run`` (threads spin while a run lasts and stop when it returns:
``allow_spinning=1``, ``force_spinning_stop=1``, the backend's default).
Settings are interleaved (one decode step or cycle on each in turn, ``--reps``
times, after one untimed round) and medians taken. Spinning between runs too
(ONNX Runtime's default) is not among them: idle spinners of one backend would
slow the other's runs (and, in a cycle, each graph's session slows the next).
The last line is one JSON object (``--record``: appended to benchmarks/results.jsonl).

    python benchmarks/ort_spinning.py [--reps 100] [--owners 2] [--start 300] [--record]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from dflash_trt import demo
from dflash_trt.export import contract as c
from dflash_trt.export.pair import DEFAULT_PAIR_DIR
from dflash_trt.runtime import command
from dflash_trt.runtime.backends.ort_backend import OrtBackend

import record  # benchmarks/record.py: results.jsonl

SETTINGS = {"asleep": {"session.intra_op.allow_spinning": "0"}, "in-run": {"session.intra_op.allow_spinning": "1", "session.force_spinning_stop": "1"}}
PROPOSALS = 7


def open_with(export: Path, entries: dict[str, str]) -> OrtBackend:
    """The export on the CPU provider with ``entries`` as its sessions' config (over the backend's own)."""
    import onnxruntime

    onnxruntime.set_default_logger_severity(3)  # overwriting a config entry is logged as a warning
    backend = OrtBackend.from_export(export, lazy=True)
    for key, value in entries.items():
        backend.options.add_session_config_entry(key, value)
    return backend


def steps(backend: OrtBackend, n: int, start: int) -> dict:
    """A decode step and a cycle of ``PROPOSALS`` at ``n`` owners, as callables."""
    ints = lambda shape, value: torch.full(shape, value, dtype=torch.int64)
    at, taps = ints((n,), start), torch.randn(n, backend.dims.block_size, backend.dims.tap_width)

    def decode():
        out = backend.run(c.graph_name(c.TARGET_DECODE, n), {c.TOKENS: ints((n, 1), 5), c.START: at}, 0)
        return out[c.LOGITS].argmax(dim=-1)

    def cycle():
        draft = {c.CTX_TAPS: taps, c.CTX_START: at - 4, c.CTX_COUNT: ints((n,), 4), c.ANCHOR: ints((n,), 5)}
        proposals = backend.run(c.graph_name(c.DRAFT, n), draft, 0)[c.PROPOSALS]
        candidates = torch.cat([ints((n, 1), 5), proposals[:, :PROPOSALS]], dim=1)
        verify = backend.run(c.verify_graph(backend.dims, c.TARGET_VERIFY, n, PROPOSALS), {c.TOKENS: candidates, c.START: at}, 0)
        taps[:, : PROPOSALS + 1].copy_(verify[c.TAPS])
        return backend.run(c.verify_graph(backend.dims, c.VERIFY_ARGMAX, n, PROPOSALS), {c.LOGITS: verify[c.LOGITS], c.CANDIDATES: candidates}, 0)

    return {"decode": decode, f"cycle_{PROPOSALS}": cycle}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=100)
    parser.add_argument("--owners", type=int, default=2)
    parser.add_argument("--start", type=int, default=300, help="cache slots in use per owner (default 300)")
    parser.add_argument("--record", action="store_true", help="append the JSON line to benchmarks/results.jsonl")
    args = parser.parse_args()
    flags = argparse.Namespace(target=DEFAULT_PAIR_DIR / "target", draft=DEFAULT_PAIR_DIR / "draft", cache=command.default_cache_dir(), artifacts=None)
    export = demo.export_dir(flags)
    backends = {name: open_with(export, entries) for name, entries in SETTINGS.items()}
    try:
        work = {name: steps(backend, args.owners, args.start) for name, backend in backends.items()}
        ms: dict[str, dict[str, float]] = {}
        for step in work["asleep"]:
            times: dict[str, list[float]] = {name: [] for name in work}
            for name in work:
                work[name][step]()
            for _ in range(args.reps):
                for name in work:
                    started = time.perf_counter()
                    work[name][step]()
                    times[name].append((time.perf_counter() - started) * 1000.0)
            ms[step] = {name: statistics.median(t) for name, t in times.items()}
    finally:
        for backend in backends.values():
            backend.close()
    cycle = f"cycle_{PROPOSALS}"
    print(f"| setting | decode ms | {cycle} ms | cycle in decode steps |\n| --- | --- | --- | --- |")
    for name in SETTINGS:
        print(f"| {name} | {ms['decode'][name]:.3f} | {ms[cycle][name]:.3f} | {ms[cycle][name] / ms['decode'][name]:.2f} |")
    summary = {"name": "ort_spinning", "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()} {os.cpu_count()} CPUs",
               "command": " ".join(["python", "benchmarks/ort_spinning.py", *sys.argv[1:]]), "owners": args.owners, "start": args.start,
               "reps": args.reps, "ms": {step: {k: round(v, 3) for k, v in row.items()} for step, row in ms.items()}}
    return record.finish(summary, args.record)


if __name__ == "__main__":
    sys.exit(main())
