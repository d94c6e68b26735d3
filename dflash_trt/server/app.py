"""The OpenAI-compatible HTTP API over one ``ServingLoop`` (FastAPI; served by uvicorn).

The loop is in this process, or in the serving process behind
``server.front.ServingClient`` (the same interface; ``dflash-trt serve``'s
default): nothing here differs but where the metrics come from.

| route | what |
| --- | --- |
| ``POST /v1/completions`` | one prompt (text or token ids) |
| ``POST /v1/chat/completions`` | messages through the chat template |
| ``GET /v1/models`` | the served model names (with ``speculate``, ``max_sessions``, ``max_model_len``) |
| ``GET /health`` | 200 while the serving loop runs, 503 otherwise (and while shutting down); ``speculate``: DFlash on, or plain decoding |
| ``GET /metrics`` | Prometheus text format (``server.prometheus``) |

A request's work before it is admitted is bounded: the body is at most
``--max-body-bytes`` (``server.limits``); it is parsed and validated (pydantic,
strict), the chat template rendered, a text longer than the context could hold
refused by its characters alone (``Tokenizer.max_chars``), tokenized, checked
to fit the context with max_tokens (vLLM's rule: 400 otherwise) and submitted.
A body of at most ``INLINE_BODY_BYTES`` (4 KiB: at most ~1 ms of work) is
prepared on the event loop, which costs less than a worker thread's hop; a
larger one in a worker thread (tokenizing with the GIL released), so one huge
or slow request never stalls /health or another stream. The serving loop's
acceptance is awaited on the event loop (``start_submit``'s Future: across the
pipe from a front, no thread waits for it).

``stream: true`` answers with server-sent events, one event per delivery of
the serving loop (a DFlash cycle's accepted tokens arrive together), then
``[DONE]``. A client that disconnects cancels its request, streamed or not:
the serving loop closes its session at the next gap between executes.

Errors have OpenAI's shape ``{"error": {message, type, param, code}}``, with
``param`` and ``code`` taken from the typed errors (``DFlashError.param`` /
``.code``), never from message text: 400 for malformed JSON, wrong types,
unknown fields, out-of-range values, a prompt or max_tokens that does not fit
the context; 404 for another model name or route; 413 for a body over the
limit; 429 when the serving loop's queue is full (nothing queued: retry); 503
while shutting down (``server.shutdown``) or once the serving loop is closed;
500 when the serving loop failed the request (a failed batch) or a bug — its
body says only that, with the request id; the log has the cause; 503 (code
``serving_process_died``) for the open requests when the serving process
dies. An error after a stream started is sent as a last ``{"error": ...}``
event. ``/metrics`` asks the serving loop in a worker thread (across the pipe
from the front), never on the event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import anyio
import pydantic
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.sse import EventSourceResponse, format_sse_event
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from dflash_trt.errors import DFlashError, InputError, QueueFullError, SamplingError, ServingClosedError, TokenizerError
from dflash_trt.runtime.serving.handle import CANCELLED, RequestHandle
from dflash_trt.server import schema, wire
from dflash_trt.server.limits import BodyLimit, BodyTooLarge, Limits
from dflash_trt.server.prometheus import ServingCollector
from dflash_trt.server.shutdown import InFlight, Shutdown

if TYPE_CHECKING:  # a front process serves a ServingClient and never imports the runtime (torch)
    from dflash_trt.runtime.serving.loop import ServingLoop

log = logging.getLogger("dflash_trt.server")

REQUEST_ERRORS = (InputError, SamplingError, TokenizerError)
API_PARAMS = {"max_new_tokens": "max_tokens"}  # the library's field names that the API spells otherwise
PREPARE_THREADS = 8  # worker threads parsing, tokenizing and submitting requests at once
# A body this small is prepared on the event loop (parsing and tokenizing 4 KiB of text: ~1 ms on the 2-core CPU
# box, ~0.2 ms for a typical 600-character prompt; a worker thread's hop costs ~0.1 ms of CPU and two wake-ups); a
# larger one in a worker thread (tokenizing with the GIL released), so no request stalls the loop long.
INLINE_BODY_BYTES = 4096
DEFAULT_LOG_INTERVAL_S = 10.0


class ApiError(Exception):
    """An OpenAI-style error response."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.body = status, schema.error_body(message, kind, param, code)


