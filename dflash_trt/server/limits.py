"""Bounds on what one client can make the server read: body size, time to send a request, connections.

Nothing a client sends is read without a bound, so no request (or half-sent
request) can hold memory, sockets or the event loop for long:

| bound | where | on breach |
| --- | --- | --- |
| ``max_body_bytes`` | ``BodyLimit`` (ASGI middleware) | 413 as soon as the declared Content-Length, or the bytes received so far, exceed it; nothing past the limit is kept, and the connection closes |
| ``read_timeout_s`` | ``ReadDeadline`` (both protocols below) | the connection is closed when a whole request (head and body) has not arrived within it of connecting, or of the previous response |
| ``keep_alive_s`` | uvicorn's ``timeout_keep_alive`` | an idle keep-alive connection is closed |
| ``max_connections`` | uvicorn's ``limit_concurrency`` | 503 for requests beyond it (connections or requests at once) |
| ``max_header_bytes`` | h11's ``max_incomplete_event_size``, or ``TimedHttpToolsProtocol``'s count | 400 and close for a larger request head (h11: a head still incomplete) |

The server speaks HTTP/1.1 through h11 (pure Python, ``HTTP_PROTOCOL``), or
through httptools (llhttp, C) with ``serve --http httptools``: httptools costs
a front ~17% less CPU per request at 16 streams, but gained no throughput on a
GPU host, where the serving process is the limit, and its ITL p99 at 64
streams was the higher in every window (benchmarks/RESULTS.md, "The HTTP
parser"), so h11 stays the default. uvicorn has no deadline for a request's
head (a connection that sends part of one, or nothing, stays open), hence
``ReadDeadline``: one timer per connection over either protocol. llhttp has no
bound on a request's head, hence ``TimedHttpToolsProtocol``'s count of it.
FastAPI's own ``max_body_size`` answers a declared-too-large body in plain
text, replacing any response the app starts (so not in OpenAI's error format),
hence ``BodyLimit``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

try:
    import httptools
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # the serve extra without httptools: h11 serves
    httptools = None
    HttpToolsProtocol = object

MiB = 1 << 20


BODY_BYTES_PER_TOKEN = 64  # a context's worth of prompt as JSON: text (~4 characters a token, escapes) or ids
MIN_BODY_BYTES = MiB


def default_body_bytes(max_context: int) -> int:
    """The body limit for a model of ``max_context`` tokens: 64 bytes a token, at least 1 MiB (a whole
    context of text or token ids fits with room to spare; 8 MiB at 128k tokens)."""
    return max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * max_context)


@dataclass(frozen=True)
class Limits:
    """Every bound of the HTTP layer (``dflash-trt serve`` flags)."""

    max_body_bytes: int = MIN_BODY_BYTES
    read_timeout_s: float = 30.0
    keep_alive_s: float = 5.0
    max_connections: int = 512
    max_header_bytes: int = 16 * 1024


class BodyTooLarge(Exception):
    """Raised from ``receive`` when the body passes the limit; the app's handler answers 413."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the request body is larger than {limit} bytes (--max-body-bytes)")


class BodyLimit:
    """ASGI middleware: a body over ``max_bytes`` gets 413, its bytes counted as they stream in.

    A declared ``Content-Length`` over the limit is answered before any of the
    body is read; otherwise ``receive`` raises ``BodyTooLarge`` on the chunk
    that passes the limit. Either answer says ``Connection: close``, so the
    rest of the body is never read; at most ``max_bytes`` plus one chunk is
    ever held.
    """

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await _send_413(send, str(BodyTooLarge(self.max_bytes)))
            return
        received = 0

        async def counted():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, counted, send)


