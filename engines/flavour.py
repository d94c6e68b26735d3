"""Which TensorRT: ``tensorrt`` (>= 10.14) or ``tensorrt_rtx``, one small class each.

Both expose the same builder / parser / runtime API; a ``Flavour`` wraps the
imported module and overrides only where the two differ:

- the import itself (``tensorrt`` vs ``tensorrt_rtx``);
- caches: TensorRT reuses a *timing cache* across builds (a file beside the
  plans); in TensorRT-RTX timing-cache calls are no-ops (deprecated since
  1.2) and the reusable cache is the *runtime cache* of JIT-compiled kernels,
  attached to an execution context's runtime config;
- targets: TensorRT-RTX plans name the compute capabilities they run on
  (SM75..SM121; Hopper, e.g. the H200's SM90, is not among them); a TensorRT
  plan runs on the build GPU's compute capability, or on Ampere and newer
  with hardware compatibility;
- version-compatible plans: a TensorRT builder flag; TensorRT-RTX has none.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

from dflash_trt.errors import EngineBuildError, EngineError

TIMING_CACHE_FILE = "timing.cache"
RUNTIME_CACHE_FILE = "runtime.cache"


class Flavour:
    """One TensorRT distribution; subclasses override where APIs differ."""

    name: str = ""
    module_name: str = ""
    install_hint: str = ""

    def __init__(self, trt: ModuleType):
        self.trt = trt

    @property
    def version(self) -> str:
        return str(self.trt.__version__)

    def new_log(self, echo=None):
        """A TensorRT logger that keeps errors and warnings (see ``BuildLog``)."""
        return _log_class(self.trt)(echo)

    def network_flags(self) -> int:
        # Strongly typed: every tensor keeps the precision the graph gives it
        # (bf16/fp16 from the export), no builder-chosen precisions.
        return 1 << int(self.trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)

    # -- build-side caches -------------------------------------------------
    def open_build_cache(self, config, path: Path):
        """A cache shared by every build of this run (None where there is none)."""
        return None

    def use_build_cache(self, config, cache) -> None:
        return None

    def save_build_cache(self, cache, path: Path) -> Path | None:
        return None

    # -- targets and compatibility -----------------------------------------
    def set_targets(self, config, targets: tuple[str, ...]) -> list[str]:
        """Apply compute-capability targets; return them as recorded."""
        raise NotImplementedError

    def set_version_compatible(self, config, enabled: bool) -> None:
        if enabled:
            msg = f"{self.name} cannot build version-compatible plans; drop --version-compatible"
            raise EngineBuildError(msg)

    # -- runtime side ---------------------------------------------------------
    def new_runtime(self, log, version_compatible: bool = False):
        runtime = self.trt.Runtime(log)
        if version_compatible:
            # A version-compatible plan carries its own lean runtime (host code).
            runtime.engine_host_code_allowed = True
        return runtime

    def execution_context(self, engine, cache_dir: Path | None = None):
        """(context, cache handle to save later or None)."""
        return engine.create_execution_context(), None

    def save_runtime_cache(self, handle, cache_dir: Path) -> None:
        return None


class TensorRT(Flavour):
    name = "tensorrt"
    module_name = "tensorrt"
    install_hint = "pip install 'dflash-trt[tensorrt]' (TensorRT >= 10.14 with its CUDA libraries, on a GPU machine)"

    def open_build_cache(self, config, path: Path):
        data = path.read_bytes() if path.is_file() else b""
        return config.create_timing_cache(data)

    def use_build_cache(self, config, cache) -> None:
        # ignore_mismatch=False: a cache from another GPU/version is refused, not misused.
        config.set_timing_cache(cache, False)

    def save_build_cache(self, cache, path: Path) -> Path:
        path.write_bytes(bytes(cache.serialize()))
        return path

    def set_targets(self, config, targets: tuple[str, ...]) -> list[str]:
        if not targets:
            return [f"build GPU ({_current_sm()})"]
        if tuple(t.lower() for t in targets) == ("ampere_plus",):
            config.hardware_compatibility_level = self.trt.HardwareCompatibilityLevel.AMPERE_PLUS
            return ["ampere_plus"]
        msg = f"tensorrt targets: give none (the build GPU) or 'ampere_plus', got {list(targets)}"
        raise EngineBuildError(msg)

    def set_version_compatible(self, config, enabled: bool) -> None:
        if enabled:
            config.set_flag(self.trt.BuilderFlag.VERSION_COMPATIBLE)


class TensorRTRTX(Flavour):
    name = "tensorrt_rtx"
    module_name = "tensorrt_rtx"
    install_hint = "pip install 'dflash-trt[rtx]' (tensorrt-rtx-cu13 from PyPI; builds on CPU)"

    def supported_targets(self) -> list[str]:
        members = self.trt.ComputeCapability.__members__
        return [name for name in members if name.startswith("SM")]

    def default_targets(self) -> list[str]:
        # Ampere and newer: bf16 graphs cannot compile for SM75 (Turing has no
        # bf16), which is also TensorRT-RTX's own default set.
        return [name for name in self.supported_targets() if int(name[2:]) >= 80]

    def set_targets(self, config, targets: tuple[str, ...]) -> list[str]:
        # Explicit targets so engines.json states exactly where the plans run;
        # "CURRENT" would need a GPU on the build machine.
        supported = self.supported_targets()
        wanted = [_sm_name(t) for t in targets] or self.default_targets()
        unknown = [t for t in wanted if t not in supported]
        if unknown:
            msg = f"tensorrt_rtx targets {unknown} unknown; this version supports {supported}"
            raise EngineBuildError(msg)
        config.num_compute_capabilities = len(wanted)
        for index, target in enumerate(wanted):
            config.set_compute_capability(self.trt.ComputeCapability.__members__[target], index)
        return wanted

    def execution_context(self, engine, cache_dir: Path | None = None):
        runtime_config = engine.create_runtime_config()
        cache = runtime_config.create_runtime_cache()
        path = None if cache_dir is None else Path(cache_dir) / RUNTIME_CACHE_FILE
        if path is not None and path.is_file():
            cache.deserialize(path.read_bytes())
        runtime_config.set_runtime_cache(cache)
        # The cache must outlive the context: return it with the context.
        return engine.create_execution_context(runtime_config), cache

    def save_runtime_cache(self, handle, cache_dir: Path) -> None:
        if handle is not None:
            (Path(cache_dir) / RUNTIME_CACHE_FILE).write_bytes(bytes(handle.serialize()))


FLAVOURS: dict[str, type[Flavour]] = {cls.name: cls for cls in (TensorRT, TensorRTRTX)}


def load_flavour(name: str) -> Flavour:
    """Import the named TensorRT; ``EngineError`` says how to install it."""
    cls = FLAVOURS.get(name)
    if cls is None:
        msg = f"unknown TensorRT backend {name!r}; choose one of {sorted(FLAVOURS)}"
        raise EngineError(msg)
    try:
        module = importlib.import_module(cls.module_name)
    except (ImportError, OSError) as error:
        msg = f"backend {name!r} needs the Python module {cls.module_name!r}, not importable here ({error}); {cls.install_hint}"
        raise EngineError(msg) from error
    return cls(module)


def _sm_name(target: str) -> str:
    """'sm_89', 'SM89', '8.9' and '89' all name SM89."""
    text = target.strip().upper().replace("SM_", "SM").replace(".", "")
    return text if text.startswith("SM") else f"SM{text}"


def _current_sm() -> str:
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        return "compute capability unknown: cuda-python not installed"
    err, major = cudart.cudaDeviceGetAttribute(cudart.cudaDeviceAttr.cudaDevAttrComputeCapabilityMajor, 0)
    err2, minor = cudart.cudaDeviceGetAttribute(cudart.cudaDeviceAttr.cudaDevAttrComputeCapabilityMinor, 0)
    if int(err) or int(err2):
        return "compute capability unknown: no CUDA device"
    return f"sm_{major}{minor}"


_LOG_CLASSES: dict[str, type] = {}


def _log_class(trt: ModuleType) -> type:
    """A ``trt.ILogger`` subclass, made once per TensorRT module."""
    if trt.__name__ not in _LOG_CLASSES:

        class BuildLog(trt.ILogger):
            """Keeps errors and warnings in order; ``echo`` sees them as they come."""

            def __init__(self, echo=None):
                trt.ILogger.__init__(self)
                self.echo = echo
                self.messages: list[tuple[str, str]] = []  # (severity, text)

            def log(self, severity, msg):
                level = severity.name
                if level in ("INTERNAL_ERROR", "ERROR", "WARNING"):
                    self.messages.append((level, msg))
                    if self.echo is not None:
                        self.echo(f"  [{trt.__name__}] {level}: {msg}")

            def mark(self) -> int:
                return len(self.messages)

            def since(self, mark: int, *levels: str) -> list[str]:
                return [m for lv, m in self.messages[mark:] if not levels or lv in levels]

        _LOG_CLASSES[trt.__name__] = BuildLog
    return _LOG_CLASSES[trt.__name__]