@dataclass(frozen=True)
class Route:
    """One generation route: its request type, id prefix and how its prompt is made."""

    model: type[schema.Sampled]
    prefix: str
    prompt_param: str  # the request field a prompt error names
    default_max_tokens: int | None  # when the request sets none (None: all the context left), capped by the context


COMPLETIONS = Route(schema.CompletionRequest, "cmpl", "prompt", 16)  # OpenAI's default for completions
CHAT = Route(schema.ChatRequest, "chatcmpl", "messages", None)


def create_app(serving: ServingLoop, names: str | list[str], limits: Limits | None = None, log_interval_s: float = DEFAULT_LOG_INTERVAL_S) -> FastAPI:
    """The API over ``serving``; ``names``: the model names clients may send (the first is the one reported);
    ``limits``: the HTTP layer's bounds (default ``Limits()``); a throughput log line every ``log_interval_s``."""
    names = [names] if isinstance(names, str) else list(names)
    limits = limits or Limits()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        logger = asyncio.create_task(_log_throughput(serving, log_interval_s)) if log_interval_s > 0 else None
        yield
        if logger is not None:
            logger.cancel()

    app = FastAPI(title="dflash-trt", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.serving, app.state.names = serving, names
    app.state.shutdown = Shutdown()
    app.state.limiter = anyio.CapacityLimiter(PREPARE_THREADS)
    app.state.registry = CollectorRegistry()
    app.state.registry.register(ServingCollector(serving, names[0]))
    app.add_middleware(BodyLimit, max_bytes=limits.max_body_bytes)
    app.add_middleware(InFlight, shutdown=app.state.shutdown)  # outermost: a request is open until its response is sent
    _add_error_handlers(app)
    _add_routes(app)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_request: Request, error: ApiError) -> JSONResponse:
        headers = {"Retry-After": "1"} if error.status == 429 else None
        return JSONResponse(error.body, status_code=error.status, headers=headers)

    @app.exception_handler(BodyTooLarge)
    async def too_large(_request: Request, error: BodyTooLarge) -> JSONResponse:  # close: the rest of the body is never read
        return JSONResponse(schema.error_body(str(error), code="request_too_large"), status_code=413, headers={"Connection": "close"})

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, error: RequestValidationError) -> JSONResponse:
        api = validation_error(error.errors())
        return JSONResponse(api.body, status_code=api.status)

    @app.exception_handler(HTTPException)
    async def http_error(_request: Request, error: HTTPException) -> JSONResponse:
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return JSONResponse(schema.error_body(str(error.detail), kind), status_code=error.status_code)

    @app.exception_handler(Exception)
    async def bug(request: Request, error: Exception) -> JSONResponse:
        log.error("unhandled error in %s %s", request.method, request.url.path, exc_info=error)
        return JSONResponse(schema.error_body("the server failed this request (a bug; see the server log)", "server_error"), status_code=500)


