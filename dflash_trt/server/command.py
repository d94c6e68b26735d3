"""``dflash-trt serve``: the OpenAI-compatible HTTP server (needs the ``serve`` extra).

    dflash-trt serve                                     # the embedded default pair, ONNX Runtime, CPU
    dflash-trt serve --artifacts EXPORT_DIR --backend onnxruntime --port 8000
    dflash-trt serve --artifacts ENGINE_DIR --backend tensorrt --tokenizer TARGET_DIR
    dflash-trt serve --backend torch --device cuda       # the checkpoints in PyTorch (bf16 on CUDA), no export
    dflash-trt serve ... --no-draft                      # plain target decoding: the autoregressive baseline
    dflash-trt serve ... --replicas 2                    # two serving loops on Ray Serve (server.replicas)
    dflash-trt serve ... --no-front-process              # HTTP and the serving loop in one process

Without ``--artifacts`` the default pair is exported to the cache exactly as
``dflash-trt demo`` does (reused when unchanged), except for ``--backend
torch``, which runs the checkpoints (``--target``/``--draft``) directly with
the export's default geometry (``--dtype``, ``--max-owners``). The tokenizer (text
prompts, chat template, stop tokens) is the first ``tokenizer.json`` among
``--tokenizer``, the artifacts dir and ``--target``. One serving loop serves every
connection: one executor on one background thread (``runtime.serving.loop``).
By default (``--front-process``) that loop runs in a process of its own
(``server.serving_process``) and this process is the HTTP front (uvicorn,
parsing, tokenizing, detokenizing, SSE: ``server.front``), so HTTP work never
holds the GIL the serving loop's thread needs; the two exchange
``server.wire``'s messages over a pipe. If the serving process dies, open
requests get a 503 (or a last error event), /health answers 503, and the
server exits 1 two seconds later. ``--no-front-process``: one process (what Ray
replicas run).

Start-up checks the port first (the socket is bound before anything loads,
and handed to uvicorn), then loads (in the serving process: its progress
lines go to the same stderr). Logs go to stderr at INFO by default:
the start-up, uvicorn's access lines, and every ``--log-interval`` seconds a
throughput line (prompt and generation tokens/s, running and queued
requests, τ). SIGINT / SIGTERM drain (``server.shutdown``) and exit 0.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import gc
import importlib.util
import logging
import logging.config
import math
import os
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dflash_trt.cli import nonnegative_int, positive_int
from dflash_trt.errors import ServingError, UsageError
from dflash_trt.export import DEFAULT_PAIR_DIR
from dflash_trt.export.tokenizer import load_tokenizer

DEFAULT_PAIR_SESSIONS = 16  # cache rows when serving the default pair (its export says 4, for the demo)
DEFAULT_PAIR_MODEL = "dflash-trt-default-pair"
HTTP_PARSERS = ("h11", "httptools")  # serve --http (server.protocols.http_protocol)
AUTO_FRONTS, CORES_PER_FRONT, MAX_AUTO_FRONTS = "auto", 4, 4  # serve --fronts auto (``auto_fronts``)
CGROUP_ROOT = Path("/sys/fs/cgroup")  # this process's cgroup, as a container sees it (``usable_cores``)
STATS_ROWS = 16384  # the executor's stats log in a server: ~5 MB at most (nobody drains it)
STATS_AGE_S = 60.0  # a server reads each row once, right after its execute: keep a minute (flat memory within a minute of start)
MALLOC_ARENAS, M_ARENA_MAX = 2, -8  # glibc's malloc.h: mallopt parameter number of M_ARENA_MAX
EXIT_JOIN_S = 0.5  # after the last response: how long the exit waits for the serving loop's execute to end
FAILED_CLOSE_S = 30.0  # after a failure in the server: how long the serving loop gets to stop before the backend is freed

log = logging.getLogger("dflash_trt.server")


def port_number(text: str) -> int:
    """argparse type of --port: 0..65535 (0: any free port)."""
    value = int(text)
    if not 0 <= value <= 65535:
        msg = f"must be a TCP port in [0, 65535], got {value}"
        raise argparse.ArgumentTypeError(msg)
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        msg = f"must be > 0, got {text}"
        raise argparse.ArgumentTypeError(msg)
    return value


def launch_rounds(asked: int | None, backend) -> int:
    """``--launch-rounds``, or its default for where ``backend`` runs: ``SERVE_CUDA_LAUNCH_ROUNDS`` on a CUDA
    device, where launches are queued and the serving thread's work is per launch; 1 on the CPU, where a launch
    computes before it returns (rounds back to back save no host work there, and discard more at a request's end)."""
    from dflash_trt.runtime.limits import SERVE_CUDA_LAUNCH_ROUNDS

    if asked is not None:
        return asked
    return SERVE_CUDA_LAUNCH_ROUNDS if backend.device.type == "cuda" else 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from dflash_trt.runtime import command  # here, not at the top: an HTTP front process never loads the runtime (torch)

    pair = DEFAULT_PAIR_DIR
    parser.add_argument("--artifacts", type=Path, help="export dir (manifest.json + ONNX) or engine dir; default: the embedded pair, exported to --cache")
    parser.add_argument("--backend", choices=command.BACKEND_CHOICES, default="onnxruntime")
    parser.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=port_number, default=8000, help="TCP port (default 8000; 0: any free port); checked before anything loads")
    parser.add_argument("--served-model-name", "--model-name", dest="served_model_name", nargs="+", metavar="NAME",
                        help="the model names clients may send; the first is reported (default: the target checkpoint's name, "
                             f"{DEFAULT_PAIR_MODEL} for the default pair, else the artifacts dir's)")
    parser.add_argument("--tokenizer", type=Path, help="dir with tokenizer.json (default: --artifacts, then --target)")
    parser.add_argument("--chat-template", help="Jinja chat template: a file, or the template itself (default: the tokenizer's "
                                                "chat_template.jinja or tokenizer_config.json; the default pair ships one)")
    command.add_checkpoint_arguments(parser, target_default=pair / "target")  # --target --draft --cache --device --dtype --max-owners
    parser.add_argument("--max-sessions", type=positive_int, help=f"requests decoding at once (default: the artifacts' max_sessions; {DEFAULT_PAIR_SESSIONS} for the default pair)")
    parser.add_argument("--max-cycles", type=positive_int, default=command.DEFAULT_MAX_CYCLES,
                        help=f"cycles per request per execute (default {command.DEFAULT_MAX_CYCLES})")
    parser.add_argument("--launch-rounds", type=int, default=None, choices=range(1, command.MAX_LAUNCH_ROUNDS + 1),
                        metavar=f"1..{command.MAX_LAUNCH_ROUNDS}",
                        help="rounds one launch runs back to back on the device, read at once: fewer launches (the serving "
                             "thread's work is per launch), more work discarded when a request ends inside one, joining "
                             f"requests wait longer (default {command.SERVE_CUDA_LAUNCH_ROUNDS} on a CUDA device, 1 on the CPU)")
    parser.add_argument("--lag", type=int, default=1, choices=range(command.MAX_LAG + 1), metavar=f"0..{command.MAX_LAG}",
                        help="launches each request keeps queued on the device beyond the one being read: more keeps the "
                             "device busy through uneven host rounds, and discards more work when a request ends (default 1)")
    parser.add_argument("--stream-interval-ms", type=nonnegative_int, default=15,  # runtime.serving.loop.DEFAULT_STREAM_INTERVAL (not imported: it loads torch)
                        help="while an execute runs, the running requests' tokens read since go out together this often "
                             "(a request's first token and its end at once; default 15; 0: after every round; longer: "
                             "fewer deliveries, more throughput under load, longer gaps between a stream's events)")
    parser.add_argument("--no-draft", action="store_true", help="plain target decoding (no speculation): the autoregressive baseline")
    command.add_policy_argument(parser)
    parser.add_argument("--early-join", action=argparse.BooleanOptionalAction, default=True,
                        help="end an execute after its current round when a queued request could take a session "
                             "(default; --no-early-join: it waits for the execute's end, up to --max-cycles rounds)")
    parser.add_argument("--join-running", action=argparse.BooleanOptionalAction, default=True,
                        help="a request that arrives while an execute runs joins it at its next round when a session is free "
                             "(default; --no-join-running: it joins between executes)")
    parser.add_argument("--threads", type=positive_int, default=None, help="CPU threads for ONNX Runtime / torch")
    parser.add_argument("--front-process", action=argparse.BooleanOptionalAction, default=True,
                        help="the HTTP front in its own process, the serving loop in another (default); --no-front-process: "
                             "one process (the HTTP event loop shares the GIL with the serving loop's thread)")
    parser.add_argument("--fronts", type=fronts_count, default=AUTO_FRONTS,
                        help="HTTP front processes sharing the port, each with its own pipe to the serving process: N, or auto "
                             f"(the default: one per {CORES_PER_FRONT} cores this process may use, at most {MAX_AUTO_FRONTS}; one with "
                             "--no-front-process or --replicas); more when one front's CPU is the limit (many streams)")
    parser.add_argument("--http", choices=HTTP_PARSERS, default="h11",
                        help="the HTTP/1.1 parser of the fronts: h11 (pure Python, the default) or httptools (C: less front CPU per "
                             "request; no throughput gained on a GPU host, where the serving process is the limit)")
    parser.add_argument("--replicas", type=positive_int, default=1,
                        help="serving loops behind the one API; N >= 2: a local Ray cluster with N Ray Serve replicas, one GPU each on "
                             "CUDA (the ray extra; server.replicas); default 1: this process alone")
    add_limit_arguments(parser)
    parser.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    parser.add_argument("--log-interval", type=float, default=10.0, help="seconds between throughput log lines (default 10; 0: none)")


