"""``dflash-trt report STATS.parquet [--baseline AR.parquet] [--compare B.parquet ...] [--out DIR]``.

STATS is a cycles table written by the runtime; the executes table is read
from beside it when present (``X.parquet`` → ``X.executes.parquet``, see
``runtime.stats.stats_paths``). Prints the Markdown report, the files
written, and as its LAST line one JSON object of headline figures
(``report.headline``), for scripts: ``dflash-trt report s.parquet | tail -1``.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from dflash_trt.analysis.load import Run, scan_run
from dflash_trt.cli import positive_int
from dflash_trt.analysis.report import headline, markdown, summarize, write_report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("stats", type=Path, help="cycles table (X.parquet; X.executes.parquet is read if present)")
    parser.add_argument("--baseline", type=Path, help="autoregressive run's cycles table: adds speedup")
    parser.add_argument(
        "--compare", type=Path, nargs="+", action="extend", default=[], metavar="STATS", help="other runs to show side by side"
    )
    parser.add_argument("--out", type=Path, help="output folder (default: X.report/ beside STATS)")
    parser.add_argument("--window", type=positive_int, default=64, help="calls per rolling-τ window (default 64)")


def distinct_names(baseline: Run | None, main_run: Run, others: list[Run]) -> tuple[Run | None, Run, list[Run]]:
    """Runs are named by mode (``dflash``, ``plain``); a repeated name gets its position (``dflash 2``)."""
    runs = [r for r in (baseline, main_run, *others) if r is not None]
    seen: dict[str, int] = {}
    named = []
    for r in runs:
        seen[r.name] = seen.get(r.name, 0) + 1
        named.append(r if seen[r.name] == 1 else replace(r, name=f"{r.name} {seen[r.name]}"))
    if baseline is None:
        return None, named[0], named[1:]
    return named[0], named[1], named[2:]


def run(args: argparse.Namespace) -> int:
    main_run = scan_run(args.stats)
    baseline = None if args.baseline is None else scan_run(args.baseline)
    others = [scan_run(path) for path in args.compare]
    baseline, main_run, others = distinct_names(baseline, main_run, others)
    summary = summarize(main_run, baseline, others, window=args.window)
    out_dir = args.out or args.stats.with_name(args.stats.stem + ".report")
    files = write_report(summary, out_dir)
    print(markdown(summary, files))
    print(f"wrote {len(files)} files to {out_dir}")
    print(json.dumps(headline(summary)))
    return 0
