"""Replicas on Ray Serve behind the same OpenAI API (the ``ray`` extra): ``dflash-trt serve --replicas N``
(a local Ray cluster), or ``builder`` in a Serve config file / ``serve run`` (any Ray cluster).

Each replica is one Ray Serve deployment replica holding one ``ServingLoop``
(its executor and backend on its device: ``num_gpus`` 1 on CUDA, so Ray places
one replica per GPU; else ``--threads`` CPUs) and serving the very app
``dflash-trt serve`` serves (``server.app.create_app``) through
``@serve.ingress``: the same routes, SSE streams (Ray Serve streams an ASGI
response from the replica through its HTTP proxy), errors and body limit.
Ray Serve's HTTP proxy routes each request to a replica by queue length (its
default router: the shorter queue of two replicas drawn at random); at most
``max_sessions + max_queue`` requests are sent to one replica at once (its own
capacity; beyond, the replica answers 429 as the single server does), further
requests wait in the proxy.

Ray restarts a replica whose ``check_health`` fails (its serving loop stopped)
or whose process dies. On SIGINT / SIGTERM Ray Serve stops taking requests and
each replica gets ``--shutdown-timeout`` seconds to finish its open ones
before its serving loop is closed.

What differs from the single server: the connection-level bounds (read
deadline, keep-alive, connections, header size) are those of Ray Serve's
proxy (only ``--keep-alive-timeout`` is passed on), and ``GET /health`` and
``GET /metrics`` answer for the replica the request reached.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import signal
import socket
import threading
import time

from dflash_trt.errors import ServingError

log = logging.getLogger("dflash_trt.server")

APP_NAME = "dflash-trt"
HEALTH_PERIOD_S = 5.0  # how often Ray asks a replica check_health
HEALTH_TIMEOUT_S = 30.0
STOP_SLACK_S = 15.0  # beyond --shutdown-timeout: how long Ray Serve's stop may take before the cluster is stopped anyway
UNKNOWN_SESSIONS = 256  # the replicas' sessions when the artifacts set them (not read here): a bound for the proxy only  # a replica's check_health answer within this, or it is restarted


def _ray():
    try:
        import ray
        from ray import serve
    except ModuleNotFoundError as error:
        msg = f"dflash-trt serve --replicas needs the ray extra ({error.name} is missing): pip install 'dflash-trt[serve,ray]'"
        raise ServingError(msg) from error
    return ray, serve


def _replica_class():
    """The replicas' deployment (defined on use: ray is an optional dependency)."""
    _, serve = _ray()

    @serve.ingress()  # the app is built on the replica, over its serving loop (__serve_build_asgi_app__)
    class Replica:
        """One serving loop on its device, served by ``server.app``."""

        def __init__(self, args: argparse.Namespace) -> None:
            from dflash_trt.server import command

            self.args = args
            command.cap_malloc_arenas()
            self.serving, self.backend, self.names = command._load(args)

        def __serve_build_asgi_app__(self):
            from dflash_trt.server.app import create_app

            return create_app(self.serving, self.names, limits(self.args, self.serving), self.args.log_interval)

        def check_health(self) -> None:
            """Ray restarts the replica when this raises: its serving loop stopped (a fatal error)."""
            if not self.serving.healthy:
                raise ServingError("the serving loop of this replica stopped")

        async def __del__(self) -> None:
            # Ray Serve has waited for the open requests (graceful_shutdown_timeout_s); close what is left.
            if self.serving.close(drain=False, timeout=5.0):
                self.backend.close()
            await super().__del__()  # the app's lifespan shutdown (ASGIAppReplicaWrapper)

    return serve.deployment(Replica)


def limits(args: argparse.Namespace, serving):
    from dflash_trt.server.limits import Limits, default_body_bytes

    body_bytes = args.max_body_bytes or default_body_bytes(serving.executor.dims.max_context)
    return Limits(body_bytes, args.read_timeout, args.keep_alive_timeout, args.max_connections, args.max_header_bytes)


def actor_options(args: argparse.Namespace) -> dict:
    """One GPU per replica on CUDA (Ray sets CUDA_VISIBLE_DEVICES: the replica sees it as ``cuda``), else its CPU threads."""
    if str(args.device or "").startswith("cuda") or (args.device is None and args.backend == "tensorrt"):
        return {"num_gpus": 1, "num_cpus": 1}
    return {"num_cpus": args.threads or 1}


def deployment(args: argparse.Namespace):
    """The replicas' deployment for these (prepared) flags: ``args.replicas`` replicas, their resources and bounds."""
    capacity = (args.max_sessions or UNKNOWN_SESSIONS) + args.max_queue  # what one replica holds before it answers 429
    return _replica_class().options(
        name="replica", num_replicas=args.replicas, ray_actor_options=actor_options(args),
        max_ongoing_requests=capacity, graceful_shutdown_timeout_s=max(args.shutdown_timeout, 0.0),
        health_check_period_s=HEALTH_PERIOD_S, health_check_timeout_s=HEALTH_TIMEOUT_S,
    )


