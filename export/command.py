"""``dflash-trt export``: trace a target + DFlash draft pair to ONNX graphs + manifest.json.

    dflash-trt export --target DIR --draft DIR --out DIR [--backend onnxruntime|tensorrt] [--max-owners 4]
        [--max-sessions N] [--max-context L] [--max-chunk T] [--proposals P]
        [--verify-proposals K ...] [--dtype bf16|fp16|fp32] [--causal lengths|mask] [--[no-]shared-weights]
        [--[no-]live-keys] [--force]

The dtype follows the backend the export is for (``--backend``, default
``onnxruntime``, as ``dflash-trt run``'s): fp32 for ONNX Runtime (its CPU
provider has no bf16 kernels), bf16 for TensorRT plans (``dflash-trt
build``; TensorRT-RTX builds no fp32 attention); ``--dtype`` overrides. So
does ``--live-keys``: on for ONNX Runtime (its attention then reads the
cache slots in use, not all of them: ``export.graph_passes``), off for
TensorRT (whose builds refuse it). The
target's tokenizer files are copied beside the graphs and named in the
manifest, so ``run`` / ``serve`` need no ``--tokenizer``. An output
directory already holding a valid export of the same inputs is left alone
unless ``--force``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from dflash_trt.cli import positive_int
from dflash_trt.errors import ExportError, UsageError
from dflash_trt.export.contract import DTYPES
from dflash_trt.export.exporter import ExportOptions, export_pair, up_to_date
from dflash_trt.export.onnx_kernels import CAUSAL_MODES

# The dtype an export gets by default for what will run it: ONNX Runtime (CPU provider: fp32 and fp16, no
# bf16 kernels) or TensorRT plans (bf16 and fp16 build everywhere; TensorRT-RTX has no fp32 attention).
BACKEND_DTYPES = {"onnxruntime": "fp32", "tensorrt": "bf16"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, type=Path, help="target checkpoint directory (HF layout)")
    parser.add_argument("--draft", required=True, type=Path, help="DFlash draft checkpoint directory (z-lab layout)")
    parser.add_argument("--out", required=True, type=Path, help="output directory for the graphs and manifest.json")
    parser.add_argument("--max-owners", type=positive_int, default=4, help="static draft/verify graphs for 1..N owners (default 4)")
    parser.add_argument("--max-sessions", type=positive_int, help="cache rows the runtime allocates (default: max owners)")
    parser.add_argument("--max-context", type=positive_int, help="cache length in positions (default: min(4096, target max positions))")
    parser.add_argument("--max-chunk", type=positive_int, help="largest prefill / context chunk (default: min(512, max context))")
    parser.add_argument("--proposals", type=positive_int, help="draft tokens verified per cycle, 2..block-1 (default: block - 1)")
    parser.add_argument(
        "--verify-proposals", type=positive_int, nargs="+", metavar="K",
        help="shorter verify lengths a cycle may use besides P (graphs per length; the policy picks one per round; "
             "default: 2^j-1 while 2k+1 <= P, e.g. 3 7 for P 15)",
    )
    parser.add_argument("--backend", choices=tuple(BACKEND_DTYPES), default="onnxruntime",
                        help="what will run the export; picks the default --dtype: onnxruntime fp32 (default), tensorrt bf16")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="model dtype (default: from --backend)")
    parser.add_argument(
        "--causal",
        choices=CAUSAL_MODES,
        default=CAUSAL_MODES[0],
        help="target causal attention: lengths (is_causal + kv lengths, fast) or mask (boolean mask)",
    )
    parser.add_argument(
        "--shared-weights",
        action=argparse.BooleanOptionalAction,
        help="one weights.data for all graphs, each tensor once (default: when the checkpoints exceed 1 GiB)",
    )
    parser.add_argument(
        "--live-keys",
        action=argparse.BooleanOptionalAction,
        help="attention reads only the cache slots in use, sliced by the longest owner's length (default: on for --backend onnxruntime, "
             "whose attention otherwise reads the whole cache; off for tensorrt, whose builds refuse it)",
    )
    parser.add_argument("--force", action="store_true", help="re-export even if the output is up to date")


def run(args: argparse.Namespace) -> int:
    options = ExportOptions(
        max_owners=args.max_owners,
        max_sessions=args.max_sessions,
        max_context=args.max_context,
        max_chunk=args.max_chunk,
        proposals=args.proposals,
        verify_proposals=tuple(args.verify_proposals) if args.verify_proposals else None,
        dtype=args.dtype or BACKEND_DTYPES[args.backend],
        causal=args.causal,
        shared_weights=args.shared_weights,
        live_keys=args.live_keys if args.live_keys is not None else args.backend == "onnxruntime",
    )
    try:
        options.resolve(args.target, args.draft)  # refuse bad options before any work
    except ExportError as error:  # an option out of range (checkpoint problems keep their own types)
        raise UsageError(str(error)) from None
    if not args.force and up_to_date(args.target, args.draft, args.out, options) is not None:
        print(f"{args.out}: up to date (same checkpoints, options and exporter); use --force to re-export")
        return 0
    started = time.perf_counter()
    manifest = export_pair(args.target, args.draft, args.out, options, progress=True, force=True)
    files = {name for g in manifest.graphs.values() for name in (g.file, *g.data_files)}
    total = sum((args.out / name).stat().st_size for name in files)
    print(
        f"{args.out}: {len(manifest.graphs)} graphs, {total / 2**20:.1f} MiB, {manifest.dtype}, "
        f"block {manifest.block_size}, proposals {manifest.proposals} (verify lengths {list(manifest.verify_proposals)}), max owners {manifest.max_owners}, "
        f"max context {manifest.max_context}, in {time.perf_counter() - started:.1f} s"
    )
    return 0
