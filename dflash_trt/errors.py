"""Typed errors raised at the library's boundaries.

Every message names what was wrong, the valid range and the value seen, so a
caller can act on it without reading our source. One hierarchy for the whole
pipeline: catch ``DFlashError`` to catch them all.
"""


class DFlashError(Exception):
    """Base class of every error this library raises on purpose.

    ``param`` names the request field at fault (the library's name, e.g.
    ``prompt``, ``max_new_tokens``, ``temperature``) and ``code`` is a
    machine-readable reason (``context_length_exceeded``, ``invalid_value``,
    ...; for ``CudaError``, the CUDA error's name); both are None unless the
    raiser knows. A server maps them to its API's error fields without
    reading the message.
    """

    param: str | None = None
    code: str | None = None

    def __init__(self, *args, param: str | None = None, code: str | None = None):
        super().__init__(*args)
        if param is not None:
            self.param = param
        if code is not None:
            self.code = code


class UsageError(DFlashError):
    """A command line asks for what cannot work: a flag's value out of range, flags that do not go
    together, or artifacts the chosen backend cannot run. Raised before anything is loaded; the
    ``dflash-trt`` command prints it on one line and exits with 2."""


class CheckpointError(DFlashError):
    """A Hugging Face checkpoint (config or tensors) cannot be used."""


class ConfigError(CheckpointError):
    """A config.json field is missing, unsupported or inconsistent."""


class TensorError(CheckpointError):
    """A checkpoint tensor is missing, unexpected or has the wrong shape."""


class PairError(CheckpointError):
    """A draft does not fit its target (hidden size, vocabulary, taps, mask)."""


class TokenizerError(DFlashError):
    """Tokenizer files are missing or do not match the model."""


class SamplingError(DFlashError):
    """Sampling parameters are out of range (temperature, top_k, top_p, seed)."""


class ExportError(DFlashError):
    """Export options are out of range, or a traced graph breaks the contract."""


class ManifestError(DFlashError):
    """An artifact manifest is malformed or disagrees with its files."""


class EngineError(DFlashError):
    """An engine could not be built, loaded, or disagrees with the contract."""


class SessionError(DFlashError):
    """A runtime call names an unknown, closed or poisoned session."""


class InputError(DFlashError):
    """A runtime input is invalid (token, position, size); nothing changed."""


class PoisonedError(SessionError):
    """A failure after mutation left these sessions unusable until closed."""


class BusyError(DFlashError):
    """A call reached an executor (or its backend) while another call was running; nothing changed.

    An executor is driven by one thread at a time (``runtime.ownership``).
    """


class StatsError(DFlashError):
    """A stats Parquet file is missing, of another kind or schema version, or mistyped."""


class EngineBuildError(EngineError):
    """TensorRT could not parse or build one or more graphs of an engine set.

    ``failures`` lists every problem found in one pass (graph, node, message),
    so one run shows all the nodes to fix rather than the first.
    """

    def __init__(self, message: str, failures: tuple = ()):
        super().__init__(message)
        self.failures = tuple(failures)


class UnsupportedExportError(EngineError, UsageError):
    """An export a TensorRT build cannot take (fp32 model graphs: ONNX Runtime's configuration),
    refused before anything is parsed: a usage error (one line, exit status 2)."""


class CudaError(DFlashError):
    """A CUDA runtime/driver call failed, or CUDA (cuda-python, a GPU) is not available.

    ``call`` names the CUDA function, ``code`` is the CUDA error's name (e.g.
    ``"cudaErrorMemoryAllocation"``; ``None`` when cuda-python itself is
    missing), so logs and tests can match on it.
    """

    def __init__(self, message: str, call: str = "", code: str | None = None):
        super().__init__(message, code=code)
        self.call = call
        self.code = code


class ServingError(DFlashError):
    """the serving loop (``runtime.serving.loop``) refused a request; see the subclasses."""


class QueueFullError(ServingError):
    """the serving loop's request queue is full (backpressure): nothing was queued, retry later."""


class ServingClosedError(ServingError):
    """the serving loop is closed (or stopped after an internal error) and accepts no request."""
