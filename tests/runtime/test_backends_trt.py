"""TensorRT backend binding logic, on CPU, with a fake execution context.

TensorRT needs a GPU it supports (docs/design.md §7), so the part of
``trt_backend`` that is ours — which address every binding gets, when caches
are re-bound, dynamic input shapes, output views, CUDA-graph capture per
first row — is checked against a stand-in context that records the calls and
"executes" by writing through the bound host pointers.
"""

from __future__ import annotations

import contextlib
import ctypes

import pytest
import torch

from dflash_trt.errors import EngineError
from dflash_trt.export import contract as c
from dflash_trt.runtime.backends.pools import CachePool, pool_shapes
from dflash_trt.runtime.backends.routes import RouteConstants, route_of, routes
from dflash_trt.runtime.backends.trt_backend import EngineContext, TensorRTBackend

DIMS = c.Dims(
    vocab_size=11, tap_width=8, block_size=4, proposals=3, max_owners=2, max_context=16, max_chunk=6,
    target_layers=2, target_kv_heads=1, target_head_dim=4, draft_layers=1, draft_kv_heads=1, draft_head_dim=4, dtype="float32",
)
ROWS = 4


class FakeBuffer:
    """DeviceBuffer stand-in: host memory with the same interface."""

    def __init__(self, shape, dtype, stream=None):
        self.tensor = torch.zeros(shape, dtype=dtype)
        self.ptr = self.tensor.data_ptr()
        self.closed = False

    def as_tensor(self):
        return self.tensor

    def close(self):
        self.closed = True


class FakeGraph:
    captures = 0
    fail = None  # an exception the next captures raise (a capture TensorRT or CUDA refuses)

    def __init__(self):
        self.launches = 0
        self.closed = False

    def capture(self, stream, mode="global"):
        assert mode == "thread_local"  # other threads' CUDA calls must not invalidate it
        FakeGraph.captures += 1
        if FakeGraph.fail is not None:
            raise FakeGraph.fail
        return contextlib.nullcontext(self)

    def launch(self, stream):
        self.launches += 1

    def close(self):
        self.closed = True


class FakeCuda:
    DeviceBuffer = FakeBuffer
    CudaGraph = FakeGraph


class FakeStream:
    ptr = 1234
    device_stream = object()

    def scope(self):
        return contextlib.nullcontext()


class FakeContext:
    """Records addresses and shapes; execute writes 1.0s / 1s into every plain output it was given."""

    def __init__(self, spec: c.GraphSpec):
        self.spec = spec
        self.addresses: dict[str, int] = {}
        self.shapes: dict[str, tuple] = {}
        self.address_calls = 0
        self.executions = 0
        self.fail = False
        self.capturable = True

    def set_tensor_address(self, name, ptr):
        self.address_calls += 1
        self.addresses[name] = ptr
        shared = c.SHARED_WEIGHTS if self.spec.kind in c.MODEL_KINDS else ()  # a model engine's IO has them too
        return name in self.spec.input_names + self.spec.output_names + shared

    def set_input_shape(self, name, shape):
        self.shapes[name] = shape
        return True

    def is_stream_capturable(self, stream):
        assert stream == FakeStream.ptr
        return self.capturable

    def set_device_memory(self, ptr, size):
        self.device_memory = (ptr, size)
        return True

    def execute_async_v3(self, stream):
        assert stream == FakeStream.ptr
        self.executions += 1
        sizes = {d: self.shapes.get(s.name, s.shape)[a] for s in self.spec.inputs for a, d in enumerate(s.shape) if isinstance(d, str)}
        for s in self.spec.outputs:
            if not s.name.startswith("present_"):
                shape = s.resolve(sizes)
                one = torch.ones(shape, dtype=torch.int64 if s.dtype == "int64" else torch.float32)
                ctypes.memmove(self.addresses[s.name], one.data_ptr(), one.numel() * one.element_size())
        return not self.fail


@pytest.fixture
def pools():
    shapes = pool_shapes(DIMS, ROWS, torch.float32)
    return {name: CachePool.allocate(name, shape, torch.device("cpu")) for name, shape in shapes.items()}


