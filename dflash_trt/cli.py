"""The ``dflash-trt`` console command.

Each subcommand is owned by its pipeline stage: the module named in
``COMMANDS`` defines ``add_arguments(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from dflash_trt import __version__
from dflash_trt.errors import DFlashError

# name -> (module owning it, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "export": ("dflash_trt.export.command", "trace target, drafts and verifiers to ONNX + manifest"),
    "build": ("dflash_trt.engines.command", "build TensorRT / TensorRT-RTX engines from exported graphs"),
    "selfcheck": ("dflash_trt.engines.selfcheck", "compare every engine with ONNX Runtime on random inputs"),
    "run": ("dflash_trt.runtime.command", "serve a prompt file through the runtime, write outputs + stats"),
    "bench": ("dflash_trt.runtime.bench", "plain decoding vs DFlash on the same prompts: tokens/s, τ, speedup"),
    "demo": ("dflash_trt.demo", "run the embedded default pair end to end on this machine"),
    "serve": ("dflash_trt.server.command", "OpenAI-compatible HTTP server (completions, chat, SSE, metrics)"),
    "report": ("dflash_trt.analysis.command", "summarize stats Parquet files: tables, plots, JSON"),
    "generate": ("dflash_trt.export.generate_command", "reference (PyTorch eager) generation from checkpoints"),
    "train": ("dflash_trt.train.command", "train a tokenizer, target and DFlash draft"),
}


def positive_int(text: str) -> int:
    """argparse type of every count flag: an int >= 1."""
    value = int(text)
    if value < 1:
        msg = f"must be >= 1, got {value}"
        raise argparse.ArgumentTypeError(msg)
    return value


def build_parser(selected: str | None = None) -> argparse.ArgumentParser:
    """Only the selected subcommand's module is imported: stages pull in their own
    dependencies (polars, onnxruntime, tensorrt) and a missing one must not break others."""
    parser = argparse.ArgumentParser(prog="dflash-trt", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"dflash-trt {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        if name != selected:
            continue
        module = importlib.import_module(module_name)
        module.add_arguments(command)
        command.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    selected = next((arg for arg in argv if not arg.startswith("-")), None)
    parser = build_parser(selected if selected in COMMANDS else None)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except DFlashError as error:
        print(f"dflash-trt {args.command}: {type(error).__name__}: {error}", file=sys.stderr)
        return error.exit_status  # 1; 2 for an input the command cannot take (e.g. UnsupportedExportError)


if __name__ == "__main__":
    sys.exit(main())
