"""What each TensorRT flavour does differently: version floor, builder flags, build and runtime caches.

Builder flags are read back from a real TensorRT-RTX builder config (CPU);
the timing cache (full TensorRT only) and the runtime caches (contexts, which
need a GPU) are checked against stand-ins with TensorRT's API.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
from onnx import TensorProto as TP

from dflash_trt.engines.build import build_engine_set
from dflash_trt.engines.flavour import TIMING_CACHE_FILE, TensorRT, TensorRTRTX, load_flavour
from dflash_trt.errors import EngineError
from test_engines_build import argmax_model, kv_attention_model, source

ROOT = Path(__file__).parents[2]


@pytest.mark.parametrize(("version", "ok"), [("10.14.1.48", False), ("10.15.1.29", True), ("11.0.0.114", True)])
def test_tensorrt_older_than_the_graphs_need_is_refused(monkeypatch, version, ok):
    """Guards against loading a TensorRT that cannot import the exported graphs' KV-cache
    writes (ONNX TensorScatter arrived in 10.15): a clear error at load, not a parser failure
    per graph; and against the package's declared floor drifting from it."""
    monkeypatch.setitem(sys.modules, "tensorrt", SimpleNamespace(__name__="tensorrt", __version__=version))
    if ok:
        assert load_flavour("tensorrt").version == version
    else:
        with pytest.raises(EngineError, match=r"tensorrt 10\.14\.1\.48 is too old: dflash-trt needs >= 10\.15 \(.*TensorScatter"):
            load_flavour("tensorrt")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert f"tensorrt>={'.'.join(map(str, TensorRT.minimum_version))}" in extras["tensorrt"]


def test_fp32_graphs_build_without_tf32_and_rtx_plans_can_be_captured(tmp_path, monkeypatch):
    """Guards against fp32 engines silently computing matmuls in TF32 (10-bit mantissa: they
    drift from their graph and flip greedy ties), and against TensorRT-RTX plans built
    without REQUIRE_USER_ALLOCATION (they allocate at enqueue and cannot be stream-captured
    into CUDA graphs). Flags read back from real builder configs; every build applies them."""
    pytest.importorskip("tensorrt_rtx")
    rtx = load_flavour("tensorrt_rtx")
    flags = rtx.trt.BuilderFlag
    builder = rtx.trt.Builder(rtx.new_log())
    fp32, bf16 = builder.create_builder_config(), builder.create_builder_config()
    assert fp32.get_flag(flags.TF32)  # TensorRT's default
    rtx.configure(fp32, "float32")
    rtx.configure(bf16, "bfloat16")
    assert not fp32.get_flag(flags.TF32) and bf16.get_flag(flags.TF32)
    assert fp32.get_flag(flags.REQUIRE_USER_ALLOCATION) and bf16.get_flag(flags.REQUIRE_USER_ALLOCATION)
    seen = []
    monkeypatch.setattr(TensorRTRTX, "configure", lambda self, config, dtype: seen.append(dtype))
    sources = [source(tmp_path, "attention", kv_attention_model(TP.BFLOAT16)), source(tmp_path, "verify", argmax_model())]
    build_engine_set(sources, tmp_path / "out", rtx)
    assert seen == ["bfloat16", "float32"]


class FakeTimingCache:
    def __init__(self, data: bytes):
        self.data = data or b"fresh"

    def serialize(self):
        return self.data


class FakeConfig:
    """create_timing_cache / set_timing_cache; refuses caches whose bytes it did not make."""

    def __init__(self):
        self.attached = None

    def create_timing_cache(self, data):
        return FakeTimingCache(data)

    def set_timing_cache(self, cache, ignore_mismatch):
        assert ignore_mismatch is False
        if cache.data == b"from another GPU":
            return False
        self.attached = cache
        return True


def test_foreign_timing_cache_is_replaced_not_saved_back(tmp_path):
    """Guards against ignoring set_timing_cache's refusal: a timing cache from another GPU or
    TensorRT version stayed attached to nothing, the build ran uncached, and the foreign
    bytes were written back. Now the run says so, builds with a fresh cache, and saves that."""
    flavour = TensorRT(SimpleNamespace(__version__="10.15.1"))
    path = tmp_path / TIMING_CACHE_FILE
    path.write_bytes(b"from another GPU")
    notes, config = [], FakeConfig()
    cache = flavour.open_build_cache(config, path, notes.append)
    assert config.attached is cache and cache.data == b"fresh"
    assert len(notes) == 1 and "another GPU or TensorRT version" in notes[0]
    flavour.save_build_cache(cache, path)
    assert path.read_bytes() == b"fresh"
    second = FakeConfig()
    flavour.use_build_cache(second, cache)  # later graphs of the run share it
    assert second.attached is cache