def _backend(pools, names, cuda_graphs: bool = False):
    """A TensorRTBackend over fake contexts (one per run graph in ``names``), as ``_allocate`` wires them."""
    backend = TensorRTBackend.__new__(TensorRTBackend)
    backend.dims, backend.device, backend.max_sessions, backend.pools = DIMS, torch.device("cpu"), ROWS, pools
    backend.stream, backend.plain = FakeStream(), False
    backend.routes, backend.constants = routes(DIMS), RouteConstants(DIMS, torch.device("cpu"))
    backend.contexts, fakes = {}, {}
    for name in names:
        route = backend.routes[name]
        fakes[name] = FakeContext(route.graph)
        backend.contexts[name] = EngineContext(FakeCuda, route, fakes[name], None, backend.stream, cuda_graphs and not route.run.dims)
    return backend, fakes


def _context(name: str, cuda_graphs: bool = False):
    route = route_of(DIMS, name)
    fake = FakeContext(route.graph)
    return EngineContext(FakeCuda, route, fake, None, FakeStream(), cuda_graphs), fake


def _feeds(spec: c.GraphSpec, sizes: dict) -> dict:
    return {s.name: torch.zeros(s.resolve(sizes), dtype=torch.int64 if s.dtype == "int64" else torch.float32) for s in spec.inputs if not s.name.startswith("past_")}


def _at(address: int, count: int) -> list[int]:
    """``count`` int64 values at a bound host address."""
    return list((ctypes.c_int64 * count).from_address(address))


def test_every_binding_gets_an_address_and_caches_are_in_place(pools):
    """Bug: a binding left unaddressed (TensorRT reads garbage), or present_* bound apart from past_*
    (the cache update lands in a scratch buffer and is lost)."""
    backend, fakes = _backend(pools, ["target_verify_2"])
    engine, fake = backend.contexts["target_verify_2"], fakes["target_verify_2"]
    feeds = _feeds(c.graph_spec(DIMS, "target_verify_2"), {})
    out = backend.run("target_verify_2", feeds, 1)
    assert set(fake.addresses) == set(engine.spec.input_names + engine.spec.output_names)
    for layer in range(DIMS.target_layers):
        for which, tensors in (("key", pools["target"].keys), ("value", pools["target"].values)):
            row_one = tensors[layer][1:3].data_ptr()
            assert fake.addresses[f"past_{which}_{layer}"] == fake.addresses[f"present_{which}_{layer}"] == row_one
        assert fake.shapes[f"past_key_{layer}"] == (2, DIMS.target_kv_heads, DIMS.max_context, DIMS.target_head_dim)
    assert fake.addresses[c.TOKENS] == feeds[c.TOKENS].data_ptr()  # feeds bound where they are: no copy
    assert _at(fake.addresses[c.PICKS], DIMS.proposals + 1) == list(range(DIMS.proposals + 1))  # every row's logits
    assert out[c.LOGITS].data_ptr() == fake.addresses[c.LOGITS] and torch.all(out[c.LOGITS] == 1)
    assert out[c.LOGITS].shape == (2, DIMS.proposals + 1, DIMS.vocab_size)
    assert out[c.TAPS].shape == (2, DIMS.proposals + 1, DIMS.tap_width)


def test_caches_rebound_only_when_the_first_row_changes(pools):
    """Bug: every run re-sets hundreds of cache addresses (host time), or a new first_row keeps the old ones."""
    engine, fake = _context("draft_1")
    engine.bind_caches(2, pools["draft"].interleaved(2, 1))
    calls = fake.address_calls
    engine.bind_caches(2, pools["draft"].interleaved(2, 1))
    assert fake.address_calls == calls
    engine.bind_caches(3, pools["draft"].interleaved(3, 1))
    assert fake.address_calls == calls + 2 * 2 * DIMS.draft_layers
    assert fake.addresses["past_key_0"] == pools["draft"].keys[0][3:4].data_ptr()


def test_dynamic_graph_sets_input_shapes_and_returns_a_prefix_view(pools):
    """Bug: a dynamic engine runs with its previous (or profile-max) input shape, the returned taps
    have the max shape instead of this call's token count, or prefill's logits are of another row
    than the last (``picks`` = [T-1])."""
    backend, fakes = _backend(pools, ["target_prefill"])
    engine, fake = backend.contexts["target_prefill"], fakes["target_prefill"]
    for tokens in (5, 2):
        feeds = _feeds(c.graph_spec(DIMS, "target_prefill"), {c.TOKENS_DIM: tokens})
        out = backend.run("target_prefill", feeds, 0)
        assert fake.shapes[c.TOKENS] == (1, tokens) and fake.shapes[c.PICKS] == (1,)
        assert _at(fake.addresses[c.PICKS], 1) == [tokens - 1]
        assert out[c.TAPS].shape == (1, tokens, DIMS.tap_width) and out[c.LOGITS].shape == (1, DIMS.vocab_size)
        assert out[c.TAPS].data_ptr() == engine.buffers[c.TAPS].ptr  # outputs never move


