"""The ``dflash-trt`` console command.

Each subcommand is owned by its pipeline stage: the module named in
``COMMANDS`` defines ``add_arguments(parser)`` and ``run(args) -> int``.

Exit codes: 0 done; 1 a typed error of the library (``DFlashError``: bad
input files, a failed export or run); 2 a usage error (``UsageError``: a
flag's value or flags that do not go together, refused before anything
loads). Errors print one line: ``dflash-trt COMMAND: ErrorType: message``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from dflash_trt import __version__
from dflash_trt.errors import DFlashError, UsageError

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
    return _int_at_least(text, 1)


def nonnegative_int(text: str) -> int:
    """argparse type of a count where 0 means off (``--top-k``): an int >= 0."""
    return _int_at_least(text, 0)


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an int >= {low}, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be an int >= {low}, got {value}")
    return value


def check_sampling_flags(args: argparse.Namespace) -> None:
    """``--temperature`` / ``--top-k`` / ``--top-p`` within what the verifiers represent, before anything loads."""
    from dflash_trt.errors import SamplingError
    from dflash_trt.export.sampling import check_sampling

    try:
        check_sampling(args.temperature, args.top_k, args.top_p)
    except SamplingError as error:
        raise UsageError(f"--temperature / --top-k / --top-p: {error}") from None


class Parser(argparse.ArgumentParser):
    """argparse, but a bad command line raises ``UsageError`` (one line, exit 2) instead of printing usage."""

    def error(self, message: str):
        raise UsageError(f"{message} (see {self.prog} --help)")


def build_parser(selected: str | None = None) -> argparse.ArgumentParser:
    """Only the selected subcommand's module is imported: stages pull in their own
    dependencies (polars, onnxruntime, tensorrt) and a missing one must not break others."""
    parser = Parser(prog="dflash-trt", description=__doc__.splitlines()[0])
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
    command = selected if selected in COMMANDS else None
    try:
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help()
            return 2
        return int(args._run(args) or 0)
    except DFlashError as error:
        where = f"dflash-trt {command}" if command else "dflash-trt"
        print(f"{where}: {type(error).__name__}: {error}", file=sys.stderr)
        return 2 if isinstance(error, UsageError) else 1


if __name__ == "__main__":
    sys.exit(main())
