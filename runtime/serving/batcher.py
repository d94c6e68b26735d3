"""Continuous batching over one executor: requests, their chunks, and the ``Batcher`` that runs them.

``Batcher`` is the request layer's state for one executor: running requests,
one execute() per ``step``. ``runtime.generate.stream`` drives it over a
fixed list; the serving loop (``runtime.serving.loop``) over requests
arriving from other threads.

A request finishes at its first stop token (kept), at ``max_new_tokens``, or
when the context is full (its next token would sit at ``max_context``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass

from dflash_trt.checks import is_int
from dflash_trt.errors import DFlashError, InputError, SamplingError
from dflash_trt.export.sampling import GREEDY, Sampling
from dflash_trt.runtime.executor import Admission, Executor
from dflash_trt.runtime.sessions import Input, token_ids



ADMIT_TOKENS_PER_ROUND = 2048  # prompt tokens joining a running step per round at most (the first prompt always goes)
PREFILL_TOKENS_PER_STEP = 8192  # prompt tokens one step takes at most (the first prompt always goes)
JOIN_SHARE = 8  # early join: a step ends once 1 / JOIN_SHARE of its sessions' worth of queued requests can join
JOIN_WAIT_S = 0.02  # ... or once the oldest queued request (with a session for it) waited this long


@dataclass(frozen=True)
class Request:
    """One prompt (token ids) with its limits and its sampling (``export.sampling.Sampling``: greedy by default)."""

    prompt: Sequence[int]
    max_new_tokens: int = 64
    stop: tuple[int, ...] = ()
    sampling: Sampling = GREEDY


@dataclass(frozen=True)
class Chunk:
    """New tokens of request ``index`` (the key it joined with); ``finish`` is set on its last chunk;
    ``error``: why a request admitted into a running step could not run (it left; nothing ran)."""

    index: Hashable
    tokens: list[int]
    finish: str | None = None
    error: DFlashError | None = None


@dataclass
class _Running:
    key: Hashable
    request: Request
    session: int | None  # None while it joins a running step (the executor opens it: ``Batcher.step``'s admit)
    produced: int = 0
    joined: bool = True  # the next input is the prompt (then the pending token)
    pending: int | None = None  # the last token returned: the session's pending token, fed next


def check_request(index: int, request: Request, max_context: int, vocab_size: int) -> Request:
    """Refuse a request that can never run (before any session opens); returns it with plain values."""
    where = f"request[{index}]"
    if not isinstance(request, Request):
        raise InputError(f"{where} must be a Request, got {type(request).__name__}")
    max_new = request.max_new_tokens
    if not is_int(max_new, numpy=True) or max_new < 1:
        raise InputError(f"{where}.max_new_tokens must be an int >= 1 (not a bool), got {max_new!r}", param="max_new_tokens")
    prompt = _blamed("prompt", token_ids, f"{where}.prompt", request.prompt, vocab_size)
    if not 1 <= len(prompt) <= max_context - 1:
        msg = f"{where}.prompt must hold 1..{max_context - 1} tokens (max_context - 1), got {len(prompt)}"
        raise InputError(msg, param="prompt", code="context_length_exceeded" if prompt else "invalid_value")
    stop = _blamed("stop", token_ids, f"{where}.stop", request.stop, vocab_size)
    if not isinstance(request.sampling, Sampling):
        raise SamplingError(f"{where}.sampling must be a Sampling, got {type(request.sampling).__name__}", param="sampling")
    try:
        sampling = request.sampling.check(vocab_size)
    except SamplingError as error:
        raise SamplingError(f"{where}: {error}", param=error.param) from error
    return Request(prompt, int(max_new), tuple(stop), sampling)


def _blamed(param: str, check, *args):
    """``check(*args)``, its InputError naming ``param`` as the field at fault."""
    try:
        return check(*args)
    except InputError as error:
        error.param = param
        raise


class Batcher:
    """Continuous batching over one executor: the running requests, one execute() per ``step``.

    ``join`` opens a session for a request (its prompt is the next input),
    ``step`` runs one batch of every running request (prompts of the joined
    ones, pending tokens of the others: the fast path) and returns a chunk per
    request; finished requests leave inside ``step`` (session closed).
    ``leave`` closes a request's session early (cancelled, or poisoned by a
    failed step). Not thread-safe: one caller drives it.

    ``prefill_tokens`` caps the prompt tokens one step takes (at least one
    prompt): joined requests past it wait for the next step, so a burst of
    joining prompts costs the running requests a bounded prefill per step.
    Requests may also join a step while it runs (``step``'s ``admit``).
    """

    def __init__(self, executor: Executor, max_running: int | None = None, prefill_tokens: int = PREFILL_TOKENS_PER_STEP) -> None:
        self.executor = executor
        self.capacity = min(max_running or executor.max_sessions, executor.max_sessions)
        self.prefill_tokens = prefill_tokens
        self.running: dict[Hashable, _Running] = {}  # in join order

    @property
    def room(self) -> int:
        return self.capacity - len(self.running)

    def should_yield(self, waiting: int, finished: int, waited: float = 0.0) -> bool:
        """Early join: end the running step after its round for ``waiting`` queued requests? Yes when the
        gap could hand sessions (``room`` plus the ``finished`` requests') to at least one in JOIN_SHARE
        of the running requests' worth of them (at least one), or to one that has ``waited`` JOIN_WAIT_S
        seconds for this step (the serving loop: since the step started, or since the request came if
        later): a large batch is not cut for each request that arrives or finishes (at many sessions
        every execute would shrink to one round and pay the gap's host work per round, while the device
        waits), and a lone waiting request waits for it about one stream interval at most.

        >>> b = Batcher.__new__(Batcher); b.capacity, b.running = 64, dict.fromkeys(range(64))
        >>> [b.should_yield(3, f) for f in (1, 7, 8)], b.should_yield(8, 8), b.should_yield(0, 8), b.should_yield(1, 1, JOIN_WAIT_S)
        ([False, False, False], True, False, True)
        """
        joinable = min(waiting, self.room + finished)
        return joinable > 0 and (joinable >= -(-len(self.running) // JOIN_SHARE) or waited >= JOIN_WAIT_S)

    def join(self, key: Hashable, request: Request) -> None:
        session = self.executor.open_session()
        try:
            self.executor.set_sampling(session, request.sampling)
        except BaseException:
            self.executor.close_session(session)
            raise
        self.running[key] = _Running(key, request, session)

    def leave(self, key: Hashable) -> None:
        session = self.running.pop(key).session
        if session is not None:  # None: admitted into a step that failed (the executor closed what it opened)
            self.executor.close_session(session)

    def close(self) -> None:
        for key in list(self.running):
            self.leave(key)

    def step(
        self, keys: Iterable[Hashable] | None = None, on_chunk: Callable[[Hashable, list[int], str | None], None] | None = None,
        should_yield: Callable[[int], bool] | None = None, admit: Callable[[int], Sequence[tuple[Hashable, Request]]] | None = None,
        stream_interval: float = 0.0, on_streamed: Callable[[], None] | None = None,
    ) -> list[Chunk]:
        """One execute() over every running request (or only ``keys``: the others wait, their pending
        tokens kept); returns a chunk per request; raises what execute raised (sessions left as they are).
        ``should_yield``: ``Executor.execute_outputs``' (end the execute early for a waiting request).

        ``on_chunk(key, tokens, finish)`` receives a chunk's fields while the execute runs (``Executor.execute_outputs``'
        on_tokens, per lane per launch, or per tick with ``stream_interval``: no ``Chunk`` is built for it;
        ``finish`` is set when the tokens end the request); the returned chunk of a request then holds only its
        tokens not streamed yet. ``on_streamed``: ``Executor.execute_outputs``' (after each burst of chunks).

        ``admit(limit)``, asked while the execute runs (``Executor.execute_outputs``' admit, while sessions
        are free), returns up to ``limit`` (``room``) (key, request) pairs joining it: the executor opens their
        sessions, they decode from its next round and get their chunks with the others (a refused one:
        its ``error``; it left).
        """
        running = self._admitted() if keys is None else [self.running[key] for key in keys]
        streamed = [0] * len(running)

        def stream(index: int, tokens: list[int], finish: str | None) -> None:
            streamed[index] += len(tokens)
            on_chunk(running[index].key, tokens, finish)

        def admitting() -> list[Admission]:
            admissions = []
            for key, request in admit(self.room) if self.room else ():
                running.append(r := _Running(key, request, None, joined=False))
                self.running[key] = r
                streamed.append(0)
                admissions.append(Admission(list(request.prompt), request.max_new_tokens, request.stop, request.sampling))
            return admissions

        batch = [self._next_input(r) for r in running]
        outputs = self.executor.execute_outputs(
            batch, stream if on_chunk else None, should_yield, admitting if admit is not None else None, stream_interval,
            on_streamed if on_chunk else None,
        )
        chunks = []
        for r, output, sent in zip(running, outputs, streamed):
            r.session = output.session if r.session is None else r.session  # an admitted request's, opened by the executor
            r.produced += len(output.tokens)
            r.pending = output.tokens[-1] if output.tokens else r.pending
            if output.finish is not None or output.error is not None:
                self.leave(r.key)
            chunks.append(Chunk(r.key, output.tokens[sent:], output.finish, output.error))
        return chunks

    def _admitted(self) -> list[_Running]:
        """Every running request, but joined prompts only while their tokens fit ``prefill_tokens``."""
        admitted, budget = [], self.prefill_tokens
        for r in self.running.values():
            if r.joined:
                if budget < len(r.request.prompt) and budget < self.prefill_tokens:
                    continue  # the next step takes it
                budget -= len(r.request.prompt)
            admitted.append(r)
        return admitted

    def _next_input(self, r: _Running) -> Input:
        """A new session's prompt, or a running session's pending token (the fast path).

        With the request's remaining room and stop tokens, so the executor may run
        several cycles in one call and cut its output where the request ends.
        """
        room, stop = r.request.max_new_tokens - r.produced, r.request.stop
        if r.joined:
            r.joined = False
            return Input(r.session, list(r.request.prompt), max_new_tokens=room, stop=stop)
        return Input(r.session, [r.pending], max_new_tokens=room, stop=stop)