def test_draft_context_runs_the_draft_model_with_its_count_and_no_block(pools):
    """Bug: draft_context routed onto draft_model with a count other than its rows (context rows
    lost or padding written), or with a real anchor (a block written past the context: the next
    cycle's draft attends stale slots); and its proposals handed back as if they meant something."""
    backend, fakes = _backend(pools, ["draft_context", "target_decode_2"])
    fake = fakes["draft_context"]
    feeds = {c.TAPS: torch.zeros(1, 3, DIMS.tap_width), c.START: torch.tensor([4])}
    out = backend.run("draft_context", feeds, 2)
    assert fake.addresses[c.CTX_TAPS] == feeds[c.TAPS].data_ptr() and fake.addresses[c.CTX_START] == feeds[c.START].data_ptr()
    assert _at(fake.addresses[c.CTX_COUNT], 1) == [3] and _at(fake.addresses[c.ANCHOR], 1) == [c.NO_ANCHOR]
    assert fake.shapes[c.CTX_TAPS] == (1, 3, DIMS.tap_width) and out == {}
    decode = backend.run("target_decode_2", {c.TOKENS: torch.zeros(2, 1, dtype=torch.int64), c.START: torch.tensor([3, 5])}, 0)
    assert decode[c.LOGITS].shape == (2, DIMS.vocab_size) and _at(fakes["target_decode_2"].addresses[c.PICKS], 1) == [0]


def test_refusals_raise_engine_error(pools):
    """Bug: TensorRT's False returns (bad address, failed enqueue) are ignored and stale outputs returned."""
    engine, fake = _context("verify_argmax_1")
    fake.fail = True
    with pytest.raises(EngineError, match=r"engine 'verify_argmax_1' \(verify_argmax_1\): TensorRT execute_async_v3\(1234\) failed \(returned False"):
        engine.run(_feeds(engine.spec, engine.route.max_sizes), {}, 0)
    fake.fail = False
    fake.set_tensor_address = lambda name, ptr: name != c.CANDIDATES
    with pytest.raises(EngineError, match=r"TensorRT set_tensor_address\('candidates', .*\) failed"):
        engine.run(_feeds(engine.spec, engine.route.max_sizes), {}, 0)


def test_a_tensorrt_call_that_raises_is_an_engine_error_naming_the_call(pools):
    """Guards against TensorRT's raising bindings (full TensorRT's set_optimization_profile_async
    and set_input_shape raise RuntimeError where TensorRT-RTX returns False) escaping as an
    untyped RuntimeError without the engine or the call: every failure is an EngineError
    naming the engine, the run graph, the call and TensorRT's words."""
    from dflash_trt.engines.calls import trt_call

    engine, fake = _context("target_prefill")

    def refuse(name, shape):
        raise RuntimeError("IExecutionContext::setInputShape: Error Code 3: API Usage Error")

    fake.set_input_shape = refuse
    sizes = {c.OWNERS_DIM: 1, c.STEP_DIM: 3, c.PICKS_DIM: 1}
    feeds = _feeds(engine.spec, sizes)
    with pytest.raises(EngineError, match=r"engine 'target_model' \(target_prefill\): TensorRT set_input_shape\('tokens', \(1, 3\)\) raised RuntimeError: .*Error Code 3") as caught:
        engine.run(feeds, sizes, 0)
    assert isinstance(caught.value.__cause__, RuntimeError)

    def profile(index, stream):
        raise RuntimeError("setOptimizationProfileAsync: profile index out of range")

    with pytest.raises(EngineError, match=r"engine 'target_model' \(target_verify_2\): TensorRT set_optimization_profile_async\(7, 1234\) raised RuntimeError: .*out of range"):
        trt_call("engine 'target_model' (target_verify_2)", "set_optimization_profile_async", profile, 7, 1234)
    with pytest.raises(EngineError, match=r"create_execution_context\(\) failed \(returned None"):
        trt_call("engine 'draft_model'", "create_execution_context", lambda: None, none_fails=True)
    assert trt_call("x", "set_device_memory", lambda: None) is None  # older TensorRT returns None: not a failure