class FakeRuntimeCache:
    def __init__(self):
        self.data = b""

    def deserialize(self, data):
        self.data = data

    def serialize(self):
        return self.data + b"+compiled"


class FakeRuntimeConfig:
    def __init__(self):
        self.cache, self.strategy = None, None

    def create_runtime_cache(self):
        return FakeRuntimeCache()

    def set_runtime_cache(self, cache):
        self.cache = cache

    def set_execution_context_allocation_strategy(self, strategy):
        self.strategy = strategy


class FakeEngine:
    def create_runtime_config(self):
        return FakeRuntimeConfig()

    def create_execution_context(self, runtime_config):
        return SimpleNamespace(runtime_config=runtime_config)


def test_each_rtx_context_keeps_its_own_runtime_cache_file(tmp_path):
    """Guards against every TensorRT-RTX context saving into one runtime.cache: each save
    overwrote the previous engine's JIT-compiled kernels, so every start recompiled all but
    one engine. Each engine now loads and saves <engine>.runtime.cache; contexts asked for
    user memory get the USER_MANAGED allocation strategy."""
    trt = SimpleNamespace(__version__="1.7.1", ExecutionContextAllocationStrategy=SimpleNamespace(USER_MANAGED="user"))
    flavour = TensorRTRTX(trt)
    (tmp_path / "draft_1.runtime.cache").write_bytes(b"draft kernels")
    draft, draft_cache = flavour.execution_context(FakeEngine(), tmp_path, "draft_1", user_memory=True)
    verify, verify_cache = flavour.execution_context(FakeEngine(), tmp_path, "target_verify_1")
    assert draft.runtime_config.cache.data == b"draft kernels" and verify.runtime_config.cache.data == b""
    assert draft.runtime_config.strategy == "user" and verify.runtime_config.strategy is None
    flavour.save_runtime_cache(draft_cache, tmp_path)
    flavour.save_runtime_cache(verify_cache, tmp_path)
    assert (tmp_path / "draft_1.runtime.cache").read_bytes() == b"draft kernels+compiled"
    assert (tmp_path / "target_verify_1.runtime.cache").read_bytes() == b"+compiled"


class StrategyRuntimeConfig(FakeRuntimeConfig):
    """TensorRT-RTX 1.7's runtime config, with its kernel specialization and CUDA-graph strategies."""

    def __init__(self):
        super().__init__()
        self.dynamic_shapes_kernel_specialization_strategy = "LAZY"  # TensorRT-RTX's default
        self.cuda_graph_strategy = "WHOLE_GRAPH_CAPTURE"


class StrategyEngine(FakeEngine):
    def create_runtime_config(self):
        return StrategyRuntimeConfig()


def test_rtx_contexts_that_may_be_captured_specialize_their_kernels_eagerly(tmp_path):
    """Guards against TensorRT-RTX's lazy kernel specialization freezing its generic fallback
    kernels into a CUDA graph for good (captured after one warm-up enqueue while the specialized
    kernels still compile in the background), and against RTX capturing a graph of its own
    inside the runtime's capture: a context that may be captured gets EAGER specialization,
    every context has RTX's CUDA graphs off, a chunked one (never captured) stays LAZY. A
    context TensorRT does not make is an EngineError naming the call."""
    trt = SimpleNamespace(
        __version__="1.7.1",
        ExecutionContextAllocationStrategy=SimpleNamespace(USER_MANAGED="user"),
        DynamicShapesKernelSpecializationStrategy=SimpleNamespace(EAGER="EAGER"),
        CudaGraphStrategy=SimpleNamespace(DISABLED="DISABLED"),
    )
    flavour = TensorRTRTX(trt)
    captured, _ = flavour.execution_context(StrategyEngine(), tmp_path, "draft_1", user_memory=True, specialize=True)
    chunked, _ = flavour.execution_context(StrategyEngine(), tmp_path, "target_prefill", user_memory=True)
    assert (captured.runtime_config.dynamic_shapes_kernel_specialization_strategy, captured.runtime_config.cuda_graph_strategy) == ("EAGER", "DISABLED")
    assert (chunked.runtime_config.dynamic_shapes_kernel_specialization_strategy, chunked.runtime_config.cuda_graph_strategy) == ("LAZY", "DISABLED")
    flavour.execution_context(FakeEngine(), tmp_path, "old", specialize=True)  # a runtime config without strategies: nothing set
    failing = StrategyEngine()
    failing.create_execution_context = lambda config: None
    with pytest.raises(EngineError, match=r"engine 'draft_2': TensorRT create_execution_context\(.*\) failed \(returned None"):
        flavour.execution_context(failing, tmp_path, "draft_2", specialize=True)


