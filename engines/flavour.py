"""Which TensorRT: ``tensorrt`` (>= 10.15) or ``tensorrt_rtx`` (1.7) build and run plans;
``tensorrt_lean`` and ``tensorrt_dispatch`` only run them. One small class each.

All expose the same runtime API (the builders also the same builder / parser
API); a ``Flavour`` wraps the imported module and overrides only where they
differ:

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
  Such a plan carries its own lean runtime, so the small runtime-only
  packages run it: ``tensorrt_lean`` (the lean runtime, ~44 MB of libraries
  against the full builder's ~1 GB) and ``tensorrt_dispatch`` (a ~1 MB shim
  that runs the plan's embedded lean runtime) — for embedded services that
  ship plans, not a builder. ``runtime_flavour`` picks one of them for a
  version-compatible set when full TensorRT is not installed;
- stream capture: TensorRT-RTX plans must be built with
  ``REQUIRE_USER_ALLOCATION`` to be captured into CUDA graphs (and a context
  still says whether it is capturable); a context that may be captured gets
  EAGER kernel specialization (its first enqueue compiles the specialized
  kernels, so no capture freezes a generic fallback) and RTX's own CUDA
  graphs off.

Every flavour builds fp32 graphs with TF32 off: an fp32 engine must compute
in fp32, as its graph (and ONNX Runtime's CPU provider) does.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

from dflash_trt.engines.calls import trt_call
from dflash_trt.errors import EngineBuildError, EngineError

TIMING_CACHE_FILE = "timing.cache"
RUNTIME_CACHE_SUFFIX = ".runtime.cache"  # one file per engine: <engine>.runtime.cache


class Flavour:
    """One TensorRT distribution; subclasses override where APIs differ."""

    name: str = ""
    module_name: str = ""
    install_hint: str = ""
    minimum_version: tuple[int, ...] = ()
    why_minimum: str = ""

    def __init__(self, trt: ModuleType):
        self.trt = trt

    builds = True  # False: a runtime only (lean, dispatch)

    def check_record(self, record) -> None:
        """Refuse an engine set this runtime cannot run, naming both sides and the fix.

        Plans load on the flavour and version that built them; a
        version-compatible TensorRT plan also on a later version of the same major.
        """
        built, here = f"{record.flavour} {record.trt_version}", f"{self.name} {self.version}"
        if record.flavour != self.name:
            msg = f"engine set was built with {built}; this loader uses {here}: rebuild with --backend {self.name}"
            raise EngineError(msg)
        if record.trt_version == self.version:
            return
        if not record.build_options.get("version_compatible"):
            msg = f"engine set was built with {built}; installed is {here}: plans are tied to their TensorRT version, rebuild them"
            raise EngineError(msg)
        self._check_compatible_version(record)

    def _check_compatible_version(self, record) -> None:
        built, have = _version_tuple(record.trt_version), _version_tuple(self.version)
        if built[:1] != have[:1] or have < built:
            msg = (
                f"engine set was built version-compatible with {record.flavour} {record.trt_version}; {self.name} {self.version} "
                "cannot run it (a version-compatible plan runs on the same major version, same or later): rebuild the set"
            )
            raise EngineError(msg)

    def check_version(self) -> None:
        """Refuse a TensorRT older than the graphs need, saying why."""
        have = _version_tuple(self.version)
        if have < self.minimum_version:
            need = ".".join(map(str, self.minimum_version))
            msg = f"{self.module_name} {self.version} is too old: dflash-trt needs >= {need} ({self.why_minimum}); {self.install_hint}"
            raise EngineError(msg)

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

    def configure(self, config, compute_dtype: str) -> None:
        """Builder flags every graph gets; ``compute_dtype`` is the graph's model dtype."""
        if compute_dtype == "float32":
            config.clear_flag(self.trt.BuilderFlag.TF32)  # on by default: fp32 matmuls would round to TF32

    # -- build-side caches -------------------------------------------------
    def open_build_cache(self, config, path: Path, note=None):
        """A cache shared by every build of this run, attached to ``config`` (None where there is none).

        ``note`` (optional) is told when an existing cache file cannot be used.
        """
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

    def execution_context(
        self, engine, cache_dir: Path | None = None, name: str = "engine", user_memory: bool = False, specialize: bool = False
    ):
        """(context, cache handle to save later or None) for engine ``name``.

        ``user_memory``: the context gets no scratch memory of its own; the
        caller sets one with ``context.set_device_memory`` (contexts that run
        one at a time on one stream can share one buffer). ``specialize``:
        the context's kernels must be the specialized ones from its first
        enqueue on (it may be captured in a CUDA graph after it; only
        TensorRT-RTX compiles kernels at run time). A context TensorRT does
        not make is an ``EngineError`` naming the call.
        """
        config = self._runtime_config(engine, user_memory, specialize)
        return self._create_context(engine, name, config), None

    def _create_context(self, engine, name: str, config):
        return trt_call(f"engine {name!r}", "create_execution_context", engine.create_execution_context, config, none_fails=True)

    def _runtime_config(self, engine, user_memory: bool, specialize: bool = False):
        runtime_config = engine.create_runtime_config()
        if user_memory:
            strategy = self.trt.ExecutionContextAllocationStrategy.USER_MANAGED
            runtime_config.set_execution_context_allocation_strategy(strategy)
        return runtime_config

    def save_runtime_cache(self, handle, cache_dir: Path) -> None:
        return None