def test_cuda_graph_mode_captures_once_per_first_row(pools):
    """Bug: a capture is reused for another first_row (writes the wrong session's rows) or re-made every call;
    feeds must be copied into the static inputs the capture reads."""
    engine, fake = _context("draft_2", cuda_graphs=True)
    FakeGraph.captures = 0
    feeds = _feeds(engine.spec, engine.route.max_sizes)
    feeds[c.ANCHOR] = torch.tensor([3, 4])
    for first in (0, 0, 1, 0):
        engine.bind_caches(first, pools["draft"].interleaved(first, 2))
        engine.run(feeds, engine.route.max_sizes, first)
    assert FakeGraph.captures == 2 and set(engine.graphs) == {0, 1}
    assert fake.executions == 2 * 2  # per capture: one warm-up enqueue + one captured enqueue
    assert engine.graphs[0].launches == 3 and engine.graphs[1].launches == 1
    assert fake.addresses[c.ANCHOR] == engine.input_buffers[c.ANCHOR].ptr
    assert torch.equal(engine.static_inputs[c.ANCHOR], torch.tensor([3, 4]))
    engine.close()
    assert all(b.closed for b in [*engine.buffers.values(), *engine.input_buffers.values()])


def test_context_that_cannot_be_captured_runs_eagerly(pools):
    """Guards against capturing a context TensorRT says is not capturable (TensorRT-RTX with
    data-dependent shapes or device-side control flow: the capture fails or replays wrong
    work): with cuda_graphs on, such a context binds the feeds and enqueues every call."""
    engine, fake = _context("draft_2", cuda_graphs=True)
    fake.capturable = False
    FakeGraph.captures = 0
    feeds = _feeds(engine.spec, engine.route.max_sizes)
    for first in (0, 1):
        engine.bind_caches(first, pools["draft"].interleaved(first, 2))
        out = engine.run(feeds, engine.route.max_sizes, first)
        assert torch.all(out[c.PROPOSALS] == 1)
    assert FakeGraph.captures == 0 and not engine.graphs and fake.executions == 2
    assert fake.addresses[c.ANCHOR] == feeds[c.ANCHOR].data_ptr()  # the caller's tensor, no static copy
    assert not engine.input_buffers


def test_contexts_share_one_scratch_buffer_as_large_as_the_largest_need():
    """Guards against one scratch allocation per context (a set of engines paid the sum of
    their scratch memory although they run one at a time on one stream): one buffer of the
    largest engine's size is every context's device memory."""
    from dflash_trt.runtime.backends.trt_backend import SharedScratch

    scratch = SharedScratch(FakeCuda, {"target_prefill": 4096, "draft_1": 65536, "verify_argmax_1": 1024}, FakeStream())
    contexts = [FakeContext(c.graph_spec(DIMS, name)) for name in ("target_prefill", "draft_1", "verify_argmax_1")]
    for context in contexts:
        scratch.attach(context.spec.name, context)
    assert {context.device_memory for context in contexts} == {(scratch.buffer.ptr, 65536)}
    assert scratch.buffer.tensor.numel() == 65536
    refusing = FakeContext(c.graph_spec(DIMS, "draft_2"))
    refusing.set_device_memory = lambda ptr, size: False
    with pytest.raises(EngineError, match=r"run graph 'draft_2' \(shared scratch\): TensorRT set_device_memory\(.*, 65536\) failed"):
        scratch.attach("draft_2", refusing)



def test_plain_runs_enqueue_for_a_callers_capture_and_capturable_needs_every_context(pools):
    """Guards against the executor's whole-cycle capture recording this backend's own per-graph
    replay (a graph launch and static-input copies from stale feeds) instead of the enqueue, and
    against offering whole-cycle capture when one context (TensorRT-RTX) says it cannot be captured."""
    draft, draft_fake = _context("draft_2", cuda_graphs=True)
    verify, verify_fake = _context("target_verify_2", cuda_graphs=True)
    backend = TensorRTBackend.__new__(TensorRTBackend)
    backend.contexts, backend.plain = {"draft_2": draft, "target_verify_2": verify}, False
    FakeGraph.captures = 0
    feeds = _feeds(draft.spec, draft.route.max_sizes)
    draft.bind_caches(0, pools["draft"].interleaved(0, 2))
    with backend.plain_runs():
        assert backend.plain
        out = draft.run(feeds, draft.route.max_sizes, 0, replay=not backend.plain)
    assert not backend.plain and FakeGraph.captures == 0 and not draft.graphs
    assert draft_fake.executions == 1 and draft_fake.addresses[c.ANCHOR] == feeds[c.ANCHOR].data_ptr()
    assert torch.all(out[c.PROPOSALS] == 1)
    assert backend.capturable
    verify_fake.capturable, verify.capturable = False, None  # asked again: TensorRT-RTX refuses
    assert not backend.capturable


