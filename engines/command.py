"""``dflash-trt build``: exported ONNX graphs -> a checked TensorRT engine set.

    dflash-trt build --onnx DIR --out DIR [--backend tensorrt|tensorrt_rtx]
                     [--workspace-mb N] [--target SM89 ...] [--only NAME ...]
                     [--version-compatible] [--verbose]

Prints one line per graph with its build time; on failure, one error listing
every failing graph and node (exit status 1 through the top-level CLI). An
fp32 export (ONNX Runtime's configuration) is refused first, in one line
(exit status 2).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from dflash_trt.engines.build import BuildOptions, build_engine_set, refuse_unbuildable
from dflash_trt.engines.flavour import BUILDERS, load_flavour
from dflash_trt.engines.sources import export_sources
from dflash_trt.errors import EngineError

AUTO = "auto"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--onnx", type=Path, required=True, help="export directory (graphs + manifest.json)")
    parser.add_argument("--out", type=Path, required=True, help="engine-set directory to write (plans + engines.json)")
    parser.add_argument(
        "--backend",
        choices=[AUTO, *BUILDERS],
        default=AUTO,
        help="TensorRT flavour; auto: tensorrt if importable, else tensorrt_rtx",
    )
    parser.add_argument("--workspace-mb", type=int, default=None, help="builder workspace limit in MiB")
    parser.add_argument(
        "--target",
        action="append",
        default=[],
        help="compute capability to build for, repeatable (tensorrt_rtx: SM80, sm_89, ...; tensorrt: ampere_plus)",
    )
    parser.add_argument("--only", action="append", default=[], help="build only this graph, repeatable")
    parser.add_argument("--version-compatible", action="store_true", help="tensorrt only: version-compatible plans")
    parser.add_argument("--verbose", action="store_true", help="also print TensorRT's warnings")


def pick_flavour(name: str):
    """``auto`` prefers full TensorRT (runs on every GPU it supports) over TensorRT-RTX."""
    if name != AUTO:
        return load_flavour(name)
    try:
        return load_flavour("tensorrt")
    except EngineError:
        return load_flavour("tensorrt_rtx")


def run(args: argparse.Namespace) -> int:
    sources, manifest = export_sources(args.onnx)
    refuse_unbuildable(sources)  # before TensorRT is even looked for: the export itself cannot be built
    flavour = pick_flavour(args.backend)
    if args.only:
        unknown = sorted(set(args.only) - {s.name for s in sources})
        if unknown:
            msg = f"--only names graphs not in {args.onnx}: {unknown}; graphs are {[s.name for s in sources]}"
            raise EngineError(msg)
        sources = [s for s in sources if s.name in args.only]
    options = BuildOptions(
        workspace_mb=args.workspace_mb,
        targets=tuple(args.target),
        version_compatible=args.version_compatible,
    )
    print(f"building {len(sources)} graphs from {args.onnx} with {flavour.name} {flavour.version} -> {args.out}")
    start = time.perf_counter()
    echo = (lambda line: print(line, file=sys.stderr)) if args.verbose else None
    record = build_engine_set(sources, args.out, flavour, options, progress=_print_flush, source_manifest=manifest, echo=echo)
    for graph, why in record.skipped.items():
        print(f"warning: {graph} not built (sampled sessions will be refused; greedy ones run): {why}", file=sys.stderr)
    print(f"engine set written: {args.out} ({len(record.engines)} plans, targets {list(record.targets)}, {time.perf_counter() - start:.1f} s)")
    return 0


def _print_flush(line: str) -> None:
    print(line, flush=True)
