"""The HTTP layer's bounds on what a client can make a front hold, over both protocols the server speaks.

h11 (``server.protocols.HTTP_PROTOCOL``) or httptools (``serve --http httptools``); each test runs on both
(uvicorn in a thread over a small ASGI app: the bounds are the protocol's, not the app's).
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import threading
import time
from importlib.util import find_spec

import pytest

pytest.importorskip("uvicorn")

import uvicorn  # noqa: E402

from dflash_trt.errors import UsageError  # noqa: E402
from dflash_trt.server import command, protocols  # noqa: E402
from dflash_trt.server.limits import Limits  # noqa: E402
from dflash_trt.server.protocols import ServeConfig, TimedH11Protocol, http_protocol, httptools  # noqa: E402

READ_TIMEOUT_S = 0.5
HEAD_LIMIT = 2048
STREAM_CHUNKS = 8  # /stream: one chunk every READ_TIMEOUT_S / 2, so it outlasts the deadline fourfold

PROTOCOLS = [pytest.param(TimedH11Protocol, id="h11")]
if httptools is not None:
    from dflash_trt.server.protocols import TimedHttpToolsProtocol

    PROTOCOLS.append(pytest.param(TimedHttpToolsProtocol, id="httptools"))


async def echo_app(scope, receive, send) -> None:
    """``/stream``: STREAM_CHUNKS chunks over 4 read deadlines; else 200 with the body's length."""
    if scope["type"] != "http":
        return
    size = 0
    while True:
        message = await receive()
        size += len(message.get("body", b""))
        if not message.get("more_body"):
            break
    if scope["path"] == "/stream":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        for i in range(STREAM_CHUNKS):
            await send({"type": "http.response.body", "body": b"chunk %d\n" % i, "more_body": True})
            await asyncio.sleep(READ_TIMEOUT_S / 2)
        await send({"type": "http.response.body", "body": b""})
        return
    answer = b"got %d" % size
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(answer))]})
    await send({"type": "http.response.body", "body": answer})


