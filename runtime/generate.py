"""Above the executor: many prompts, stop tokens, max new tokens, continuous batching.

``stream(executor, requests)`` yields ``Chunk``s as tokens arrive. Up to
``max_sessions`` requests run at once; between execute() calls finished
sessions leave (closed) and queued requests join, so every call mixes new
prompts (target prefill + one cycle) with running sessions' pending tokens
(the fast path: straight to draft → verify).

``collect(chunks, count)`` folds a stream into one ``Completion`` per
request; ``generate(executor, prompts, ...)`` is ``stream`` + ``collect``
(text too, when given a tokenizer).

A request finishes at its first stop token (kept), at ``max_new_tokens``, or
when the context is full (its next token would sit at ``max_context``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from dflash_trt.checks import is_int
from dflash_trt.errors import InputError
from dflash_trt.runtime.executor import Executor
from dflash_trt.runtime.sessions import Input

STOP, LENGTH, CONTEXT = "stop", "length", "context"  # finish reasons


@dataclass(frozen=True)
class Request:
    """One prompt (token ids) with its limits and sampling (seed: the positional-uniform seed)."""

    prompt: Sequence[int]
    max_new_tokens: int = 64
    stop: tuple[int, ...] = ()
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0


@dataclass(frozen=True)
class Chunk:
    """New tokens of request ``index``; ``finish`` is set on its last chunk."""

    index: int
    tokens: list[int]
    finish: str | None = None


@dataclass
class Completion:
    tokens: list[int] = field(default_factory=list)
    finish: str | None = None
    text: str | None = None


@dataclass
class _Running:
    index: int
    request: Request
    session: int
    produced: int = 0


def check_request(index: int, request: Request, max_context: int, vocab_size: int) -> None:
    """Refuse a request that can never run (before any session opens)."""
    if not is_int(request.max_new_tokens) or request.max_new_tokens < 1:
        msg = f"request[{index}].max_new_tokens must be an int >= 1, got {request.max_new_tokens!r}"
        raise InputError(msg)
    if not 1 <= len(request.prompt) <= max_context - 1:
        msg = f"request[{index}].prompt must hold 1..{max_context - 1} tokens (max_context - 1), got {len(request.prompt)}"
        raise InputError(msg)
    bad = [t for t in request.prompt if not is_int(t, numpy=True) or not 0 <= t < vocab_size]
    if bad:
        msg = f"request[{index}].prompt tokens must be ids in [0, {vocab_size - 1}], got {bad[0]!r}"
        raise InputError(msg)


def stream(executor: Executor, requests: Iterable[Request], max_sessions: int | None = None) -> Iterator[Chunk]:
    """Serve ``requests`` with continuous batching; yields chunks in arrival order.

    Sessions are closed when their request finishes, and all of this stream's
    sessions are closed if it stops early (an error, or the caller stops iterating).
    """
    cap = min(max_sessions or executor.max_sessions, executor.max_sessions)
    queue = deque(enumerate(requests))
    for index, request in queue:
        check_request(index, request, executor.dims.max_context, executor.dims.vocab_size)
    running: list[_Running] = []
    try:
        while queue or running:
            joined = {r.session for r in _admit(executor, queue, running, cap)}
            batch = [_next_input(executor, r, r.session in joined) for r in running]
            outputs = executor.execute(batch)
            for r, tokens in zip(list(running), outputs):
                chunk = _advance(executor, r, tokens)
                if chunk.finish is not None:
                    executor.close_session(r.session)
                    running.remove(r)
                yield chunk
    finally:
        for r in running:
            executor.close_session(r.session)


def _next_input(executor: Executor, r: _Running, joined: bool) -> Input:
    """A new session's prompt, or a running session's pending token (the fast path)."""
    if joined:
        return Input(r.session, list(r.request.prompt))
    return Input(r.session, [executor.session(r.session).pending])


def _admit(executor: Executor, queue: deque, running: list[_Running], cap: int) -> list[_Running]:
    joined = []
    while queue and len(running) < cap:
        index, request = queue.popleft()
        session = executor.open_session()
        r = _Running(index, request, session)
        running.append(r)  # before set_sampling, so a refusal still closes it
        executor.set_sampling(session, request.temperature, request.top_k, request.top_p, request.seed)
        joined.append(r)
    return joined


def _advance(executor: Executor, r: _Running, tokens: list[int]) -> Chunk:
    """Truncate at the first stop token / max_new_tokens; say whether the request is done."""
    room = r.request.max_new_tokens - r.produced
    tokens = tokens[:room]
    for position, token in enumerate(tokens):
        if token in r.request.stop:
            r.produced += position + 1
            return Chunk(r.index, tokens[: position + 1], STOP)
    r.produced += len(tokens)
    if r.produced >= r.request.max_new_tokens:
        return Chunk(r.index, tokens, LENGTH)
    # The pending token sits AT the frontier; feeding it needs frontier + 1 <= max_context.
    if executor.session(r.session).frontier + 1 > executor.dims.max_context:
        return Chunk(r.index, tokens, CONTEXT)
    return Chunk(r.index, tokens)


def collect(chunks: Iterable[Chunk], count: int) -> list[Completion]:
    """Fold the chunks of ``count`` requests into one ``Completion`` each (tokens in order, last finish)."""
    completions = [Completion() for _ in range(count)]
    for chunk in chunks:
        completions[chunk.index].tokens += chunk.tokens
        completions[chunk.index].finish = chunk.finish
    return completions


def generate(
    executor: Executor,
    prompts: Sequence[Sequence[int] | str],
    tokenizer=None,
    max_new_tokens: int = 64,
    stop: Sequence[int] | None = None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    max_sessions: int | None = None,
) -> list[Completion]:
    """Complete every prompt (token ids, or text with ``tokenizer``); request i samples with seed + i.

    ``stop`` defaults to the tokenizer's stop ids (none without a tokenizer).
    """
    if stop is None:
        stop = tokenizer.stop_ids if tokenizer is not None else ()
    requests = [
        Request(_encode(i, prompt, tokenizer), max_new_tokens, tuple(stop), temperature, top_k, top_p, seed + i)
        for i, prompt in enumerate(prompts)
    ]
    completions = collect(stream(executor, requests, max_sessions), len(requests))
    if tokenizer is not None:
        for completion in completions:
            completion.text = tokenizer.decode(completion.tokens)
    return completions


def _encode(index: int, prompt, tokenizer) -> list[int]:
    if isinstance(prompt, str):
        if tokenizer is None:
            msg = f"prompt[{index}] is text but no tokenizer was given"
            raise InputError(msg)
        return tokenizer.encode(prompt)
    return list(prompt)
