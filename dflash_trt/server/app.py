"""The OpenAI-compatible HTTP API over one ``ServingLoop`` (FastAPI; served by uvicorn).

| route | what |
| --- | --- |
| ``POST /v1/completions`` | one prompt (text or token ids) |
| ``POST /v1/chat/completions`` | messages through the chat template |
| ``GET /v1/models`` | the one served model (with ``speculate``, ``max_sessions``, ``max_context``) |
| ``GET /health`` | 200 while the serving loop runs, 503 otherwise; ``speculate``: DFlash on, or plain decoding |
| ``GET /metrics`` | Prometheus text format (``server.prometheus``) |

``stream: true`` answers with server-sent events (FastAPI's encoder), one
event per delivery of the serving loop (a DFlash cycle's accepted tokens arrive
together), then ``[DONE]``. A client that disconnects cancels its request,
streamed or not: the serving loop closes its session at the next gap between executes.

Errors have OpenAI's shape ``{"error": {message, type, param, code}}``:
400 for malformed JSON, unknown fields, out-of-range values, a prompt that
does not fit the context; 404 for another model name or route; 429 when the
serving loop's queue is full (nothing queued: retry); 503 once the serving loop is
closed; 500 when the serving loop failed the request (a failed batch). An error
after a stream started is sent as a last ``{"error": ...}`` event.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.sse import EventSourceResponse, format_sse_event
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException

from dflash_trt.errors import DFlashError, ServingClosedError, InputError, QueueFullError, SamplingError, TokenizerError
from dflash_trt.runtime.serving.loop import ServingLoop, RequestHandle
from dflash_trt.server import schema
from dflash_trt.server.prometheus import ServingCollector

REQUEST_ERRORS = (InputError, SamplingError, TokenizerError)


class ApiError(Exception):
    """An OpenAI-style error response."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.body = status, schema.error_body(message, kind, param, code)