@pytest.fixture(params=PROTOCOLS)
def port(request):
    listener = command.bind("127.0.0.1", 0)
    bounds = Limits(read_timeout_s=READ_TIMEOUT_S, max_header_bytes=HEAD_LIMIT)
    server = uvicorn.Server(ServeConfig(echo_app, bounds, http=request.param, log_level="critical"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started
    yield listener.getsockname()[1]
    server.should_exit = True
    thread.join(30)


def read_response(sock: socket.socket, timeout: float = 10.0) -> bytes:
    """Bytes until the server closes the connection (or ``timeout``)."""
    sock.settimeout(timeout)
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            return data
        if not chunk:
            return data
        data += chunk


def read_one(sock: socket.socket, timeout: float = 10.0) -> bytes:
    """One non-streamed response of echo_app on a kept-alive connection."""
    sock.settimeout(timeout)
    data = b""
    while b"got " not in data:
        chunk = sock.recv(65536)
        assert chunk, data
        data += chunk
    return data


def get(path: str, extra: bytes = b"") -> bytes:
    return b"GET %s HTTP/1.1\r\nHost: x\r\n%s\r\n" % (path.encode(), extra)


def test_asking_for_httptools_where_it_is_not_installed_is_refused_before_anything_starts(monkeypatch):
    """Guards against ``serve --http httptools`` without httptools starting a server whose fronts then fail:
    refused on one line naming the flag; ``--http h11`` is accepted."""
    monkeypatch.setattr(protocols, "httptools", None)
    monkeypatch.setattr(command.importlib.util, "find_spec", lambda name, *a: None if name == "httptools" else find_spec(name, *a))
    flags = dict(fronts=1, replicas=1, front_process=True)
    with pytest.raises(UsageError, match="--http httptools needs the httptools package"):
        command.check_front_flags(argparse.Namespace(http="httptools", **flags))
    with pytest.raises(ValueError, match=r"httptools installed: False\), got 'httptools'"):
        http_protocol("httptools")
    command.check_front_flags(argparse.Namespace(http="h11", **flags))
    assert http_protocol("h11") is TimedH11Protocol


def test_a_parser_asked_for_with_ray_replicas_is_refused_not_ignored():
    """Guards against ``serve --replicas 2 --http httptools`` starting with the flag silently ignored (Ray
    Serve's proxy parses HTTP there): refused on one line naming both flags; the default is accepted."""
    with pytest.raises(UsageError, match="--http httptools applies to this process's HTTP fronts; with --replicas 2"):
        command.check_front_flags(argparse.Namespace(http="httptools", fronts=1, replicas=2, front_process=True))
    command.check_front_flags(argparse.Namespace(http="h11", fronts=1, replicas=2, front_process=True))


@pytest.mark.parametrize("port", PROTOCOLS[1:], indirect=True)  # h11 bounds only a head still incomplete
def test_a_head_over_the_limit_gets_400_and_one_under_it_is_served(port):
    """Guards against a request head of any size being parsed and held (llhttp has no bound of its own):
    a head past --max-header-bytes, sent whole, is answered 400 and closed; one under it is served."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(get("/", b"X-Big: %s\r\n" % (b"a" * (HEAD_LIMIT + 100))))
        refused = read_response(sock)
    assert refused.startswith(b"HTTP/1.1 400"), refused[:80]
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(get("/", b"X-Fits: %s\r\nConnection: close\r\n" % (b"a" * (HEAD_LIMIT // 2))))
        served = read_response(sock)
    assert served.startswith(b"HTTP/1.1 200") and served.endswith(b"got 0"), served[:80]


def test_a_head_that_never_ends_is_refused_once_past_the_limit(port):
    """Guards against a header that never ends being buffered until the read deadline (llhttp holds a
    header's bytes until it ends): past --max-header-bytes it is answered 400 and closed at once."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-Endless: ")
        sent = time.monotonic()
        for _ in range(2 * HEAD_LIMIT // 256):
            try:
                sock.sendall(b"a" * 256)
            except OSError:  # answered and closed while the header was still coming
                break
            time.sleep(0.002)  # separate reads on the server's side
        refused = read_response(sock)
        assert time.monotonic() - sent < READ_TIMEOUT_S, "closed by the read deadline, not by the head's bound"
    assert refused.startswith(b"HTTP/1.1 400"), refused[:80]


def test_a_body_far_larger_than_the_head_limit_in_one_send_is_served(port):
    """Guards against the head's bound counting body bytes: a 300 KB body sent with its head in one
    write (many reads past the head limit) is served whole."""
    body = b"x" * 300_000
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
        served = read_response(sock)
    assert served.startswith(b"HTTP/1.1 200") and served.endswith(b"got %d" % len(body)), served[:80]


def test_half_sent_requests_and_idle_connections_are_closed_at_the_read_deadline(port):
    """Guards against connections that never send a whole request staying open: an idle one, a half-sent
    head and a half-sent body are each closed at --read-timeout, not before."""
    sockets = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
    try:
        sockets[1].sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        sockets[2].sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        opened = time.monotonic()
        for sock in sockets:
            assert read_response(sock, timeout=READ_TIMEOUT_S + 5) == b""
            assert READ_TIMEOUT_S * 0.8 < time.monotonic() - opened < READ_TIMEOUT_S + 3
    finally:
        for sock in sockets:
            sock.close()


def test_the_deadline_never_cuts_a_response_and_restarts_after_each_one(port):
    """Guards against the read deadline cutting a long stream (it bounds reading a request, not answering
    it) and against it not being re-armed on a kept-alive connection: a stream of four deadlines arrives
    whole; a second request sent well within the deadline after the first response is served; then the
    idle connection is closed at the deadline."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(get("/stream", b"Connection: close\r\n"))
        streamed = read_response(sock)
    assert all(b"chunk %d" % i in streamed for i in range(STREAM_CHUNKS)), streamed[-200:]
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(get("/"))
        assert read_one(sock).startswith(b"HTTP/1.1 200")
        time.sleep(READ_TIMEOUT_S * 0.6)
        sock.sendall(get("/"))
        assert read_one(sock).startswith(b"HTTP/1.1 200")
        answered = time.monotonic()
        assert read_response(sock, timeout=READ_TIMEOUT_S + 5) == b""
        assert READ_TIMEOUT_S * 0.8 < time.monotonic() - answered < READ_TIMEOUT_S + 3
