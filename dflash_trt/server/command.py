"""``dflash-trt serve``: the OpenAI-compatible HTTP server (needs the ``serve`` extra).

    dflash-trt serve                                     # the embedded default pair, ONNX Runtime, CPU
    dflash-trt serve --artifacts EXPORT_DIR --backend onnxruntime --port 8000
    dflash-trt serve --artifacts ENGINE_DIR --backend tensorrt --tokenizer TARGET_DIR
    dflash-trt serve --backend torch --device cuda       # the checkpoints in PyTorch (bf16 on CUDA), no export
    dflash-trt serve ... --no-draft                      # plain target decoding: the autoregressive baseline

Without ``--artifacts`` the default pair is exported to the cache exactly as
``dflash-trt demo`` does (reused when unchanged), except for ``--backend
torch``, which runs the checkpoints (``--target``/``--draft``) directly with
the export's default geometry (``--dtype``, ``--max-owners``). The tokenizer (text
prompts, chat template, stop tokens) is the first ``tokenizer.json`` among
``--tokenizer``, the artifacts dir and ``--target``. One serving loop serves every
connection: one executor on one background thread (``runtime.serving.loop``).
"""

from __future__ import annotations

import argparse
import signal
from pathlib import Path

from dflash_trt import demo
from dflash_trt.cli import positive_int
from dflash_trt.errors import ServingError
from dflash_trt.runtime import command

DEFAULT_PAIR_SESSIONS = 16  # cache rows when serving the default pair (its export says 4, for the demo)
DEFAULT_PAIR_MODEL = "dflash-trt-default-pair"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pair = demo._default_pair()
    parser.add_argument("--artifacts", type=Path, help="export dir (manifest.json + ONNX) or engine dir; default: the embedded pair, exported to --cache")
    parser.add_argument("--backend", choices=command.BACKEND_CHOICES, default="onnxruntime")
    parser.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model-name", help="the model id clients send (default: the artifacts dir name, or the target dir name; dflash-trt-default-pair for the default pair)")
    parser.add_argument("--tokenizer", type=Path, help="dir with tokenizer.json (default: --artifacts, then --target)")
    parser.add_argument("--chat-template", type=Path, help="Jinja chat template file (default: the tokenizer's)")
    command.add_checkpoint_arguments(parser, target_default=pair / "target")  # --target --draft --cache --device --dtype --max-owners
    parser.add_argument("--max-sessions", type=positive_int, help=f"requests decoding at once (default: the artifacts' max_sessions; {DEFAULT_PAIR_SESSIONS} for the default pair)")
    parser.add_argument("--max-cycles", type=positive_int, default=8, help="cycles per request per execute (default 8; tokens stream after each execute)")
    parser.add_argument("--no-draft", action="store_true", help="plain target decoding (no speculation): the autoregressive baseline")
    parser.add_argument("--max-queue", type=positive_int, default=256, help="requests waiting for a session before 429 (default 256)")
    parser.add_argument("--threads", type=positive_int, default=None, help="CPU threads for ONNX Runtime / torch")
    parser.add_argument("--shutdown-timeout", type=float, default=10.0, help="seconds open streams get to finish on SIGINT/SIGTERM (default 10)")
    parser.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"))


def _imports():
    try:
        import uvicorn

        from dflash_trt.server.app import create_app
    except ModuleNotFoundError as error:
        msg = f"dflash-trt serve needs the serve extra ({error.name} is missing): pip install 'dflash-trt[serve]'"
        raise ServingError(msg) from error
    return uvicorn, create_app


def _tokenizer(args):
    tokenizer = command.load_tokenizer(args.tokenizer, args.artifacts, args.target)
    if args.chat_template is not None:
        if tokenizer is None:
            raise ServingError("--chat-template needs a tokenizer: pass --tokenizer DIR")
        tokenizer.chat_template = Path(args.chat_template).read_text()
    return tokenizer


def run(args: argparse.Namespace) -> int:
    from dflash_trt.runtime.serving.loop import ServingLoop
    from dflash_trt.runtime.executor import Executor

    command.check_flags(args)  # flags that cannot work together, an export the device cannot run: refused first
    uvicorn, create_app = _imports()
    model = args.model_name or _model_name(args)
    if args.artifacts is None:
        args.max_sessions = args.max_sessions or DEFAULT_PAIR_SESSIONS
        command.prepare_artifacts(args)
    tokenizer = _tokenizer(args)
    with command.open_backend(args) as backend:
        executor = Executor(backend, max_sessions=args.max_sessions, speculate=not args.no_draft, max_cycles=args.max_cycles)
        stop_ids = tokenizer.stop_ids if tokenizer is not None else command._manifest_stops(args.artifacts)
        serving = ServingLoop(executor, tokenizer, max_queue=args.max_queue, stop_ids=stop_ids)
        try:
            mode = "DFlash" if executor.speculate else "plain target decoding (--no-draft)"
            print(f"serving {model} ({args.backend}, {executor.max_sessions} sessions, {mode}) on http://{args.host}:{args.port}/v1", flush=True)
            config = uvicorn.Config(create_app(serving, model), host=args.host, port=args.port, log_level=args.log_level,
                                    timeout_graceful_shutdown=args.shutdown_timeout)
            _run_until_signal(uvicorn.Server(config))
        finally:
            serving.close(drain=False, timeout=30)
    return 0


def _model_name(args) -> str:
    if args.artifacts is not None:
        return Path(args.artifacts).resolve().name
    default = Path(args.target).resolve() == (demo._default_pair() / "target").resolve()
    return DEFAULT_PAIR_MODEL if default else Path(args.target).resolve().name


def _stop(_signal, _frame) -> None:
    raise KeyboardInterrupt


def _run_until_signal(server) -> None:
    """Serve until SIGINT / SIGTERM. uvicorn shuts down gracefully, then re-raises the signal it caught:
    both end here as KeyboardInterrupt, so the serving loop and the backend close and the exit code is 0."""
    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
