"""What loading an engine set costs the CPU: every byte read once and hashed, the shared weights parsed.

``TensorRTBackend`` loads a set in two stages (``engines.load``): the file
checks of engines.json (sizes, records; no hashing), then per plan one
streamed read that TensorRT deserializes while ``plan_reader.PlanReader``
hashes it, and the shared weights' file read once, hashed and parsed
(``engines.shared_weights.read_shared_weights``). This measures the CPU part
of that — the checks, the PlanReader's reads and digest (the same code, over
a stand-in for TensorRT's stream-reader base class), the shared file's read,
hash and parse — with each file's pages dropped from the page cache first
(``posix_fadvise DONTNEED``: a cold read, as at a service's start), and
without TensorRT's own deserialization (that needs a GPU TensorRT runs on).

    python benchmarks/load_cost.py --set DIR              # a built engine set
    python benchmarks/load_cost.py --like-8b --work DIR   # files of the Qwen3-8B set's sizes (random bytes)

``--like-8b`` writes files of the sizes the Qwen3-8B-shape set measured
(benchmarks/RESULTS.md engine_size, commit e6b3a64): the two model plans and
a real shared-weights file of the 8B shapes (random bf16 values); no
engines.json, so the stage-1 checks are not part of that figure.

Prints a table and ends with one JSON line; ``--record`` appends it to
benchmarks/results.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

import record  # benchmarks/record.py: results.jsonl

# The Qwen3-8B-shape set's files (engine_size at e6b3a64): plan bytes, and the shared weights' shapes.
PLANS_8B = {"target_model.plan": 14_219_636_740, "draft_model.plan": 2_123_483_396}
VOCAB_8B, HIDDEN_8B = 151_936, 4_096


class _StreamReaderBase:
    """Stands in for TensorRT's ``IStreamReaderV2`` (whose constructor needs a CUDA driver)."""

    def __init__(self) -> None:
        pass


def drop_cache(path: Path) -> None:
    """Evict the file's pages, so the next read comes from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def stream_plan(path: Path) -> tuple[float, int]:
    """Seconds to stream one plan through the loader's PlanReader (read in its chunks, hashed once)."""
    from dflash_trt.engines.plan_reader import CHUNK_BYTES, plan_reader_class

    reader = plan_reader_class(SimpleNamespace(IStreamReaderV2=_StreamReaderBase))(path)
    started = time.perf_counter()
    try:
        while reader.read(CHUNK_BYTES):
            pass
        reader.sha256()
    finally:
        reader.close()
    return time.perf_counter() - started, reader.bytes_read


def write_like_8b(work: Path) -> tuple[list[Path], object]:
    """Random files of the 8B set's plan sizes and a real shared-weights file of its shapes."""
    from dflash_trt.engines.shared_weights import Lifted, write_shared_weights
    from dflash_trt.export.contract import shared_weight_specs

    work.mkdir(parents=True, exist_ok=True)
    block = os.urandom(64 << 20)
    plans = []
    for name, size in PLANS_8B.items():
        path = work / name
        if not path.is_file() or path.stat().st_size != size:
            with open(path, "wb") as handle:
                for offset in range(0, size, len(block)):
                    handle.write(block[: min(len(block), size - offset)])
        plans.append(path)
    generator = torch.Generator().manual_seed(0)
    tensors = {s.name: torch.randn(s.shape, generator=generator, dtype=torch.float32).to(torch.bfloat16) for s in shared_weight_specs(VOCAB_8B, HIDDEN_8B, "bfloat16")}
    return plans, write_shared_weights(work, Lifted({}, tensors))


def of_set(directory: Path) -> tuple[list[Path], object, float]:
    """A built set's plans and shared-weights record, and the seconds of its stage-1 checks."""
    from dflash_trt.engines.load import check_engine_set
    from dflash_trt.export.contract import export_specs
    from dflash_trt.export.manifest import load_manifest

    dims = load_manifest(directory, verify="none").dims()
    started = time.perf_counter()
    record_ = check_engine_set(directory, export_specs(dims), hash_plans=False)
    checks = time.perf_counter() - started
    engines = [*record_.engines.values(), *([record_.probe.engine] if record_.probe else [])]
    return [directory / e.plan for e in engines], record_.shared_weights, checks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--set", type=Path, help="a built engine set (engines.json and plans)")
    source.add_argument("--like-8b", action="store_true", help="files of the Qwen3-8B-shape set's sizes, in --work")
    parser.add_argument("--work", type=Path, help="where --like-8b writes its files (~18.8 GB)")
    parser.add_argument("--record", action="store_true", help="append the JSON line to benchmarks/results.jsonl")
    args = parser.parse_args()
    if args.like_8b and args.work is None:
        parser.error("--like-8b needs --work DIR")
    from dflash_trt.engines.shared_weights import read_shared_weights

    if args.like_8b:
        plans, shared = write_like_8b(args.work)
        directory, checks = args.work, None
    else:
        plans, shared, checks = of_set(args.set)
        directory = args.set
    rows = []
    for path in plans:
        drop_cache(path)
        seconds, size = stream_plan(path)
        rows.append((path.name, size, seconds))
    if shared is not None:
        drop_cache(directory / shared.file)
        started = time.perf_counter()
        read_shared_weights(directory, shared)
        rows.append((shared.file, shared.bytes, time.perf_counter() - started))
    total_bytes, total_seconds = sum(r[1] for r in rows), sum(r[2] for r in rows) + (checks or 0.0)
    print(f"{'file':<28} {'GB':>8} {'s':>7} {'GB/s':>6}")
    for name, size, seconds in rows:
        print(f"{name:<28} {size / 1e9:>8.3f} {seconds:>7.2f} {size / 1e9 / seconds:>6.2f}")
    if checks is not None:
        print(f"{'stage-1 checks':<28} {'':>8} {checks:>7.2f}")
    print(f"{'total':<28} {total_bytes / 1e9:>8.3f} {total_seconds:>7.2f} {total_bytes / 1e9 / total_seconds:>6.2f}")
    line = {
        "benchmark": "load_cost",
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.node()} ({platform.processor() or platform.machine()}, {os.cpu_count()} cpus)",
        "source": "like-8b (random bytes of the Qwen3-8B set's sizes)" if args.like_8b else str(args.set),
        "files": {name: {"bytes": size, "seconds": round(seconds, 3)} for name, size, seconds in rows},
        "stage1_seconds": None if checks is None else round(checks, 3),
        "bytes": total_bytes,
        "seconds": round(total_seconds, 3),
    }
    print(json.dumps(line))
    if args.record:
        record.append_rows([line])
    return 0


if __name__ == "__main__":
    sys.exit(main())