def create_app(serving: ServingLoop, model: str) -> FastAPI:
    """The API over ``serving`` serving ``model`` (the name clients must send)."""
    app = FastAPI(title="dflash-trt", docs_url=None, redoc_url=None)
    app.state.serving, app.state.model = serving, model
    app.state.registry = CollectorRegistry()
    app.state.registry.register(ServingCollector(serving, model))
    _add_error_handlers(app)
    _add_routes(app)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_request: Request, error: ApiError) -> JSONResponse:
        headers = {"Retry-After": "1"} if error.status == 429 else None
        return JSONResponse(error.body, status_code=error.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0] if error.errors() else {"loc": (), "msg": str(error)}
        where = [str(part) for part in first.get("loc", ()) if part != "body"]
        param = ".".join(where) or None
        message = first.get("msg", "invalid request")
        if first.get("type") == "extra_forbidden":
            message = f"Unrecognized request argument supplied: {param}"
        elif first.get("type") == "json_invalid":
            message = f"We could not parse the JSON body of your request: {first.get('ctx', {}).get('error', message)}"
            param = None
        elif where[:1] == ["prompt"]:  # a union: pydantic names each alternative; say what is accepted
            param, message = "prompt", "prompt must be one string or one list of token ids (one prompt per request)"
        elif param:
            message = f"{param}: {message} (got {first.get('input')!r:.80})"
        return JSONResponse(schema.error_body(message, param=param), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(_request: Request, error: HTTPException) -> JSONResponse:
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return JSONResponse(schema.error_body(str(error.detail), kind), status_code=error.status_code)


def _add_routes(app: FastAPI) -> None:
    serving: ServingLoop = app.state.serving
    model: str = app.state.model

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = serving.healthy
        body = {"status": "ok" if ok else "unavailable", "speculate": serving.executor.speculate}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(app.state.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        served = {"id": model, "object": "model", "created": 0, "owned_by": "dflash-trt", "speculate": serving.executor.speculate,
                  "max_sessions": serving.executor.max_sessions, "max_context": serving.executor.dims.max_context}
        return {"object": "list", "data": [served]}

    @app.post("/v1/completions")
    async def completions(body: schema.CompletionRequest, request: Request):
        _check_model(body.model, model)
        handle = _submit(serving, body.prompt_value(), body.max_tokens or 16, body.sampling())
        request_id = f"cmpl-{handle.id}"
        if body.stream:
            return _stream(_completion_events(handle, request_id, model, body.include_usage))
        result = await _result(handle, request)
        return schema.completion_object(request_id, model, result.text, result.finish, _usage(handle))

    @app.post("/v1/chat/completions")
    async def chat(body: schema.ChatRequest, request: Request):
        _check_model(body.model, model)
        prompt = _render_chat(serving, body)
        handle = _submit(serving, prompt, body.limit or serving.executor.dims.max_context, body.sampling())
        request_id = f"chatcmpl-{handle.id}"
        if body.stream:
            return _stream(_chat_events(handle, request_id, model, body.include_usage))
        result = await _result(handle, request)
        return schema.chat_object(request_id, model, result.text, result.finish, _usage(handle))


def _check_model(asked: str, served: str) -> None:
    if asked != served:
        raise ApiError(404, f"The model `{asked}` does not exist (this server serves `{served}`)", "not_found_error", "model", "model_not_found")


def _render_chat(serving: ServingLoop, body: schema.ChatRequest) -> str:
    if serving.tokenizer is None:
        raise ApiError(400, "this server has no tokenizer: chat completions need one", param="messages")
    try:
        return serving.tokenizer.apply_chat([m.as_template_message() for m in body.messages])
    except TokenizerError as error:
        raise ApiError(400, f"{error} (start the server with --chat-template FILE)", param="messages") from error


def _submit(serving: ServingLoop, prompt, max_tokens: int, sampling: dict) -> RequestHandle:
    """``ServingLoop.submit`` with its typed refusals as HTTP errors."""
    try:
        return serving.submit(prompt, max_tokens, **sampling)
    except QueueFullError as error:
        raise ApiError(429, str(error), "rate_limit_error", code="queue_full") from error
    except ServingClosedError as error:
        raise ApiError(503, str(error), "server_error", code="shutting_down") from error
    except REQUEST_ERRORS as error:
        code = "context_length_exceeded" if "prompt must hold" in str(error) else None
        raise ApiError(400, str(error), param=_param_of(str(error)), code=code) from error


def _param_of(message: str) -> str | None:
    for name in ("temperature", "top_k", "top_p", "seed", "stop", "prompt", "max_new_tokens"):
        if name in message:
            return "max_tokens" if name == "max_new_tokens" else name
    return None


async def _result(handle: RequestHandle, request: Request):
    """The whole completion; the request is cancelled if its client disconnects first (or the handler is)."""
    completion = asyncio.ensure_future(_completion(handle))
    disconnect = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((completion, disconnect), return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnect.cancel()
        if not completion.done():
            completion.cancel()
            handle.cancel()  # its session is closed at the next gap between executes
    if completion.cancelled():
        raise ApiError(499, "the client closed the connection before the completion was ready", code="client_closed_request")
    try:
        return completion.result()
    except DFlashError as error:
        raise ApiError(500, f"the serving loop failed this request: {type(error).__name__}: {error}", "server_error") from error


async def _completion(handle: RequestHandle):
    return await handle


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away (the body is already read: the next ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _usage(handle: RequestHandle) -> dict:
    return schema.usage(len(handle.prompt), len(handle.tokens))


class _Stream(EventSourceResponse):
    """SSE whose event generator is always closed (so its ``finally`` cancels the request),
    whether the stream ended, the client went away, or sending failed."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def _stream(events: AsyncIterator[dict]) -> _Stream:
    async def encoded() -> AsyncIterator[bytes]:
        async with aclosing(events):
            async for event in events:
                yield format_sse_event(data_str=json.dumps(event))
        yield format_sse_event(data_str="[DONE]")

    return _Stream(encoded())


async def _deltas(handle: RequestHandle):
    """The handle's deltas; the request is cancelled if the consumer stops early (disconnect)."""
    try:
        async with aclosing(handle.__aiter__()) as deltas:
            async for delta in deltas:
                yield delta
    finally:
        handle.cancel()  # a no-op once finished


async def _completion_events(handle: RequestHandle, request_id: str, model: str, include_usage: bool) -> AsyncIterator[dict]:
    try:
        async with aclosing(_deltas(handle)) as deltas:
            async for delta in deltas:
                yield schema.completion_object(request_id, model, delta.text or "", delta.finish, None, chunk=True)
    except DFlashError as error:
        yield schema.error_body(f"the serving loop failed this request: {type(error).__name__}: {error}", "server_error")
        return
    if include_usage:
        yield schema.usage_chunk(request_id, model, "text_completion", _usage(handle))


async def _chat_events(handle: RequestHandle, request_id: str, model: str, include_usage: bool) -> AsyncIterator[dict]:
    yield schema.chat_chunk(request_id, model, {"role": "assistant", "content": ""}, None)
    try:
        async with aclosing(_deltas(handle)) as deltas:
            async for delta in deltas:
                yield schema.chat_chunk(request_id, model, {"content": delta.text or ""}, delta.finish)
    except DFlashError as error:
        yield schema.error_body(f"the serving loop failed this request: {type(error).__name__}: {error}", "server_error")
        return
    if include_usage:
        yield schema.usage_chunk(request_id, model, "chat.completion.chunk", _usage(handle))
