"""OpenAI request bodies (validated with pydantic) and the response objects we build.

Requests refuse unknown fields (OpenAI answers "Unrecognized request
argument" too) and out-of-range values, so a client learns at once that a
parameter is not honoured instead of getting silently different output.
Types are strict, as OpenAI's are: ``max_tokens: "4"`` or ``true``,
``temperature: true``, ``stream: "yes"`` are refused (an int is accepted
where a number is).
Accepted beside the sampling fields: ``n`` (1 only), ``stream_options``
(``include_usage``), ``user`` (ignored), and the neutral values of
parameters some clients always send (``presence_penalty`` /
``frequency_penalty`` 0, ``logprobs`` off, ``echo`` false, ``best_of`` 1,
empty ``logit_bias``). ``top_k`` is an extension (0 = off).

Finish reasons: ``stop`` (stop token or stop string), ``length``
(max_tokens, or the context is full), ``abort`` (cancelled by a shutdown).
"""

from __future__ import annotations

import secrets
import time
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from dflash_trt.export.sampling_params import Sampling
from dflash_trt.runtime.finish import CANCELLED, CONTEXT, LENGTH, STOP

MAX_STOPS = 4  # OpenAI's limit on stop sequences
SEED_MAX = (1 << 64) - 1

FINISH = {STOP: "stop", LENGTH: "length", CONTEXT: "length", CANCELLED: "abort"}

Zero = Annotated[float, Field(ge=0, le=0, description="only 0 (not supported)")]


STRICT = ConfigDict(extra="forbid", strict=True)
# Union fields: pydantic reports a failure per alternative; these say what is accepted instead.
UNION_FIELDS = {
    "prompt": "prompt must be one string or one list of token ids (one prompt per request)",
    "stop": f"stop must be a string or a list of at most {MAX_STOPS} strings",
}


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class Sampled(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = STRICT

    model: str
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None  # OpenAI's default: 1
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    n: Literal[1] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOPS)] | None = None
    seed: Annotated[int, Field(ge=0, le=SEED_MAX)] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None  # OpenAI's default for completions: 16
    user: str | None = None
    presence_penalty: Zero | None = None
    frequency_penalty: Zero | None = None
    logit_bias: Annotated[dict[str, float], Field(max_length=0)] | None = None

    def sampling(self) -> dict:
        """Keyword arguments of ``ServingLoop.submit``: one ``Sampling`` value and the stop strings (OpenAI's
        defaults for what was left out; no seed: a random one)."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        temperature = 1.0 if self.temperature is None else self.temperature
        seed = secrets.randbits(63) if self.seed is None else self.seed
        return dict(sampling=Sampling(temperature, self.top_k or 0, self.top_p or 1.0, seed), stop=stops)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def max_new_tokens(self) -> int | None:
        """The tokens asked for (None: not set; the route's default applies)."""
        return self.max_tokens


class CompletionRequest(Sampled):
    """POST /v1/completions: one prompt (text, or token ids; a list of one is accepted)."""

    prompt: str | list[int] | Annotated[list[str], Field(min_length=1, max_length=1)] | Annotated[list[list[int]], Field(min_length=1, max_length=1)]
    echo: Literal[False] | None = None
    logprobs: None = None
    best_of: Literal[1] | None = None
    suffix: None = None

    def prompt_value(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            return prompt[0]
        return prompt


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def as_template_message(self) -> dict:
        content = self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)
        return {"role": self.role, "content": content}


class ChatRequest(Sampled):
    """POST /v1/chat/completions: messages rendered with the tokenizer's chat template."""

    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: Literal[False] | None = None
    top_logprobs: None = None

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


# ---------------------------------------------------------------------- responses


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


def completion_object(request_id: str, model: str, text: str, finish: str | None, usage_: dict | None, chunk: bool = False) -> dict:
    """A text_completion (or one of its stream chunks: the same object with a text delta)."""
    body = {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": FINISH.get(finish)}],
    }
    if usage_ is not None or not chunk:
        body["usage"] = usage_
    return body


def chat_object(request_id: str, model: str, text: str, finish: str | None, usage_: dict | None) -> dict:
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": FINISH.get(finish)}],
        "usage": usage_,
    }


def chat_chunk(request_id: str, model: str, delta: dict, finish: str | None) -> dict:
    return {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": FINISH.get(finish)}],
    }


def usage_chunk(request_id: str, model: str, object_name: str, usage_: dict) -> dict:
    """The last stream chunk when ``stream_options.include_usage``: no choices, the usage."""
    return {"id": request_id, "object": object_name, "created": int(time.time()), "model": model, "choices": [], "usage": usage_}


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