def validation_error(errors: list[dict]) -> ApiError:
    """A pydantic validation failure as OpenAI words it: the first error, naming the field."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    where = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(where) or None
    message = first.get("msg", "invalid request")
    if first.get("type") == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {param}"
    elif first.get("type") == "json_invalid":
        message = f"We could not parse the JSON body of your request: {first.get('ctx', {}).get('error', message)}"
        param = None
    elif where[:1] and where[0] in schema.UNION_FIELDS:  # pydantic names each alternative; say what is accepted
        param, message = where[0], schema.UNION_FIELDS[where[0]]
    elif param:
        message = f"{param}: {message} (got {first.get('input')!r:.80})"
    return ApiError(400, message, param=param)


def _add_routes(app: FastAPI) -> None:
    serving: ServingLoop = app.state.serving
    names: list[str] = app.state.names
    shutdown: Shutdown = app.state.shutdown

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = serving.healthy and not shutdown.draining
        status = "ok" if ok else "draining" if shutdown.draining else "unavailable"
        return JSONResponse({"status": status, "speculate": serving.executor.speculate}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        try:
            text = await anyio.to_thread.run_sync(generate_latest, app.state.registry, limiter=app.state.limiter)
        except ServingClosedError as error:
            raise ApiError(503, str(error), "server_error", code=error.code) from None
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        executor = serving.executor
        cards = [{"id": name, "object": "model", "created": 0, "owned_by": "dflash-trt", "root": names[0], "speculate": executor.speculate,
                  "max_sessions": executor.max_sessions, "max_model_len": executor.dims.max_context, "max_context": executor.dims.max_context}
                 for name in names]
        return {"object": "list", "data": cards}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(request, COMPLETIONS)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await _generate(request, CHAT)


async def _generate(request: Request, route: Route):
    """A generation request: read the body, prepare and submit it (on the event loop when the body is small,
    else in a worker thread), await the serving loop's acceptance, answer."""
    state = request.app.state
    if state.shutdown.draining:
        raise ApiError(503, "the server is shutting down: it accepts no new requests", "server_error", code="shutting_down")
    try:
        raw = await request.body()
    except ClientDisconnect:
        return Response(status_code=499)  # nobody is listening
    request_id = f"{route.prefix}-{uuid.uuid4().hex}"
    submitted: list[Future] = []
    prepare = partial(_prepare, state.serving, state.names, route, raw, submitted)
    body, answer = prepare() if len(raw) <= INLINE_BODY_BYTES else await _in_worker(state, prepare, submitted)
    handle = await _accepted(answer, route)
    model = body.model
    headers = {"X-Request-Id": request_id}
    if body.stream:
        events = _completion_events if route is COMPLETIONS else _chat_events
        return _stream(events(handle, request_id, model, body.include_usage, state.shutdown), headers, handle)
    result = await _result(handle, request, request_id, state.shutdown)
    usage = _usage(handle)
    if route is COMPLETIONS:
        return JSONResponse(schema.completion_object(request_id, model, result.text, result.finish, usage), headers=headers)
    return JSONResponse(schema.chat_object(request_id, model, result.text, result.finish, usage), headers=headers)


async def _in_worker(state, prepare: Callable, submitted: list[Future]) -> tuple[schema.Sampled, Future]:
    """``prepare()`` in a worker thread; when this task is cancelled meanwhile (the client left), the request
    the thread submitted (``submitted``) is withdrawn: nobody will read it."""
    try:
        return await anyio.to_thread.run_sync(prepare, limiter=state.limiter)
    except BaseException:
        for answer in submitted:
            _withdraw(answer)
        raise


async def _accepted(answer: Future, route: Route) -> RequestHandle:
    """The request's handle once the serving loop took it (at once in-process, a pipe's round trip from a
    front); its refusal as an ApiError. Cancelled (the client left) or unanswered, the request is withdrawn."""
    try:
        return await asyncio.wait_for(asyncio.wrap_future(answer), wire.ANSWER_TIMEOUT_S)  # read per call, as the front's
    except TimeoutError:
        _withdraw(answer)
        error = wire.unanswered()
        raise ApiError(503, str(error), "server_error", code=error.code) from None
    except BaseException as error:
        _withdraw(answer)
        if isinstance(error, DFlashError):
            raise _refusal(error, route) from None
        raise