def add_limit_arguments(parser: argparse.ArgumentParser) -> None:
    """Every bound on what clients can make the server hold (``server.limits``)."""
    from dflash_trt.server.limits import Limits

    d = Limits()
    parser.add_argument("--max-queue", type=nonnegative_int, default=256, help="requests waiting for a session before 429 (default 256; 0: only when a session is free)")
    parser.add_argument("--max-body-bytes", type=positive_int, help="request body size; larger gets 413 (default: 64 bytes per token of context, at least 1 MiB)")
    parser.add_argument("--read-timeout", type=positive_float, default=d.read_timeout_s,
                        help=f"seconds a client gets to send a whole request (head and body), from connecting or from its previous response; then the connection is closed (default {d.read_timeout_s:g})")
    parser.add_argument("--keep-alive-timeout", type=positive_float, default=d.keep_alive_s, help=f"seconds an idle keep-alive connection stays open (default {d.keep_alive_s:g})")
    parser.add_argument("--max-connections", type=positive_int, default=d.max_connections, help=f"connections (or requests) at once; beyond, requests get 503 (default {d.max_connections})")
    parser.add_argument("--max-header-bytes", type=positive_int, default=d.max_header_bytes, help=f"request head size; larger gets 400 (default {d.max_header_bytes})")
    parser.add_argument("--shutdown-timeout", type=float, default=10.0, help="seconds open requests get to finish on SIGINT/SIGTERM before they are aborted (default 10)")
    parser.add_argument("--stats-rows", type=positive_int, default=STATS_ROWS, help=f"executor stats rows (one per execute: the metrics' source) kept in memory (default {STATS_ROWS}); a server keeps no row per cycle")
    parser.add_argument("--stats-age", type=positive_float, default=STATS_AGE_S, help=f"seconds executor stats rows are kept (default {STATS_AGE_S:g})")


