"""Bounds on what one client can make the server read: body size, time to send a request, connections.

Nothing a client sends is read without a bound, so no request (or half-sent
request) can hold memory, sockets or the event loop for long:

| bound | where | on breach |
| --- | --- | --- |
| ``max_body_bytes`` | ``BodyLimit`` (ASGI middleware) | 413 as soon as the declared Content-Length, or the bytes received so far, exceed it; nothing past the limit is kept, and the connection closes |
| ``read_timeout_s`` | ``server.protocols.ReadDeadline`` (both HTTP protocols) | the connection is closed when a whole request (head and body) has not arrived within it of connecting, or of the previous response |
| ``keep_alive_s`` | uvicorn's ``timeout_keep_alive`` | an idle keep-alive connection is closed |
| ``max_connections`` | uvicorn's ``limit_concurrency`` | 503 for requests beyond it (connections or requests at once) |
| ``max_header_bytes`` | h11's ``max_incomplete_event_size``, or ``server.protocols.TimedHttpToolsProtocol``'s count | 400 and close for a larger request head (h11: a head still incomplete) |

This module is the bounds themselves and the ASGI middleware, with no uvicorn
(``serve --help`` reads the defaults here without the serve extra); the
uvicorn protocols and config that apply them are ``server.protocols``.
FastAPI's own ``max_body_size`` answers a declared-too-large body in plain
text, replacing any response the app starts (so not in OpenAI's error format),
hence ``BodyLimit``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

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