def vc_record(flavour="tensorrt", version="10.15.1.29", compatible=True):
    from dflash_trt.engines.engine_set import EngineSetRecord

    return EngineSetRecord(flavour, version, ("build GPU (sm_89)",), {"version_compatible": compatible}, {})


def installed(monkeypatch, **modules):
    """Make exactly these TensorRT modules importable (name -> version); the others not."""
    for name in ("tensorrt", "tensorrt_lean", "tensorrt_dispatch"):
        version = modules.get(name)
        fake = None if version is None else SimpleNamespace(__name__=name, __version__=version, Runtime=FakeRuntime)
        monkeypatch.setitem(sys.modules, name, fake)  # None: `import name` raises ImportError


class FakeRuntime:
    def __init__(self, log):
        self.engine_host_code_allowed = False


@pytest.mark.parametrize(
    ("modules", "expected"),
    [
        ({"tensorrt": "10.16.0", "tensorrt_lean": "10.16.0"}, "tensorrt"),
        ({"tensorrt_lean": "10.16.0", "tensorrt_dispatch": "10.16.0"}, "tensorrt_lean"),
        ({"tensorrt_dispatch": "10.15.1"}, "tensorrt_dispatch"),
    ],
)
def test_version_compatible_set_runs_on_the_runtime_that_is_installed(monkeypatch, modules, expected):
    """Guards against an embedded service that ships only the lean (44 MB) or dispatch (1 MB)
    runtime being told to install the full ~1 GB TensorRT: a version-compatible TensorRT set
    loads on the first of full TensorRT, lean, dispatch that is installed; the runtime lets
    the plan run its embedded lean runtime."""
    from dflash_trt.engines.flavour import runtime_flavour

    installed(monkeypatch, **modules)
    flavour = runtime_flavour(vc_record())
    assert flavour.name == expected
    flavour.check_record(vc_record())
    assert flavour.new_runtime(None, version_compatible=True).engine_host_code_allowed


def test_lean_and_dispatch_runtimes_refuse_what_they_cannot_run(monkeypatch):
    """Guards against handing the lean / dispatch runtime a plan it cannot deserialize (not
    version-compatible, from TensorRT-RTX, or from a later or other-major TensorRT) or
    building with a runtime that has no builder: each refusal names the fix."""
    from dflash_trt.engines.flavour import BUILDERS, runtime_flavour

    installed(monkeypatch, tensorrt_lean="10.16.0", tensorrt_dispatch="10.16.0")
    lean, dispatch = load_flavour("tensorrt_lean"), load_flavour("tensorrt_dispatch")
    with pytest.raises(EngineError, match=r"\(not version-compatible\); tensorrt_lean runs version-compatible TensorRT plans only: rebuild with --backend tensorrt --version-compatible"):
        lean.check_record(vc_record(compatible=False))
    with pytest.raises(EngineError, match=r"built with tensorrt_rtx"):
        dispatch.check_record(vc_record("tensorrt_rtx", "1.7.1.116"))
    with pytest.raises(EngineError, match=r"same major version, same or later"):
        lean.check_record(vc_record(version="10.17.0"))
    with pytest.raises(EngineError, match=r"same major version, same or later"):
        lean.check_record(vc_record(version="9.3.0"))
    dispatch.check_record(vc_record(version="10.17.0"))  # it runs the plan's own lean runtime
    with pytest.raises(EngineError, match=r"module 'tensorrt'"):
        runtime_flavour(vc_record(compatible=False))  # only full TensorRT runs it, and it is not installed
    with pytest.raises(Exception, match=r"runtime only and cannot build"):
        lean.set_targets(None, ())
    assert BUILDERS == ("tensorrt", "tensorrt_rtx")