def _imports():
    try:
        import uvicorn  # noqa: F401

        from dflash_trt.server.app import create_app
        from dflash_trt.server.limits import Limits, default_body_bytes
        from dflash_trt.server.protocols import ServeConfig, http_protocol
        from dflash_trt.server.shutdown import GracefulServer
    except ModuleNotFoundError as error:
        msg = f"dflash-trt serve needs the serve extra ({error.name} is missing): pip install 'dflash-trt[serve]'"
        raise ServingError(msg) from error
    return create_app, Limits, ServeConfig, GracefulServer, default_body_bytes, http_protocol


def _tokenizer(args):
    tokenizer = load_tokenizer(args.tokenizer, args.artifacts, args.target)
    if args.chat_template is not None:
        if tokenizer is None:
            raise ServingError("--chat-template needs a tokenizer: pass --tokenizer DIR")
        tokenizer.chat_template = chat_template(args.chat_template)
    return tokenizer


def chat_template(value: str) -> str:
    """--chat-template: a file's text, or the value itself when it is a template (as vLLM accepts)."""
    path = Path(value)
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if "{{" in value or "{%" in value:
        return value
    raise ServingError(f"--chat-template: {value!r} is neither a file nor a Jinja template")


def fronts_count(text: str) -> int | str:
    """argparse type of ``--fronts``: ``auto`` or an int >= 1."""
    if text == AUTO_FRONTS:
        return AUTO_FRONTS
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be {AUTO_FRONTS} or an int >= 1, got {text!r}") from None