class TensorRT(Flavour):
    name = "tensorrt"
    module_name = "tensorrt"
    install_hint = "pip install 'dflash-trt[tensorrt]' (TensorRT >= 10.15 with its CUDA libraries, on a GPU machine)"
    minimum_version = (10, 15)
    why_minimum = "the graphs write their KV caches with ONNX TensorScatter, imported from TensorRT 10.15 on"

    def open_build_cache(self, config, path: Path, note=None):
        data = path.read_bytes() if path.is_file() else b""
        cache = config.create_timing_cache(data)
        # ignore_mismatch=False: a cache from another GPU/version is refused, not misused;
        # then this run starts an empty one (and saves that, not the foreign bytes).
        if config.set_timing_cache(cache, False):
            return cache
        if note is not None:
            note(f"{path} was made by another GPU or TensorRT version; building with an empty timing cache (it replaces the file)")
        cache = config.create_timing_cache(b"")
        self.use_build_cache(config, cache)
        return cache

    def use_build_cache(self, config, cache) -> None:
        if not config.set_timing_cache(cache, False):
            msg = "TensorRT refused this run's own timing cache"
            raise EngineBuildError(msg)

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
    minimum_version = (1, 7)
    why_minimum = "IAttention's causal alignment and key/value lengths, and TensorScatter"

    def configure(self, config, compute_dtype: str) -> None:
        super().configure(config, compute_dtype)
        # Without it a TensorRT-RTX context allocates at enqueue and cannot be stream-captured.
        config.set_flag(self.trt.BuilderFlag.REQUIRE_USER_ALLOCATION)

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

    def execution_context(
        self, engine, cache_dir: Path | None = None, name: str = "engine", user_memory: bool = False, specialize: bool = False
    ):
        """A context with its own runtime cache (the kernels JIT-compiled for this engine),
        loaded from ``<name>.runtime.cache`` in ``cache_dir`` when there is one."""
        runtime_config = self._runtime_config(engine, user_memory, specialize)
        cache = runtime_config.create_runtime_cache()
        path = None if cache_dir is None else Path(cache_dir) / f"{name}{RUNTIME_CACHE_SUFFIX}"
        if path is not None and path.is_file():
            cache.deserialize(path.read_bytes())
        runtime_config.set_runtime_cache(cache)
        # The cache must outlive the context: return it with the context.
        return self._create_context(engine, name, runtime_config), RuntimeCache(cache, name)

    def _runtime_config(self, engine, user_memory: bool, specialize: bool = False):
        """TensorRT-RTX compiles shape-specialized kernels at run time, by default lazily: a
        generic kernel runs until a background compile finishes, and a CUDA graph captured
        meanwhile would keep the generic one for good. ``specialize``: EAGER, the first enqueue
        (the warm-up before any capture) compiles them. TensorRT-RTX's own CUDA graphs stay
        off: the runtime captures its own, and one capture cannot hold another."""
        runtime_config = super()._runtime_config(engine, user_memory)
        if specialize and hasattr(runtime_config, "dynamic_shapes_kernel_specialization_strategy"):
            runtime_config.dynamic_shapes_kernel_specialization_strategy = self.trt.DynamicShapesKernelSpecializationStrategy.EAGER
        if hasattr(runtime_config, "cuda_graph_strategy"):
            runtime_config.cuda_graph_strategy = self.trt.CudaGraphStrategy.DISABLED
        return runtime_config

    def save_runtime_cache(self, handle, cache_dir: Path) -> None:
        if handle is not None:
            (Path(cache_dir) / f"{handle.name}{RUNTIME_CACHE_SUFFIX}").write_bytes(bytes(handle.cache.serialize()))