def application(args: argparse.Namespace):
    """The Ray Serve application: ``args.replicas`` replicas of ``Replica(args)`` (artifacts already prepared)."""
    replica_args = argparse.Namespace(**vars(args))
    if str(args.device or "").startswith("cuda"):
        replica_args.device = "cuda"  # each replica sees only its own GPU
    return deployment(args).bind(replica_args)


def builder(config: dict):
    """A Ray Serve application builder, for a Serve config file's ``import_path`` or ``serve run``:

        serve run dflash_trt.server.replicas:builder flags="--replicas 4 --backend tensorrt --artifacts ENGINE_DIR"

    ``config["flags"]``: ``dflash-trt serve``'s flags as one string (the host and port are the Serve
    config's ``http_options``; the cluster is the one Ray connects to). The artifacts are prepared here
    and must be at the same path on every node."""
    from dflash_trt.cli import build_parser
    from dflash_trt.runtime import command as runtime_command

    args = build_parser("serve").parse_args(["serve", *shlex.split(str(config.get("flags", "")))])
    runtime_command.check_flags(args)
    prepare(args)
    return application(args)


def prepare(args: argparse.Namespace) -> None:
    """Once, before the replicas start: the served names and the artifacts (the default pair exported to
    the cache here, not by N replicas at once), so every replica loads the same files."""
    from dflash_trt.runtime import command as runtime_command
    from dflash_trt.server import command

    args.served_model_name = args.served_model_name or [command._model_name(args)]
    if args.artifacts is None:
        args.max_sessions = args.max_sessions or command.DEFAULT_PAIR_SESSIONS
        runtime_command.prepare_artifacts(args)


def run(args: argparse.Namespace) -> int:
    """Start a local Ray cluster, serve ``args.replicas`` replicas on host:port, and wait for SIGINT/SIGTERM."""
    ray, serve = _ray()
    from dflash_trt.server import command

    command.bind(args.host, args.port).close()  # a busy or bad port fails before anything loads
    prepare(args)
    per_replica = actor_options(args).get("num_cpus", 1)
    # A local cluster: at least one logical CPU per replica's threads, however many cores there are. Its servers
    # start here, the port held from them; Serve's proxy binds it next.
    with hold_port(args.host, args.port):
        ray.init(num_cpus=max(os.cpu_count() or 1, per_replica * args.replicas + 1), include_dashboard=False,
                 logging_level=args.log_level.upper())
    previous = signal.signal(signal.SIGTERM, _interrupt), signal.signal(signal.SIGINT, _interrupt)
    try:
        serve.start(http_options={"host": args.host, "port": args.port, "keep_alive_timeout_s": int(args.keep_alive_timeout)})
        serve.run(application(args), name=APP_NAME, route_prefix="/", blocking=False)
        log.info("serving %s (%s, %d replicas of %s sessions) on http://%s:%d/v1", args.served_model_name[0], args.backend,
                 args.replicas, args.max_sessions or "the artifacts'", args.host, args.port)
        while True:
            time.sleep(1.0)
    except KeyboardInterrupt:
        log.info("stopping: the replicas finish their open requests (at most %g s)", args.shutdown_timeout)
    finally:
        signal.signal(signal.SIGTERM, previous[0])
        signal.signal(signal.SIGINT, previous[1])
        _stop(ray, serve, args.shutdown_timeout + STOP_SLACK_S)
    log.info("stopped")
    return 0


def hold_port(host: str, port: int) -> socket.socket:
    """The serving port, listened on (never accepted) while the local Ray cluster starts: Ray's own servers bind
    ports the kernel hands out, and where ``--port`` lies in that range one of them could take it before Serve's
    proxy binds it (the proxy then fails, and clients reach a gRPC server). A listening socket shares its port with
    no other bind; not inherited by Ray's processes, it is gone once closed (clients that connect meanwhile are
    reset then: only ``ray.init`` runs under it). ServingError naming the port if busy."""
    from dflash_trt.server import command

    held = command.bind(host, port)
    held.set_inheritable(False)
    held.listen(1)
    return held


def _stop(ray, serve, timeout_s: float) -> None:
    """Ray Serve drains and stops the replicas, bounded: when the signal reached Ray's own processes too
    (a terminal's Ctrl+C, a supervisor signalling the process group) its shutdown can wait forever on
    dead actors; the local cluster is stopped after ``timeout_s`` either way."""
    stopper = threading.Thread(target=serve.shutdown, name="dflash-trt-serve-shutdown", daemon=True)
    stopper.start()
    stopper.join(timeout_s)
    if stopper.is_alive():
        log.warning("Ray Serve did not stop within %g s; stopping the local Ray cluster", timeout_s)
    ray.shutdown()


def _interrupt(_signal, _frame) -> None:
    raise KeyboardInterrupt