async def _send_413(send, message: str) -> None:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None, "code": "request_too_large"}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), (b"connection", b"close")]
    await send({"type": "http.response.start", "status": 413, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class ReadDeadline:
    """A read deadline for a uvicorn HTTP protocol (mixed in before it): a request must arrive whole (head
    and body) within ``config.read_timeout_s`` of the connection opening or of the previous response, or
    the connection is closed. A request being answered (a stream, however long) is never cut by it."""

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._read_deadline = None
        self._arm_read_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_read_deadline()

    def connection_lost(self, exc) -> None:
        self._disarm_read_deadline()
        super().connection_lost(exc)

    def _arm_read_deadline(self) -> None:
        self._disarm_read_deadline()
        self._read_deadline = self.loop.call_later(self.config.read_timeout_s, self._read_deadline_passed)

    def _disarm_read_deadline(self) -> None:
        if getattr(self, "_read_deadline", None) is not None:
            self._read_deadline.cancel()
            self._read_deadline = None

    def _read_deadline_passed(self) -> None:
        self._read_deadline = None
        if self._reading_a_request() and not self.transport.is_closing():
            self.logger.info("closing a connection that did not send a whole request within %.1f s (--read-timeout)", self.config.read_timeout_s)
            self.transport.close()

    def _reading_a_request(self) -> bool:
        """No request, or part of one, has arrived since the deadline was armed."""
        raise NotImplementedError


class TimedH11Protocol(ReadDeadline, H11Protocol):
    """uvicorn's h11 protocol with ``ReadDeadline`` (h11 bounds the head: ``max_incomplete_event_size``)."""

    def _reading_a_request(self) -> bool:
        return self.conn.their_state in (h11.IDLE, h11.SEND_BODY)


class HeadTooLarge(Exception if httptools is None else httptools.HttpParserError):
    """Raised from the parser's callbacks (a parser error: uvicorn answers 400 and closes)."""


class TimedHttpToolsProtocol(ReadDeadline, HttpToolsProtocol):
    """uvicorn's httptools protocol with ``ReadDeadline`` and a bound on the request head
    (``config.max_header_bytes``): the request line and headers as parsed, and every byte fed while a
    head is still incomplete (llhttp holds a header until it ends), so at most the bound plus one read
    is ever held for a head."""

    def connection_made(self, transport) -> None:
        self._head_open, self._head_fed, self._head_parsed = False, 0, 0
        super().connection_made(transport)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._head_open and not self.transport.is_closing():  # this read ended inside a head
            self._head_fed += len(data)  # (counts a pipelined body's tail that began the read: one read at most)
            if self._head_fed > self.config.max_header_bytes:
                self._refuse_head()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_open, self._head_fed, self._head_parsed = True, 0, 0

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        self._count_head(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        super().on_header(name, value)
        self._count_head(len(name) + len(value) + 4)  # "name: value\r\n"

    def on_headers_complete(self) -> None:
        self._head_open = False
        super().on_headers_complete()

    def _count_head(self, size: int) -> None:
        self._head_parsed += size
        if self._head_parsed > self.config.max_header_bytes:
            raise HeadTooLarge(f"the request head is larger than {self.config.max_header_bytes} bytes")

    def _reading_a_request(self) -> bool:
        cycle = self.cycle  # the last request whose head arrived
        return cycle is None or cycle.response_complete or cycle.more_body

    def _refuse_head(self) -> None:
        self.logger.warning("Invalid HTTP request received.")
        self.send_400_response("Invalid HTTP request received.")


HTTP_PROTOCOL = TimedH11Protocol


def http_protocol(parser: str = "h11") -> type:
    """The protocol class of ``serve --http``: ``h11`` (``HTTP_PROTOCOL``) or ``httptools``."""
    protocols = {"h11": TimedH11Protocol, "httptools": TimedHttpToolsProtocol}
    if parser not in protocols or (parser == "httptools" and httptools is None):
        raise ValueError(f"the HTTP parser must be one of {sorted(protocols)} (httptools installed: {httptools is not None}), got {parser!r}")
    return protocols[parser]


class ServeConfig(uvicorn.Config):
    """uvicorn's config with the ``Limits`` applied (``read_timeout_s`` and ``max_header_bytes`` for the
    protocols above); ``http``: the protocol class (default ``HTTP_PROTOCOL``)."""

    def __init__(self, app, limits: Limits, http: type = HTTP_PROTOCOL, **options) -> None:
        super().__init__(
            app,
            http=http,
            timeout_keep_alive=limits.keep_alive_s,
            limit_concurrency=limits.max_connections,
            h11_max_incomplete_event_size=limits.max_header_bytes,
            **options,
        )
        self.read_timeout_s = limits.read_timeout_s
        self.max_header_bytes = limits.max_header_bytes