def test_a_capture_that_fails_falls_back_to_eager_logged_once(pools, caplog):
    """Guards against a CUDA-graph capture failure (TensorRT enqueue work that cannot be
    recorded, an invalidated capture) ending the run graph or the whole backend, or flooding
    the log: the run that captured still returns the warm-up's outputs, every later run of
    that context enqueues eagerly without trying again, and two contexts of one backend that
    both fail log one warning."""
    from dflash_trt.errors import CudaError
    from dflash_trt.runtime.device import CaptureFallback

    fallback = CaptureFallback("the tensorrt backend")
    contexts = []
    for name in ("draft_2", "verify_argmax_2"):
        route = route_of(DIMS, name)
        fake = FakeContext(route.graph)
        contexts.append((EngineContext(FakeCuda, route, fake, None, FakeStream(), True, fallback), fake))
    FakeGraph.captures, FakeGraph.fail = 0, CudaError("capture invalidated", call="cudaStreamEndCapture", code="cudaErrorStreamCaptureInvalidated")
    try:
        with caplog.at_level("WARNING", logger="dflash_trt.runtime.device"):
            for engine, fake in contexts:
                feeds = _feeds(engine.spec, engine.route.max_sizes)
                for first in (0, 1, 0):
                    if engine.spec.cache_inputs:
                        engine.bind_caches(first, pools["draft"].interleaved(first, 2))
                    out = engine.run(feeds, engine.route.max_sizes, first)
                    assert all(torch.all(t == 1) for t in out.values())
                assert fake.executions == 3 and not engine.graphs and engine.capturable is False and not engine.input_buffers
    finally:
        FakeGraph.fail = None
    assert FakeGraph.captures == 2 and fallback.failures == 2  # one attempt per context, never again
    warnings = [r for r in caplog.records if "CUDA-graph capture" in r.getMessage()]
    assert len(warnings) == 1
    assert "engine 'draft_model' (draft_2) at row 0" in warnings[0].getMessage() and "capture invalidated" in warnings[0].getMessage()


class ProfiledContext(FakeContext):
    """A context of a model engine: it takes an optimization profile (full TensorRT raises on a bad one)."""

    def __init__(self, spec, refuse=False):
        super().__init__(spec)
        self.refuse, self.profile = refuse, None

    def set_optimization_profile_async(self, index, stream):
        if self.refuse:
            raise RuntimeError("IExecutionContext::setOptimizationProfileAsync: Error Code 3")
        self.profile = index
        return True


class RecordingFlavour:
    """Flavour.execution_context over fake contexts, recording what each run graph asked for."""

    def __init__(self, refuse=()):
        self.asked, self.refuse = {}, refuse

    def execution_context(self, engine, cache_dir, name, user_memory=False, specialize=False):
        self.asked[name] = (user_memory, specialize)
        return ProfiledContext(route_of(DIMS, name).graph, refuse=name in self.refuse), None


def _opening_backend():
    from dflash_trt.runtime.backends.trt_backend import SharedScratch
    from dflash_trt.runtime.device import CaptureFallback

    backend = TensorRTBackend.__new__(TensorRTBackend)
    backend.stream, backend.runtime_cache_dir = FakeStream(), None
    backend.scratch = SharedScratch(FakeCuda, {name: 64 for name in routes(DIMS)}, FakeStream())
    backend.fallback = CaptureFallback("test")
    backend.shared = {}
    return backend


def test_every_context_but_the_chunked_ones_specializes_and_each_gets_its_profile():
    """Guards against a captured run graph (verify, draft, decode, verdicts, the sampler a decode
    program captures) keeping TensorRT-RTX's lazily specialized fallback kernels, against a
    kernel compiled synchronously per prompt length for the chunked ones (prefill, context),
    and against a model context left at profile 0: each context gets user memory, its route's
    profile, and eager specialization unless its run graph is chunked."""
    backend, flavour = _opening_backend(), RecordingFlavour()
    for name, route in routes(DIMS).items():
        context = backend._open_context(FakeCuda, flavour, None, route, cuda_graphs=False)
        assert context.context.profile == (route.index if route.graph.profiles else None), name
    chunked = {name for name, (_, specialize) in flavour.asked.items() if not specialize}
    assert chunked == {"target_prefill", "draft_context"} and all(user for user, _ in flavour.asked.values())