def auto_fronts(args: argparse.Namespace, cores: int | None = None) -> int:
    """``--fronts auto``: one front per ``CORES_PER_FRONT`` cores this process may use (``cores``; default
    ``usable_cores()``), between 1 and ``MAX_AUTO_FRONTS``; 1 where no serving process of its own is shared
    (``--no-front-process``, ``--replicas``). One front's CPU was the limit at 64 streams: four raised the
    server's throughput ~1.5× over one on the H200, the busiest of the four still at up to 108% of a core
    (benchmarks/RESULTS.md); a 2-core machine keeps one. More than this rule gives did not pay: on 12 cores of
    an H100 host six or eight fronts against three raised neither mode at 64 streams (the serving process
    at one core is the limit there: RESULTS.md, "More fronts at 64 streams")."""
    if not getattr(args, "front_process", True) or getattr(args, "replicas", 1) > 1:
        return 1
    if cores is None:
        cores = usable_cores()
    return max(1, min(MAX_AUTO_FRONTS, cores // CORES_PER_FRONT))


def usable_cores(cgroup: Path | None = None) -> int:
    """The cores this process may use: its CPU affinity, capped by the CPU quota of its cgroup where one is
    set (a container's ``--cpus``: it sees every core of the host, and may run on a few of them' worth)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = cgroup_cpu_quota(CGROUP_ROOT if cgroup is None else cgroup)
    return cores if quota is None else max(1, min(cores, math.ceil(quota)))


def cgroup_cpu_quota(cgroup: Path) -> float | None:
    """Cores' worth of CPU time the cgroup mounted at ``cgroup`` allows (cgroup v2 ``cpu.max``: "QUOTA PERIOD"
    or "max PERIOD"; v1 ``cpu/cpu.cfs_quota_us`` over ``cpu.cfs_period_us``, -1 without a quota); None when
    none is set or none can be read."""
    try:
        quota, period = (cgroup / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota, period = (int((cgroup / "cpu" / name).read_text()) for name in ("cpu.cfs_quota_us", "cpu.cfs_period_us"))
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def check_front_flags(args: argparse.Namespace) -> None:
    """``--fronts N`` needs the serving process of its own that the fronts share; ``--http httptools``
    needs httptools and this process's fronts (not Ray's proxy) (``UsageError``). ``--fronts auto`` is
    resolved here (``auto_fronts``): ``args.fronts`` is a count after this."""
    if getattr(args, "fronts", 1) == AUTO_FRONTS:
        args.fronts = auto_fronts(args)
    http = getattr(args, "http", "h11")
    if http != "h11" and args.replicas > 1:
        raise UsageError(f"--http {http} applies to this process's HTTP fronts; with --replicas {args.replicas} Ray Serve's proxy parses HTTP: drop --http")
    if http == "httptools" and importlib.util.find_spec("httptools") is None:
        raise UsageError("--http httptools needs the httptools package, which is not installed (pip install httptools); valid here: h11")
    fronts = getattr(args, "fronts", 1)
    if fronts > 1 and not getattr(args, "front_process", True):
        raise UsageError(f"--fronts {fronts} needs --front-process (the fronts share one serving process); drop --no-front-process")
    if fronts > 1 and args.replicas > 1:
        raise UsageError(f"--fronts {fronts} applies to one serving process; with --replicas {args.replicas} Ray Serve is the front")


def serve_http(serving, names: list[str], args: argparse.Namespace, logging_config: dict, listener: socket.socket,
               log_interval_s: float, prepare: Callable | None = None) -> None:
    """The API over ``serving`` on ``listener`` until a signal drained it (every HTTP front runs this);
    ``prepare(server)`` before it runs."""
    create_app, Limits, ServeConfig, GracefulServer, default_body_bytes, http_protocol = _imports()
    body_bytes = args.max_body_bytes or default_body_bytes(serving.executor.dims.max_context)
    limits = Limits(body_bytes, args.read_timeout, args.keep_alive_timeout, args.max_connections, args.max_header_bytes)
    app = create_app(serving, names, limits, log_interval_s)
    config = ServeConfig(app, limits, http=http_protocol(args.http), log_config=logging_config, log_level=args.log_level)
    server = GracefulServer(config, serving, app.state.shutdown, args.shutdown_timeout)
    freeze_heap()  # before the fronts wait for each other (``prepare``): each accepts at once after
    if prepare is not None:
        prepare(server)
    server.run(sockets=[listener])


def run(args: argparse.Namespace) -> int:
    from dflash_trt.runtime import command

    command.check_flags(args)  # flags that cannot work together, an export the device cannot run: refused first
    check_front_flags(args)
    _imports()
    logging_config = _logging_config(args.log_level)
    logging.config.dictConfig(logging_config)
    if args.replicas > 1:
        from dflash_trt.server import replicas

        return replicas.run(args)
    listener = bind(args.host, args.port)  # before anything loads: a busy or bad port fails at once
    cap_malloc_arenas()
    try:
        with _interrupts_as_keyboard():
            served = _start_serving_process(args, logging_config, listener) if getattr(args, "front_process", False) else _load_here(args)
    except KeyboardInterrupt:
        listener.close()
        log.info("interrupted while loading; nothing served")
        return 0
    except BaseException:
        listener.close()
        raise
    serving = served.serving
    try:
        executor = serving.executor
        mode = "DFlash" if executor.speculate else "plain target decoding (--no-draft)"
        host, port = listener.getsockname()[:2]
        log.info("serving %s (%s, %d sessions, %s) on http://%s:%d/v1", served.names[0], args.backend, executor.max_sessions, mode,
                 f"[{host}]" if ":" in host else host, port)

        def prepare(server) -> None:
            server.on_signal = served.on_signal
            if served.on_death is not None:
                served.on_death(server.serving_died)
            if served.start_together is not None:
                served.start_together()

        serve_http(serving, served.names, args, logging_config, listener, args.log_interval, prepare)
    except BaseException:
        served.release(FAILED_CLOSE_S)
        raise
    finally:
        listener.close()
    # Every response is sent. The loop stops at the next gap between executes; closing the backend under a
    # running execute is unsafe, and waiting for it could pass the deadline + 1 s: the exit frees it then.
    died = served.died()
    served.release(EXIT_JOIN_S)
    if died:
        log.error("stopped: the serving process died")
    else:
        log.info("stopped")
    _exit_now(1 if died else 0)


@dataclass
class _Served:
    """What serves the API: the serving loop (or the front's client of the serving process) and its names;
    ``release(seconds)`` stops it and frees its backend; ``died()``: it stopped unasked;
    ``on_death(callback)`` registers the server's reaction (None in one process: the loop has no death of its own)."""

    serving: object
    names: list[str]
    release: Callable[[float], None]
    died: Callable[[], bool] = lambda: False
    on_death: Callable[[Callable[[], None]], None] | None = None
    on_signal: Callable[[int], None] | None = None  # the server's shutdown signal, for the other fronts
    start_together: Callable[[], None] | None = None  # waits for the other fronts to accept too (--fronts)


def _load_here(args) -> _Served:
    serving, backend, names = _load(args)

    def release(timeout: float) -> None:
        if serving.close(drain=False, timeout=timeout):
            backend.close()
        else:
            log.info("exiting during an execute (its requests were already answered); the backend is freed with the process")

    return _Served(serving, names, release)


def _start_serving_process(args, logging_config: dict, listener: socket.socket) -> _Served:
    """Spawn the serving process (it prepares the artifacts and loads), then the front's tokenizer and
    client, and the other fronts (``--fronts``) on ``listener``."""
    from dflash_trt.server import front
    from dflash_trt.server.fronts import STOP_GRACE_S, Fronts

    names = args.served_model_name or [_model_name(args)]
    fronts = getattr(args, "fronts", 1)
    process, conns, ready = front.start(args, logging_config, fronts)
    try:
        if args.artifacts is None and ready.artifacts is not None:
            args.artifacts = Path(ready.artifacts)  # the default pair's export, made by the serving process
        tokenizer = _tokenizer(args)
        if tokenizer is not None:
            tokenizer.chars_per_token  # noqa: B018  (computed once now, not on the first request)
        client = front.ServingClient(process, conns[0], ready, tokenizer)
        others = Fronts(conns[1:], listener, args, logging_config) if fronts > 1 else None
    except BaseException:
        process.kill()
        process.join()
        raise
    log.info("serving process %d loaded; %s", ready.pid,
             "this process serves HTTP (--front-process)" if others is None else f"this process and {fronts - 1} more serve HTTP (--fronts {fronts})")

    def release(timeout: float) -> None:
        if others is not None:  # the serving process outlives every front's drain
            others.signal(signal.SIGTERM)
            others.join(args.shutdown_timeout + STOP_GRACE_S)
        client.stop()

    def on_death(callback) -> None:
        client.on_death = callback
        if client.died:  # it died before the callback was set
            callback()

    return _Served(client, names, release, lambda: client.died, on_death, on_signal=others.signal if others is not None else None,
                   start_together=others.start_together if others is not None else None)


def _exit_now(code: int = 0) -> None:
    """Exit without the interpreter's teardown of torch / onnxruntime module state (0.3–0.7 s on a CPU
    box), which would push the exit past --shutdown-timeout + 1 s: every connection is closed and every
    response sent above, the backend closed unless an execute still runs, and logs are flushed here."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _load(args, text: bool = True, handles=None, flush=None):
    """(serving loop, backend, served names): the tokenizer, the backend and its executor. ``text``: the
    loop detokenizes (False in the serving process: the front does); ``handles``, ``flush``: ``ServingLoop``'s."""
    from dflash_trt.runtime import command
    from dflash_trt.runtime.executor import Executor
    from dflash_trt.runtime.serving.handle import RequestHandle
    from dflash_trt.runtime.serving.loop import ServingLoop

    names = args.served_model_name or [_model_name(args)]
    if args.artifacts is None:
        args.max_sessions = args.max_sessions or DEFAULT_PAIR_SESSIONS
        command.prepare_artifacts(args)
    tokenizer = _tokenizer(args)
    backend = command.open_backend(args)
    try:
        executor = Executor(backend, max_sessions=args.max_sessions, speculate=not args.no_draft, max_cycles=args.max_cycles,
                            stats_rows=args.stats_rows, stats_age_s=args.stats_age, policy=args.policy,
                            launch_rounds=launch_rounds(getattr(args, "launch_rounds", None), backend), lag=getattr(args, "lag", 1),
                            cycle_table=False)  # the server reads the execute rows only (its metrics): no row per owner and round
        stop_ids = tokenizer.stop_ids if tokenizer is not None else command.manifest_stops(args.artifacts)
        if tokenizer is not None and text:
            tokenizer.chars_per_token  # noqa: B018  (computed once now, not on the first request)
        serving = ServingLoop(executor, tokenizer if text else None, max_queue=args.max_queue, stop_ids=stop_ids,
                              stream_interval=args.stream_interval_ms / 1000, handles=handles or RequestHandle,
                              early_join=getattr(args, "early_join", True), join_running=getattr(args, "join_running", True), flush=flush)
        return serving, backend, names
    except BaseException:
        backend.close()
        raise


def freeze_heap() -> int:
    """Move every object this process holds now (torch, the backend, the app) out of the cyclic collector's
    view (``gc.freeze``, after one collection so no garbage is kept): its full passes then walk only what
    serving makes. Called once loaded, before serving. Without it a full collection walked the whole
    process while every stream waited: 150–190 ms in a serving process on an H200, now and then during
    serving (benchmarks/RESULTS.md, "The serving thread's environment reads"). Returns the objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def cap_malloc_arenas(arenas: int = MALLOC_ARENAS) -> bool:
    """Cap glibc's malloc arenas (``mallopt(M_ARENA_MAX)``) before any thread starts, unless
    ``MALLOC_ARENA_MAX`` is set; False where the C library is not glibc.

    glibc gives each thread that contends for the heap an arena of its own (up to 8 per core) and
    seldom hands their free pages back: with the request threads, ONNX Runtime's and torch's, an
    unscraped server's RSS crept up ~1.3 MB a minute under load on 2 cores, about half of it in those
    arenas (benchmarks/RESULTS.md, serve_adversarial).
    """
    if os.environ.get("MALLOC_ARENA_MAX"):
        return False
    try:
        libc = ctypes.CDLL(None)
        return bool(libc.gnu_get_libc_version and libc.mallopt(M_ARENA_MAX, arenas))
    except (OSError, AttributeError):
        return False


def bind(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket on (host, port), as uvicorn binds it; ServingError naming both if it cannot."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, as create_server makes it: asyncio sets TCP_NODELAY only on such sockets (with
    # proto 0, a keep-alive request waited ~40 ms for the client's delayed ACK, Nagle holding the body).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        hint = " (another server is listening there: pick another --port)" if error.errno == 98 else ""
        raise ServingError(f"cannot listen on {host}:{port}: {error.strerror or error}{hint}") from error
    sock.set_inheritable(True)
    return sock


def _logging_config(level: str) -> dict:
    """uvicorn's logging config, with this package's logger beside uvicorn's (same handler, timestamps)."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config["formatters"]["dflash_trt"] = {"()": "uvicorn.logging.DefaultFormatter", "fmt": "%(levelprefix)s %(asctime)s %(message)s", "use_colors": None}
    config["handlers"]["dflash_trt"] = {"formatter": "dflash_trt", "class": "logging.StreamHandler", "stream": "ext://sys.stderr"}
    config["loggers"]["dflash_trt"] = {"handlers": ["dflash_trt"], "level": level.upper(), "propagate": False}
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        config["loggers"][name]["level"] = level.upper()
    return config


class _interrupts_as_keyboard:
    """SIGTERM raises KeyboardInterrupt (as SIGINT does) while the server loads, so either ends it cleanly."""

    def __enter__(self):
        self.previous = signal.signal(signal.SIGTERM, _interrupt)

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGTERM, self.previous)


def _interrupt(_signal, _frame) -> None:
    raise KeyboardInterrupt


def _model_name(args) -> str:
    """The target checkpoint's name (the default pair's own name), unless only artifacts name the model."""
    default = Path(args.target).resolve() == (DEFAULT_PAIR_DIR / "target").resolve()
    if args.artifacts is None or _exported_here(args):
        return DEFAULT_PAIR_MODEL if default else Path(args.target).resolve().name
    return Path(args.artifacts).resolve().name


def _exported_here(args) -> bool:
    """The artifacts are an export this command made in --cache (a hash-named folder): the target names the model."""
    return Path(args.artifacts).resolve().parent == (Path(args.cache) / "export").resolve()