def _withdraw(answer: Future) -> None:
    """A submitted request nobody will read: cancelled before the serving loop answers, or after."""
    if not answer.cancel() and answer.done() and not answer.cancelled() and answer.exception() is None:
        answer.result().cancel()


# ---------------------------------------------------------------------- preparing a request


def _prepare(serving: ServingLoop, names: list[str], route: Route, raw: bytes, submitted: list[Future]) -> tuple[schema.Sampled, Future]:
    """Parse, validate, render, tokenize, fit and submit one request (typed errors → ApiError); returns the
    request and the Future of its handle (``start_submit``: a front does not wait for the serving process
    here), which it also appends to ``submitted``."""
    try:
        body = route.model.model_validate_json(raw)
    except pydantic.ValidationError as error:
        raise validation_error(error.errors(include_url=False)) from None
    if body.model not in names:
        served = ", ".join(f"`{name}`" for name in names)
        raise ApiError(404, f"The model `{body.model}` does not exist (this server serves {served})", "not_found_error", "model", "model_not_found")
    try:
        text = body.prompt_value() if route is COMPLETIONS else _render_chat(serving, body)
        prompt = _tokenize(serving, text)
        max_tokens = _fit(serving, len(prompt), body.max_new_tokens, route)
        answer = serving.start_submit(prompt, max_tokens, **body.sampling())
    except DFlashError as error:
        raise _refusal(error, route) from None
    submitted.append(answer)
    return body, answer


def _refusal(error: DFlashError, route: Route) -> Exception:
    """A request's typed refusal as the API answers it (an error it does not expect stays itself: a 500)."""
    if isinstance(error, QueueFullError):
        return ApiError(429, str(error), "rate_limit_error", code="queue_full")
    if isinstance(error, ServingClosedError):
        return ApiError(503, str(error), "server_error", code=error.code or "shutting_down")  # or serving_process_died
    if isinstance(error, REQUEST_ERRORS):
        param = API_PARAMS.get(error.param, error.param)
        param = route.prompt_param if param == "prompt" else param
        return ApiError(400, str(error), param=param, code=error.code)
    return error


def _render_chat(serving: ServingLoop, body: schema.ChatRequest) -> str:
    if serving.tokenizer is None:
        raise TokenizerError("this server has no tokenizer: chat completions need one", param="messages")
    try:
        return serving.tokenizer.apply_chat([m.as_template_message() for m in body.messages])
    except TokenizerError as error:
        raise TokenizerError(f"{error} (start the server with --chat-template FILE)", param="messages") from error


def _tokenize(serving: ServingLoop, prompt: str | list[int]) -> list[int]:
    """Token ids of a text prompt, refused by its length alone when it cannot fit (no tokenizing)."""
    if not isinstance(prompt, str):
        return prompt
    if serving.tokenizer is None:
        raise TokenizerError("prompt is text but this server has no tokenizer: send token ids", param="prompt")
    room = serving.executor.dims.max_context - 1
    most = serving.tokenizer.max_chars(room)
    if most is not None and len(prompt) > most:
        msg = (f"This model's maximum context length is {room + 1} tokens; the prompt has {len(prompt)} characters, more than "
               f"{room} tokens can hold ({serving.tokenizer.chars_per_token} characters per token at most). Please reduce the prompt.")
        raise InputError(msg, param="prompt", code="context_length_exceeded")
    return serving.tokenizer.encode(prompt)