def test_a_profile_full_tensorrt_refuses_is_an_engine_error_naming_the_call():
    """Guards against full TensorRT's set_optimization_profile_async raising a bare RuntimeError
    out of the backend's constructor (TensorRT-RTX returns False instead)."""
    backend, flavour = _opening_backend(), RecordingFlavour(refuse={"target_verify_2"})
    with pytest.raises(EngineError, match=r"engine 'target_model' \(target_verify_2\): TensorRT set_optimization_profile_async\(\d+, 1234\) raised RuntimeError: .*Error Code 3"):
        backend._open_context(FakeCuda, flavour, None, routes(DIMS)["target_verify_2"], cuda_graphs=False)


def test_a_whole_cycle_capture_that_fails_runs_every_program_eagerly_logged_once(caplog):
    """Guards against a failed whole-cycle capture (a TensorRT enqueue that cannot be recorded,
    another thread's CUDA call) killing the executor's launch, or retrying and logging on every
    new program key: the launch that tried still ran its program eagerly, capture is then off
    for the loop, later programs run eagerly, one warning names the program and the reason."""
    from types import SimpleNamespace

    from dflash_trt.runtime.device import CaptureFallback
    from dflash_trt.runtime.device_loop import CYCLE, DECODE, DeviceLoop, Key

    loop = DeviceLoop.__new__(DeviceLoop)
    loop.graphs, loop.captured, loop.fallback = True, {}, CaptureFallback("the device loop")
    loop.row_indexed, loop.next_entry, loop.ring, loop.most_rounds = False, 0, 4, 1
    loop.dims = SimpleNamespace(proposals=7, verify_proposals=(3, 7))  # a cycle launched without a length verifies P
    loop.backend = SimpleNamespace(plain_runs=contextlib.nullcontext)
    loop.timeline = SimpleNamespace(mark=lambda: 0.0)
    programs, attempts = [], []
    loop._program, loop._download = programs.append, lambda key, owners, entry: None

    def capture(key):
        attempts.append(key)
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    loop._capture = capture
    launches = [(CYCLE, False, [0, 1]), (DECODE, True, [3])]
    with caplog.at_level("WARNING", logger="dflash_trt.runtime.device"):
        for kind, sampled, rows in launches * 2:
            loop.launch(kind, sampled, rows)
    keys = [Key(CYCLE, False, 2, 0, 7), Key(DECODE, True, 1, 3)]
    assert programs == keys * 2 and attempts == keys[:1] and not loop.captured and loop.graphs is False
    warnings = [r.getMessage() for r in caplog.records if "CUDA-graph capture" in r.getMessage()]
    assert len(warnings) == 1 and "cycle program for 2 owners at row 0" in warnings[0] and "not permitted" in warnings[0]


def test_shared_weights_are_one_device_copy_bound_to_every_model_context(tmp_path):
    """Bug: a model engine's context left without the shared embedding / head addresses (TensorRT
    reads garbage weights), each context or engine given its own copy (the memory the shared file
    exists to save), or a shared file changed after the build uploaded as it is."""
    from types import SimpleNamespace

    from dflash_trt.engines.shared_weights import Lifted, write_shared_weights

    tensors = {s.name: torch.randn(s.shape) for s in c.shared_weight_specs(DIMS.vocab_size, 5, DIMS.dtype)}
    record = write_shared_weights(tmp_path, Lifted({}, tensors))
    backend = _opening_backend()
    backend.directory = tmp_path
    backend.engine_set = SimpleNamespace(record=SimpleNamespace(shared_weights=record))
    backend._upload_shared(FakeCuda)
    assert list(backend.shared) == list(c.SHARED_WEIGHTS)
    assert all(torch.equal(backend.shared[name].as_tensor(), t) for name, t in tensors.items())
    for name, route in routes(DIMS).items():
        context = backend._open_context(FakeCuda, RecordingFlavour(), None, route, cuda_graphs=False)
        bound = {n: context.context.addresses.get(n) for n in c.SHARED_WEIGHTS}
        model = route.graph.kind in c.MODEL_KINDS
        assert bound == ({n: backend.shared[n].ptr for n in c.SHARED_WEIGHTS} if model else dict.fromkeys(c.SHARED_WEIGHTS)), name
    (tmp_path / record.file).write_bytes((tmp_path / record.file).read_bytes()[:-1] + b"\0")
    backend.shared = {}
    with pytest.raises(EngineError, match="has sha256 .* engines.json records sha256 .*rebuild the set"):
        backend._upload_shared(FakeCuda)
