"""Above the executor: many prompts, stop tokens, max new tokens, continuous batching.

``stream(executor, requests)`` yields ``Chunk``s as tokens arrive. Up to
``max_sessions`` requests run at once; between execute() calls finished
sessions leave (closed) and queued requests join, so every call mixes new
prompts (target prefill + cycles) with running sessions' pending tokens
(the fast path: straight to draft → verify). Each input carries its
request's remaining room and stop tokens, so one call runs up to the
executor's ``max_cycles`` cycles per session, the device never waiting for
the host between them — or fewer when a queued request could take a session
(early join: the call ends after its round and the request joins at once).

``runtime.serving.batcher.Batcher`` is that loop's state, shared with the
serving loop (requests arriving from other threads); ``stream`` drives it over
a fixed list.

``collect(chunks, count)`` folds a stream into one ``Completion`` per
request; ``generate(executor, prompts, ...)`` is ``stream`` + ``collect``
(text too, when given a tokenizer).

"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Sequence

from dflash_trt.checks import is_int
from dflash_trt.errors import InputError, SamplingError
from dflash_trt.export.sampling import Sampling
from dflash_trt.runtime.executor import Executor
from dflash_trt.runtime.serving.batcher import Batcher, Chunk, Request, check_request
from dflash_trt.runtime.serving.handle import Completion
from dflash_trt.runtime.sessions import SEED_LIMIT


def stream(executor: Executor, requests: Iterable[Request], max_sessions: int | None = None) -> Iterator[Chunk]:
    """Serve ``requests`` with continuous batching; yields chunks in arrival order (``Chunk.index``: the request's).

    Sessions are closed when their request finishes, and all of this stream's
    sessions are closed if it stops early (an error, or the caller stops iterating).
    """
    if max_sessions is not None and (not is_int(max_sessions, numpy=True) or max_sessions < 1):
        raise InputError(f"max_sessions must be None (the executor's) or an int >= 1, got {max_sessions!r}")
    dims = executor.dims
    queue = deque((i, check_request(i, r, dims.max_context, dims.vocab_size)) for i, r in enumerate(requests))
    batcher = Batcher(executor, int(max_sessions) if max_sessions is not None else None)
    try:
        while queue or batcher.running:
            while queue and batcher.room:
                batcher.join(*queue.popleft())
            yield from _step(batcher, queue)
    finally:
        batcher.close()


def _step(batcher: Batcher, queue: deque) -> list[Chunk]:
    """One execute, ended after its round once queued requests could take sessions (free ones, or those of
    requests ended in it: early join, ``Batcher.should_yield``)."""
    return batcher.step(should_yield=lambda finished: batcher.should_yield(len(queue), finished))


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
    Every argument is checked before any session opens (typed errors naming it).
    """
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise InputError(f"prompts must be a list of prompts (token-id lists or strings), got {type(prompts).__name__}")
    if stop is None:
        stop = tokenizer.stop_ids if tokenizer is not None else ()
    if not is_int(seed, numpy=True) or not 0 <= int(seed) <= SEED_LIMIT - max(len(prompts), 1):
        raise SamplingError(f"seed must be an int in [0, 2**64 - len(prompts)] (request i uses seed + i), got {seed!r}")
    requests = [
        Request(_encode(i, prompt, tokenizer), max_new_tokens, stop, Sampling(temperature, top_k, top_p, int(seed) + i))
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
    return prompt  # token ids: checked with the rest of the request