class RuntimeCache:
    """A TensorRT-RTX runtime cache and the engine it belongs to (each engine saves its own file)."""

    def __init__(self, cache, name: str):
        self.cache, self.name = cache, name


class RuntimeOnly(Flavour):
    """A TensorRT runtime without a builder: runs version-compatible plans built by full TensorRT."""

    builds = False
    minimum_version = (10, 15)
    why_minimum = "TensorScatter's in-place cache update"

    def set_targets(self, config, targets: tuple[str, ...]) -> list[str]:
        msg = f"{self.name} is a runtime only and cannot build: build the set with --backend tensorrt --version-compatible"
        raise EngineBuildError(msg)

    def check_record(self, record) -> None:
        if record.flavour != TensorRT.name or not record.build_options.get("version_compatible"):
            msg = (
                f"engine set was built with {record.flavour} {record.trt_version}"
                f"{'' if record.build_options.get('version_compatible') else ' (not version-compatible)'}; "
                f"{self.name} runs version-compatible TensorRT plans only: rebuild with --backend tensorrt --version-compatible"
            )
            raise EngineError(msg)
        self._check_compatible_version(record)

    def new_runtime(self, log, version_compatible: bool = False):
        runtime = self.trt.Runtime(log)
        if hasattr(runtime, "engine_host_code_allowed"):
            runtime.engine_host_code_allowed = True  # the plan's embedded lean runtime
        return runtime


class TensorRTLean(RuntimeOnly):
    name = "tensorrt_lean"
    module_name = "tensorrt_lean"
    install_hint = "pip install 'dflash-trt[lean]' (tensorrt-lean-cu13: runs version-compatible plans, no builder)"


class TensorRTDispatch(RuntimeOnly):
    name = "tensorrt_dispatch"
    module_name = "tensorrt_dispatch"
    install_hint = "pip install 'dflash-trt[dispatch]' (tensorrt-dispatch-cu13: runs the lean runtime a version-compatible plan embeds)"

    def _check_compatible_version(self, record) -> None:
        return None  # it runs the plan's own embedded lean runtime, whatever the shim's version


FLAVOURS: dict[str, type[Flavour]] = {cls.name: cls for cls in (TensorRT, TensorRTRTX, TensorRTLean, TensorRTDispatch)}
BUILDERS = tuple(name for name, cls in FLAVOURS.items() if cls.builds)
VERSION_COMPATIBLE_RUNTIMES = (TensorRT.name, TensorRTLean.name, TensorRTDispatch.name)  # in order of preference


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
    flavour = cls(module)
    flavour.check_version()
    return flavour


def runtime_flavour(record) -> Flavour:
    """The runtime for an engine set: the flavour that built it; for a version-compatible
    TensorRT set the first of full TensorRT, the lean runtime and the dispatch runtime that is
    installed (an embedded service may ship only the lean or dispatch wheel)."""
    compatible = record.flavour == TensorRT.name and bool(record.build_options.get("version_compatible"))
    names = VERSION_COMPATIBLE_RUNTIMES if compatible else (record.flavour,)
    errors = []
    for name in names:
        try:
            return load_flavour(name)
        except EngineError as error:
            errors.append(str(error))
    raise EngineError(" / ".join(errors))


def _version_tuple(version: str) -> tuple[int, ...]:
    """'10.15.1.29' -> (10, 15, 1, 29); stops at the first part that is not a number."""
    parts = []
    for part in version.split("."):
        if not part.isdigit():
            break
        parts.append(int(part))
    return tuple(parts)


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

            def note(self, text: str) -> None:
                """A warning of ours, kept (and echoed) with TensorRT's."""
                self.log(trt.ILogger.Severity.WARNING, text)

            def since(self, mark: int, *levels: str) -> list[str]:
                return [m for lv, m in self.messages[mark:] if not levels or lv in levels]

        _LOG_CLASSES[trt.__name__] = BuildLog
    return _LOG_CLASSES[trt.__name__]
