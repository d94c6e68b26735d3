"""The messages between the HTTP front and the serving process (``dflash-trt serve``'s default).

The front (uvicorn, parsing, chat template, tokenizing, detokenizing, SSE:
``server.front``) and the serving process (the executor and its ``ServingLoop``:
``server.serving_process``) share one duplex ``multiprocessing`` pipe; every message is
one of the frozen dataclasses below, pickled by the pipe.

    front ──> serving process                   serving process ──> front
    -------------------------                   -------------------------
    Submit(key, prompt ids, max, sampling)      Ready(what the front needs to know) | LoadFailed(WireError), once
    Cancel(key, finish)                         Refused(key, WireError)   (a Submit not taken)
    Close(drain)      (SIGTERM: drain/cancel)   Deliveries(items, failures, accepted): the Submits taken and
    MetricsQuery(seq)                                 every request's new tokens of one delivery round (or
    Exit()            (then it exits)                 more), in one message
                                                MetricsReply(seq, ServingMetrics)

Every Submit is answered once: ``Refused`` at once, or its key in a ``Deliveries``' ``accepted``
(the front reads those before the message's items: a request's tokens may come in the message
that accepts it, or, when the serving loop is quick, in the one before).

``key`` is the front's id of a request (the serving loop keeps its own handle ids).
A request's tokens travel as ids; the front detokenizes them (stop strings
are the front's: it ends the request and sends ``Cancel(key, "stop")``).
Errors travel as ``WireError`` (the typed error's class name, message,
``param``, ``code``) and are rebuilt as the same ``dflash_trt.errors`` class,
so the HTTP layer answers exactly as it does over an in-process loop.
A closed pipe (EOF) is the other process's death.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_trt import errors
from dflash_trt.errors import DFlashError
from dflash_trt.export.sampling_params import Sampling

ANSWER_TIMEOUT_S = 30.0  # a submit's or a metrics query's answer; beyond, the serving process is taken as hung
DIED = "serving_process_died"  # the code of ServingClosedError when the serving process died or stopped answering


def unanswered() -> errors.ServingClosedError:
    """The error of a submit or metrics query the serving process did not answer within ``ANSWER_TIMEOUT_S``."""
    return errors.ServingClosedError(f"the serving process did not answer within {ANSWER_TIMEOUT_S:g} s", code=DIED)


# A delivery item: (key, new token ids, finish or None). Tuples, not objects: a round of 64 requests is
# one small pickle.
Item = tuple[int, list[int], str | None]


@dataclass(frozen=True)
class WireError:
    """A typed error across the pipe: the ``dflash_trt.errors`` class by name, and its fields."""

    kind: str
    message: str
    param: str | None = None
    code: str | None = None

    @classmethod
    def of(cls, error: BaseException) -> WireError:
        kind = type(error).__name__ if isinstance(error, DFlashError) else "DFlashError"
        message = str(error) if isinstance(error, DFlashError) else f"{type(error).__name__}: {error}"
        return cls(kind, message, getattr(error, "param", None), getattr(error, "code", None))

    def error(self) -> DFlashError:
        """The same error class (``DFlashError`` for a name this package does not define as one)."""
        kind = getattr(errors, self.kind, None)
        kind = kind if isinstance(kind, type) and issubclass(kind, DFlashError) else DFlashError
        try:
            error = kind(self.message)
        except TypeError:  # a class whose constructor needs more than a message
            error = DFlashError(self.message)
        error.param, error.code = self.param, self.code
        return error


# ---------------------------------------------------------------------- front -> serving process


@dataclass(frozen=True)
class Submit:
    key: int
    prompt: list[int]
    max_new_tokens: int
    sampling: Sampling
    stop_ids: tuple[int, ...] | None = None  # None: the serving loop's default stop tokens


@dataclass(frozen=True)
class Cancel:
    key: int
    finish: str  # "cancelled", or "stop" when the front found a stop string (counted as completed)


@dataclass(frozen=True)
class Close:
    drain: bool  # True: refuse new requests, finish the accepted ones; False: cancel them too


@dataclass(frozen=True)
class MetricsQuery:
    seq: int


@dataclass(frozen=True)
class Exit:
    """Cancel what is left, free the backend, exit 0."""


# ---------------------------------------------------------------------- serving process -> front


@dataclass(frozen=True)
class Ready:
    """Sent once the serving process loaded: what the HTTP layer reads about it."""

    speculate: bool
    max_sessions: int
    max_context: int
    vocab_size: int
    artifacts: str | None  # the artifacts dir loaded (the default pair's export: the front reads its tokenizer there)
    pid: int


@dataclass(frozen=True)
class LoadFailed:
    """Sent instead of ``Ready`` when loading failed (then the process exits 1)."""

    error: WireError


@dataclass(frozen=True)
class Refused:
    key: int
    error: WireError


@dataclass(frozen=True)
class Deliveries:
    """New tokens of every request that got some since the last message (finish set on a request's last
    item), the requests that failed (each fails with its error), and the keys of the Submits taken since
    the last message (their answer: one send per message, not one per request)."""

    items: tuple[Item, ...]
    failures: tuple[tuple[int, WireError], ...] = ()
    accepted: tuple[int, ...] = ()


@dataclass(frozen=True)
class MetricsReply:
    seq: int
    metrics: object  # runtime.serving.metrics.ServingMetrics