def _fit(serving: ServingLoop, prompt_tokens: int, max_tokens: int | None, route: Route) -> int:
    """max_tokens for this prompt: as asked (400 when prompt + max_tokens exceed the context, as vLLM
    does), or the route's default capped by the room left when the request set none."""
    limit = serving.executor.dims.max_context  # prompt + generated tokens (the batcher's CONTEXT finish)
    prompt_param = route.prompt_param
    if prompt_tokens >= limit:
        msg = f"This model's maximum context length is {limit} tokens. However, your prompt has {prompt_tokens} tokens. Please reduce the length of the {prompt_param}."
        raise InputError(msg, param="prompt", code="context_length_exceeded")
    if max_tokens is None:
        return min(route.default_max_tokens or limit, limit - prompt_tokens)
    if prompt_tokens + max_tokens > limit:
        msg = (f"This model's maximum context length is {limit} tokens. However, you requested {prompt_tokens + max_tokens} tokens "
               f"({prompt_tokens} in the {prompt_param}, {max_tokens} for the completion). Please reduce the length of the {prompt_param} or max_tokens.")
        raise InputError(msg, param="max_new_tokens", code="context_length_exceeded")
    return max_tokens


# ---------------------------------------------------------------------- answers


async def _result(handle: RequestHandle, request: Request, request_id: str, shutdown: Shutdown):
    """The whole completion; cancelled if its client disconnects first; 503 if the shutdown aborts it."""
    completion = asyncio.ensure_future(_completion(handle))
    disconnect = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((completion, disconnect, shutdown.aborted), return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnect.cancel()
        if not completion.done():
            completion.cancel()
            handle.cancel()  # its session is closed at the next gap between executes
    try:
        result = completion.result() if completion.done() and not completion.cancelled() else None
    except ServingClosedError as error:  # the serving process died under it
        raise ApiError(503, str(error), "server_error", code=error.code) from None
    except DFlashError as error:
        log.error("request %s failed in the serving loop", request_id, exc_info=error)
        raise ApiError(500, f"the server failed this request (request id {request_id}); see the server log", "server_error") from None
    if result is not None and result.finish != CANCELLED:
        return result
    if shutdown.aborted.done():  # the deadline passed (or the serving loop cancelled it for the shutdown)
        raise ApiError(503, "the server is shutting down: this request was aborted at the shutdown deadline", "server_error", code="shutting_down")
    raise ApiError(499, "the client closed the connection before the completion was ready", code="client_closed_request")


async def _completion(handle: RequestHandle):
    return await handle


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away (the body is already read: the next ASGI message is the disconnect)."""
    await _until_disconnect(request.receive)


def _usage(handle: RequestHandle) -> dict:
    return schema.usage(len(handle.prompt), len(handle.tokens))


class _Stream(EventSourceResponse):
    """SSE whose event generator is always closed and whose request is cancelled once it ends (a no-op
    for a finished request), whether the stream ended, the client went away, or sending failed: also
    when the response ended before its generator ever ran (its ``finally`` then never runs).

    The events are sent while a second task waits for the client's disconnect, as starlette's
    ``StreamingResponse`` does, but with two asyncio tasks instead of an anyio task group (whose cancel
    scopes and task handles cost a front ~5% of its CPU per request at one stream)."""

    def __init__(self, content: AsyncIterator[bytes], headers: dict, handle: RequestHandle) -> None:
        super().__init__(content, headers=headers)
        self.handle = handle

    async def __call__(self, scope, receive, send) -> None:
        streaming = asyncio.ensure_future(self.stream_response(send))
        watching = asyncio.ensure_future(_until_disconnect(receive))
        try:
            await asyncio.wait((streaming, watching), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (streaming, watching):
                task.cancel()
            # Before any await: a second cancellation of this task while it awaits below (a server that cancels
            # the response of a client that left, and again on its disconnect) would skip what follows it.
            self.handle.cancel()
            await asyncio.wait((streaming, watching))  # both ended before the generator is closed
            await self.body_iterator.aclose()
        if not streaming.cancelled() and streaming.exception() is not None:
            error = streaming.exception()
            raise ClientDisconnect() if isinstance(error, OSError) else error


async def _until_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _stream(events: AsyncIterator[dict], headers: dict, handle: RequestHandle) -> _Stream:
    async def encoded() -> AsyncIterator[bytes]:
        async with aclosing(events):
            async for event in events:
                yield format_sse_event(data_str=json.dumps(event))
        yield format_sse_event(data_str="[DONE]")

    return _Stream(encoded(), headers, handle)


async def _deltas(handle: RequestHandle, shutdown: Shutdown):
    """The handle's deltas until it finishes, or until the shutdown aborts it (then one last delta with
    finish ``cancelled``). Its consumer stopping early (a disconnect) cancels the request: ``_Stream``
    does, once the response ends."""
    finished = False
    async with aclosing(handle.deltas(until=shutdown.aborted)) as deltas:
        async for delta in deltas:
            finished = delta.finish is not None
            yield delta
    if not finished:  # the deltas stopped at the deadline
        yield _ABORTED


@dataclass(frozen=True)
class _Aborted:
    text: str = ""
    finish: str = CANCELLED


_ABORTED = _Aborted()


async def _events(handle: RequestHandle, request_id: str, shutdown: Shutdown, chunk: Callable, usage: Callable | None) -> AsyncIterator[dict]:
    """One chunk per delta, then the usage chunk when asked; a failure ends the stream with an error event."""
    try:
        async with aclosing(_deltas(handle, shutdown)) as deltas:
            async for delta in deltas:
                yield chunk(delta)
    except ServingClosedError as error:  # the serving process died under it: no traceback per stream
        yield schema.error_body(str(error), "server_error", code=error.code)
        return
    except DFlashError as error:
        log.error("request %s failed in the serving loop", request_id, exc_info=error)
        yield schema.error_body(f"the server failed this request (request id {request_id}); see the server log", "server_error")
        return
    if usage is not None:
        yield usage(_usage(handle))


def _completion_events(handle, request_id: str, model: str, include_usage: bool, shutdown: Shutdown) -> AsyncIterator[dict]:
    return _events(
        handle, request_id, shutdown,
        lambda delta: schema.completion_object(request_id, model, delta.text or "", delta.finish, None, chunk=True),
        partial(schema.usage_chunk, request_id, model, "text_completion") if include_usage else None,
    )


async def _chat_events(handle, request_id: str, model: str, include_usage: bool, shutdown: Shutdown) -> AsyncIterator[dict]:
    yield schema.chat_chunk(request_id, model, {"role": "assistant", "content": ""}, None)
    events = _events(
        handle, request_id, shutdown,
        lambda delta: schema.chat_chunk(request_id, model, {"content": delta.text or ""}, delta.finish),
        partial(schema.usage_chunk, request_id, model, "chat.completion.chunk") if include_usage else None,
    )
    async with aclosing(events):
        async for event in events:
            yield event


# ---------------------------------------------------------------------- logs


async def _log_throughput(serving: ServingLoop, interval_s: float) -> None:
    """Every ``interval_s``, while there is work or was some since the last line: throughput and load."""
    try:
        before, then = await anyio.to_thread.run_sync(serving.metrics), time.perf_counter()
    except ServingClosedError:
        return
    while True:
        await asyncio.sleep(interval_s)
        try:
            now_metrics, now = await anyio.to_thread.run_sync(serving.metrics), time.perf_counter()
        except ServingClosedError:  # stopped or died: /health and the log say so
            return
        seconds = now - then
        prompt = (now_metrics.prompt_tokens - before.prompt_tokens) / seconds
        output = (now_metrics.output_tokens - before.output_tokens) / seconds
        if prompt or output or now_metrics.running or now_metrics.queued:
            tau = f"{now_metrics.tau:.2f}" if now_metrics.tau is not None else "n/a"
            log.info("throughput: prompt %.1f tokens/s, generation %.1f tokens/s; running %d, queued %d requests; τ %s; "
                     "%d completed, %d cancelled, %d failed, %d rejected in all", prompt, output, now_metrics.running, now_metrics.queued,
                     tau, now_metrics.completed, now_metrics.cancelled, now_metrics.failed, now_metrics.rejected)
        before, then = now_metrics, now
