"""``dflash-trt serve``: the OpenAI-compatible HTTP server (needs the ``serve`` extra).

    dflash-trt serve                                     # the embedded default pair, ONNX Runtime, CPU
    dflash-trt serve --artifacts EXPORT_DIR --backend onnxruntime --port 8000
    dflash-trt serve --artifacts ENGINE_DIR --backend tensorrt --tokenizer TARGET_DIR

Without ``--artifacts`` the default pair is exported to the cache exactly as
``dflash-trt demo`` does (reused when unchanged). The tokenizer (text
prompts, chat template, stop tokens) is the first ``tokenizer.json`` among
``--tokenizer``, the artifacts dir and ``--target``. One engine serves every
connection: one executor on one background thread (``runtime.engine``).
"""

from __future__ import annotations

import argparse
import signal
from pathlib import Path

from dflash_trt.errors import ServingError
from dflash_trt import demo
from dflash_trt.cli import positive_int
from dflash_trt.runtime import command

DEFAULT_PAIR_SESSIONS = 16  # cache rows when serving the default pair (its export says 4, for the demo)
DEFAULT_PAIR_MODEL = "dflash-trt-default-pair"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pair = demo._default_pair()
    parser.add_argument("--artifacts", type=Path, help="export dir (manifest.json + ONNX) or engine dir; default: the embedded pair, exported to --cache")
    parser.add_argument("--backend", choices=command.BACKEND_CHOICES, default="onnxruntime")
    parser.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model-name", help="the model id clients send (default: the artifacts dir name)")
    parser.add_argument("--tokenizer", type=Path, help="dir with tokenizer.json (default: --artifacts, then --target)")
    parser.add_argument("--chat-template", type=Path, help="Jinja chat template file (default: the tokenizer's)")
    parser.add_argument("--target", type=Path, default=pair / "target", help="target checkpoint (torch backend; default pair)")
    parser.add_argument("--draft", type=Path, default=pair / "draft", help="draft checkpoint (torch backend; default pair)")
    parser.add_argument("--cache", type=Path, default=demo._default_cache(), help="export cache for the default pair")
    parser.add_argument("--device", default=None, help="cpu or cuda[:i] (default: cpu, cuda for tensorrt)")
    parser.add_argument("--max-sessions", type=positive_int, help=f"requests decoding at once (default: the artifacts' max_sessions; {DEFAULT_PAIR_SESSIONS} for the default pair)")
    parser.add_argument("--max-queue", type=int, default=256, help="requests waiting for a session before 429 (default 256)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for ONNX Runtime / torch")
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
    from dflash_trt.runtime.engine import Engine
    from dflash_trt.runtime.executor import Executor

    uvicorn, create_app = _imports()
    default_pair = args.artifacts is None
    if default_pair:
        args.artifacts = demo.export_dir(args)
        args.max_sessions = args.max_sessions or DEFAULT_PAIR_SESSIONS
    model = args.model_name or (DEFAULT_PAIR_MODEL if default_pair else Path(args.artifacts).resolve().name)
    tokenizer = _tokenizer(args)
    with command.OPENERS[args.backend](args) as backend:
        executor = Executor(backend, max_sessions=args.max_sessions)
        stop_ids = tokenizer.stop_ids if tokenizer is not None else command._manifest_stops(args.artifacts)
        engine = Engine(executor, tokenizer, max_queue=args.max_queue, stop_ids=stop_ids)
        try:
            print(f"serving {model} ({args.backend}, {executor.max_sessions} sessions) on http://{args.host}:{args.port}/v1", flush=True)
            config = uvicorn.Config(create_app(engine, model), host=args.host, port=args.port, log_level=args.log_level,
                                    timeout_graceful_shutdown=args.shutdown_timeout)
            _run_until_signal(uvicorn.Server(config))
        finally:
            engine.close(drain=False, timeout=30)
    return 0


def _stop(_signal, _frame) -> None:
    raise KeyboardInterrupt


def _run_until_signal(server) -> None:
    """Serve until SIGINT / SIGTERM. uvicorn shuts down gracefully, then re-raises the signal it caught:
    both end here as KeyboardInterrupt, so the engine and the backend close and the exit code is 0."""
    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
