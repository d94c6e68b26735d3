"""The HTTP protocols and uvicorn config that apply ``server.limits.Limits`` (the serve extra's uvicorn).

The server speaks HTTP/1.1 through h11 (pure Python, ``HTTP_PROTOCOL``), or
through httptools (llhttp, C) with ``serve --http httptools``: httptools costs
a front ~17% less CPU per request at 16 streams, but gained no throughput on a
GPU host, where the serving process is the limit, and its ITL p99 at 64
streams was higher (medians of four windows: 32.4 against 28.6 ms;
benchmarks/RESULTS.md, "The HTTP parser"), so h11 stays the default. uvicorn has no deadline for a request's
head (a connection that sends part of one, or nothing, stays open), hence
``ReadDeadline``: one timer per connection over either protocol. llhttp has no
bound on a request's head, hence ``TimedHttpToolsProtocol``'s count of it.
"""

from __future__ import annotations

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from dflash_trt.server.limits import Limits

try:
    import httptools
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # the serve extra without httptools: h11 serves
    httptools = None
    HttpToolsProtocol = object


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
