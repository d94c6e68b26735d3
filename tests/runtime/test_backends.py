"""Backends: torch and ONNX Runtime agree on every graph of a tiny exported pair, in place.

The exported pair (conftest ``exported_pair``: fp32, max_owners 3, max_context
64) runs through both backends with 5 pool rows, so owner groups sit at rows
other than 0. GPU tests (``-m gpu``) rerun the same script on CUDA: torch
eager vs CUDA graphs vs CPU, and ONNX Runtime's CUDA provider where
onnxruntime-gpu is installed.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from dflash_trt.errors import CudaError, EngineError
from dflash_trt.export import contract as c
from dflash_trt.runtime.backends import BACKENDS, OrtBackend, TensorRTBackend, TorchBackend, open_backend
from dflash_trt.export.torch_dtypes import TORCH_DTYPES

ROWS = 5  # pool rows (> max_owners 3: groups at rows 2..4 too)
ATOL = 1e-4

gpu = pytest.mark.gpu


# ------------------------------------------------------------------ the script


def _feeds(spec: c.GraphSpec, dims: c.Dims, generator: torch.Generator, sizes: dict[str, int], starts: list[int]) -> dict:
    """Deterministic, valid feeds for one graph (independent of earlier outputs, so backends see equal inputs)."""
    n = spec.owners or 1
    P, B, V = dims.proposals, dims.block_size, dims.vocab_size
    feeds = {}
    for s in spec.inputs:
        if s.name.startswith("past_"):
            continue
        shape = s.resolve(sizes)
        if s.dtype != "int64":
            feeds[s.name] = torch.randn(shape, generator=generator, dtype=TORCH_DTYPES[s.dtype])
        else:
            feeds[s.name] = torch.randint(0, V, shape, generator=generator)
    for name in (c.START, c.CTX_START):
        if name in feeds:
            feeds[name] = torch.tensor(starts[:n])
    if c.CTX_COUNT in feeds:
        feeds[c.CTX_COUNT] = torch.tensor([1 + (3 * i) % B for i in range(n)])
    if c.CANDIDATES in feeds:  # agree with the argmax for a prefix of varying length: accepted counts vary
        choices = feeds[c.LOGITS].argmax(-1)
        feeds[c.CANDIDATES][:, 1:] = choices[:, :-1]
        for i in range(n):
            cut = 1 + (2 * i + 1) % P
            feeds[c.CANDIDATES][i, cut] = (choices[i, cut - 1] + 1) % V
    if c.TEMPERATURE in feeds:  # per row (sample) or per owner (verify_sample): greedy, top-k, top-p, untruncated
        rows = feeds[c.TEMPERATURE].shape[0]
        feeds[c.TEMPERATURE] = torch.tensor([(0.0, 0.8, 1.3, 1.0)[i % 4] for i in range(rows)])
        feeds[c.TOP_K] = torch.tensor([(0, 5, 0, 0)[i % 4] for i in range(rows)])
        feeds[c.TOP_P] = torch.tensor([(1.0, 0.9, 0.6, 1.0)[i % 4] for i in range(rows)])
        feeds[c.SEED] = torch.randint(0, 1 << 22, (rows, c.SEED_PARTS), generator=generator)
        feeds[c.POSITION] = torch.tensor([(starts * rows)[i] + 1 for i in range(rows)])
    return feeds


def script(dims: c.Dims) -> list[tuple[str, dict, int]]:
    """(graph, feeds, first_row) for every graph of the set, dynamic ones at two sizes."""
    generator = torch.Generator().manual_seed(0)
    specs = c.graph_specs(dims)
    calls = [
        (c.TARGET_PREFILL, {c.TOKENS_DIM: 6}, [0], 0),
        (c.TARGET_PREFILL, {c.TOKENS_DIM: 3}, [6], 0),
        (c.TARGET_PREFILL, {c.TOKENS_DIM: 10}, [0], 4),
        (c.DRAFT_CONTEXT, {c.CONTEXT_DIM: 9}, [0], 0),
        (c.DRAFT_CONTEXT, {c.CONTEXT_DIM: 2}, [3], 4),
        (c.SAMPLE, {c.ROWS_DIM: 1}, [5], 0),
        (c.SAMPLE, {c.ROWS_DIM: 6}, [5, 9, 30], 0),
    ]
    for n in range(1, dims.max_owners + 1):
        first = ROWS - n
        starts = [9 + 5 * i for i in range(n)]
        for kind in c.STATIC_KINDS:
            calls.append((c.graph_name(kind, n), {}, starts, first))
    return [(name, _feeds(specs[name], dims, generator, sizes, starts), first) for name, sizes, starts, first in calls]


def to(feeds: dict, device) -> dict:
    return {k: v.to(device) for k, v in feeds.items()}


def run_script(backend, dims: c.Dims) -> list[dict[str, torch.Tensor]]:
    """Every call's outputs, copied to the CPU (outputs are only valid until the graph runs again)."""
    results = []
    for name, feeds, first in script(dims):
        out = backend.run(name, to(feeds, backend.device), first)
        results.append({k: v.detach().cpu().clone() for k, v in out.items()})
    backend.synchronize()
    return results


def pool_state(backend) -> dict[str, list[torch.Tensor]]:
    """The sessions' rows of every pool (a row-indexed backend's scratch row past them is not state)."""
    backend.synchronize()
    rows = backend.max_sessions
    return {name: [t[:rows].cpu().clone() for t in pool.keys + pool.values] for name, pool in backend.pools.items()}


def fill_pools(backend, seed: int) -> None:
    """Random pools: a written slot then differs from its old value, so 'changed' shows 'written'."""
    generator = torch.Generator().manual_seed(seed)
    for pool in backend.pools.values():
        for tensor in pool.keys + pool.values:
            sessions = tensor[: backend.max_sessions]  # the same values whether or not a scratch row follows
            sessions.copy_(torch.randn(sessions.shape, generator=generator, dtype=tensor.dtype))
    if backend.device.type == "cuda":
        torch.cuda.synchronize()


def assert_same_outputs(a: list[dict], b: list[dict], calls, atol: float = ATOL) -> None:
    for (name, _, first), x, y in zip(calls, a, b):
        assert x.keys() == y.keys(), name
        for key in x:
            if x[key].dtype == torch.int64:
                assert torch.equal(x[key], y[key]), (name, first, key, x[key], y[key])
            else:
                torch.testing.assert_close(x[key], y[key], atol=atol, rtol=atol, msg=f"{name} row {first} {key}")


def assert_same_pools(a: dict, b: dict, atol: float = ATOL) -> None:
    for name in a:
        for index, (x, y) in enumerate(zip(a[name], b[name])):
            torch.testing.assert_close(x, y, atol=atol, rtol=atol, msg=f"pool {name} tensor {index}")


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def pair(exported_pair):
    """(target_dir, draft_dir, export_dir, dims) of conftest's exported pair."""
    return exported_pair.target_dir, exported_pair.draft_dir, exported_pair.out, exported_pair.manifest.dims()


@pytest.fixture(scope="module")
def torch_cpu(pair):
    target_dir, draft_dir, out_dir, _ = pair
    with TorchBackend.from_checkpoints(target_dir, draft_dir, out_dir, max_sessions=ROWS) as backend:
        yield backend


@pytest.fixture(scope="module")
def ort_cpu(pair):
    with OrtBackend.from_export(pair[2], max_sessions=ROWS, threads=2) as backend:
        yield backend


@pytest.fixture(params=["torch", "onnxruntime"])
def backend(request, torch_cpu, ort_cpu):
    return {"torch": torch_cpu, "onnxruntime": ort_cpu}[request.param]


# ------------------------------------------------------------------ CPU


def test_torch_and_onnxruntime_agree_on_every_graph(pair, torch_cpu, ort_cpu):
    """Bug: an exported graph computes something else than its PyTorch module (outputs or cache writes),
    or a backend binds the wrong rows / drops the in-place cache update."""
    dims = pair[3]
    assert {name for name, _, _ in script(dims)} == set(c.graph_names(dims.max_owners))
    for backend in (torch_cpu, ort_cpu):
        fill_pools(backend, seed=1)
    a, b = run_script(torch_cpu, dims), run_script(ort_cpu, dims)
    assert_same_outputs(a, b, script(dims))
    assert_same_pools(pool_state(torch_cpu), pool_state(ort_cpu))
    assert ort_cpu.copied_outputs == 0  # ONNX Runtime wrote every output where it was bound


def _written(spec: c.GraphSpec, feeds: dict, dims: c.Dims) -> list[tuple[int, int]]:
    """Per owner, the slot range [lo, hi) a graph writes."""
    if spec.kind == c.DRAFT:
        count = feeds[c.CTX_COUNT].tolist()
        return [(s, s + k + dims.block_size) for s, k in zip(feeds[c.CTX_START].tolist(), count)]
    tokens = feeds[c.TOKENS if c.TOKENS in feeds else c.TAPS].shape[1]
    return [(s, s + tokens) for s in feeds[c.START].tolist()]


@pytest.mark.parametrize("graph", ["target_prefill", "draft_context", "target_verify_2", "target_decode_3", "draft_2", "draft_3"])
def test_in_place_writes_touch_only_the_owners_slots(pair, backend, graph):
    """Bug: a graph writes other sessions' rows, slots outside its tokens, or the other pool
    (e.g. a view that is not at first_row, a copy-back of a whole row, a padding row landing past the block)."""
    dims = pair[3]
    name, feeds, first = next(call for call in script(dims) if call[0] == graph)
    spec = c.graph_spec(dims, name)
    fill_pools(backend, seed=2)
    before = pool_state(backend)
    backend.run(name, to(feeds, backend.device), first)
    after = pool_state(backend)
    pool = "target" if spec.kind in (c.TARGET_PREFILL, c.TARGET_VERIFY, c.TARGET_DECODE) else "draft"
    expected = torch.zeros(ROWS, dims.max_context, dtype=torch.bool)
    for owner, (lo, hi) in enumerate(_written(spec, feeds, dims)):
        expected[first + owner, lo:hi] = True
    for name_, tensors in after.items():
        for index, (old, new) in enumerate(zip(before[name_], tensors)):
            changed = (old != new).any(dim=3).any(dim=1)  # [rows, slots]
            want = expected if name_ == pool else torch.zeros_like(expected)
            assert torch.equal(changed, want), (graph, name_, index, changed.nonzero().tolist())


def test_copy_rows_copies_the_prefix_of_one_row(backend):
    """Bug: clone copies too many slots (clobbering the copy's tail), the wrong row, or only one layer/pool."""
    fill_pools(backend, seed=3)
    before = pool_state(backend)
    backend.copy_rows("target", 1, 3, 5)
    backend.copy_rows("draft", 4, 0, 7)
    backend.copy_rows("draft", 2, 2, 9)  # onto itself: no change
    backend.copy_rows("target", 0, 2, 0)  # nothing
    after = pool_state(backend)
    for pool, (source, destination, upto) in (("target", (1, 3, 5)), ("draft", (4, 0, 7))):
        for old, new in zip(before[pool], after[pool]):
            expected = old.clone()
            expected[destination, :, :upto] = old[source, :, :upto]
            assert torch.equal(new, expected), pool


def test_copy_rows_refuses_out_of_range(backend):
    """Bug: a bad clone request (row past the pool, upto past max_context) corrupts memory instead of raising."""
    before = pool_state(backend)
    with pytest.raises(EngineError, match="destination row"):
        backend.copy_rows("target", 0, ROWS, 1)
    with pytest.raises(EngineError, match="upto"):
        backend.copy_rows("draft", 0, 1, 10_000)
    with pytest.raises(EngineError, match="pool"):
        backend.copy_rows("context", 0, 1, 1)
    assert_same_pools(before, pool_state(backend), atol=0)


def test_bad_feeds_are_refused_before_anything_runs(pair, backend):
    """Bug: a feed of the wrong shape/dtype/device or a first_row past the pool reaches the engine
    (silent garbage, or a write into another session's row)."""
    dims = pair[3]
    name, feeds, first = next(call for call in script(dims) if call[0] == "target_verify_2")
    feeds = to(feeds, backend.device)
    before = pool_state(backend)
    cases = [
        ({k: v for k, v in feeds.items() if k != c.START}, first, "missing"),
        (feeds | {c.START: feeds[c.START].int()}, first, "dtype"),
        (feeds | {c.TOKENS: feeds[c.TOKENS][:, :3]}, first, "shape"),
        (feeds | {"extra": feeds[c.START]}, first, "not inputs"),
        (feeds, ROWS - 1, "first_row"),
    ]
    for bad, row, message in cases:
        with pytest.raises(EngineError, match=message):
            backend.run(name, bad, row)
    prefill = {c.TOKENS: torch.zeros(1, dims.max_chunk + 1, dtype=torch.int64), c.START: torch.zeros(1, dtype=torch.int64)}
    with pytest.raises(EngineError, match=r"dim 'T' must be in"):
        backend.run(c.TARGET_PREFILL, to(prefill, backend.device), 0)
    with pytest.raises(EngineError, match="unknown graph"):
        backend.run("target_verify_9", feeds, 0)
    assert_same_pools(before, pool_state(backend), atol=0)


def test_ort_refuses_a_file_with_other_io(pair, tmp_path):
    """Bug: a graph file swapped for another graph's (same directory, wrong name) runs with misbound inputs."""
    _, _, out_dir, dims = pair
    from dflash_trt.export.manifest import load_manifest

    files = {name: out_dir / g.file for name, g in load_manifest(out_dir, verify="none").graphs.items()}
    files["target_model"] = files["draft_model"]
    with OrtBackend(files, dims, ROWS, lazy=True) as backend:
        with pytest.raises(EngineError, match="target_model.*declares inputs"):
            backend.run("target_verify_1", {}, 0)


def test_open_backend_by_name(pair):
    """Bug: the factory maps a name to the wrong class or accepts an unknown backend silently."""
    assert set(BACKENDS) == {"torch", "onnxruntime", "tensorrt"}
    with open_backend("onnxruntime", pair[2], max_sessions=ROWS, lazy=True) as backend:
        assert isinstance(backend, OrtBackend) and backend.pools["target"].keys[0].shape[0] == ROWS
    with pytest.raises(EngineError, match="backend must be one of"):
        open_backend("tensorflow", pair[2])


CLOSURE = """
import json, sys
from dflash_trt.runtime.executor import Executor
from dflash_trt.runtime.backends import open_backend
with open_backend("onnxruntime", sys.argv[1], max_sessions=2, lazy=True) as backend:
    pass
print(json.dumps(sorted(sys.modules)))
"""


def test_runtime_import_closure_excludes_the_model_stack(pair):
    """Bug: the executor or the ONNX Runtime backend pulls in the PyTorch model stack (target, draft,
    layers) or safetensors, e.g. through a shared dataclass or an eager import of every backend."""
    result = subprocess.run([sys.executable, "-c", CLOSURE, str(pair[2])], capture_output=True, text=True, check=True)
    loaded = set(json.loads(result.stdout.splitlines()[-1]))
    assert "dflash_trt.runtime.backends.ort_backend" in loaded
    heavy = ["dflash_trt.export.target", "dflash_trt.export.draft", "dflash_trt.export.layers", "safetensors"]
    heavy += ["dflash_trt.runtime.backends.torch_backend", "dflash_trt.runtime.backends.trt_backend"]
    assert [name for name in heavy if name in loaded] == []


def test_pools_are_allocated_once_at_fixed_addresses(backend, pair):
    """Bug: a run reallocates a pool (engines, bindings and CUDA graphs would keep the old address)."""
    addresses = [t.data_ptr() for pool in backend.pools.values() for t in pool.keys + pool.values]
    name, feeds, first = script(pair[3])[0]
    backend.run(name, to(feeds, backend.device), first)
    assert addresses == [t.data_ptr() for pool in backend.pools.values() for t in pool.keys + pool.values]


def test_onnxruntime_binds_again_only_what_moved(pair, torch_cpu):
    """Guards against a run computing on stale bindings (a new call's feeds, or another row's caches, left at
    the last call's addresses) and against binding every tensor again on every run (~5 µs each, ~40 per target
    graph: most of a decode step's host time): a repeat on the same rows binds its new feeds only, a run on other
    rows binds their caches too, and every run's outputs and writes equal the torch backend's."""
    dims = pair[3]
    graph, n = c.graph_name(c.TARGET_DECODE, 2), 2
    with OrtBackend.from_export(pair[2], max_sessions=ROWS, threads=1) as ort:
        session, bound = ort._session(graph), []
        for method in ("bind_input", "bind_output"):
            real = getattr(session.binding, method)
            setattr(session.binding, method, lambda name, *rest, real=real: (bound.append(name), real(name, *rest))[1])
        fill_pools(ort, seed=3)
        fill_pools(torch_cpu, seed=3)
        caches = {s.name for s in session.spec.cache_inputs} | {c.present_of(s.name) for s in session.spec.cache_inputs}
        generator = torch.Generator().manual_seed(4)
        for first, want in ((0, None), (0, {c.TOKENS, c.START}), (2, {c.TOKENS, c.START} | caches), (2, {c.TOKENS, c.START})):
            feeds = _feeds(session.route.run, dims, generator, {}, [9 + 5 * i for i in range(n)])
            bound.clear()
            out = ort.run(graph, feeds, first)
            if want is not None:
                assert set(bound) == want, (first, sorted(bound))
            assert_same_outputs([out], [torch_cpu.run(graph, feeds, first)], [(graph, feeds, first)])
        assert_same_pools(pool_state(ort), pool_state(torch_cpu))


class _Log:
    """A stream and a pool that write what is done to them into one shared list."""

    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def synchronize(self) -> None:
        self.log.append(f"{self.name} synchronize")

    def close(self) -> None:
        self.log.append(f"{self.name} close")


class _Owning(OrtBackend):
    """An ONNX Runtime backend whose stream and pools are logged, and whose own resources log their close."""

    def _close_own(self) -> None:
        self.log.append("own")
        super()._close_own()


def test_close_syncs_then_frees_own_resources_pools_and_stream_once(pair):
    """Bug: the shared close frees the pools (or the stream) before the host sync, while enqueued work
    may still write them; skips a backend's own resources; or frees something twice on a second
    close (a double free of device memory)."""
    backend = _Owning.from_export(pair[2], max_sessions=ROWS, lazy=True)
    name, feeds, first = script(pair[3])[0]
    backend.run(name, feeds, first)
    assert backend.sessions and backend.models
    for pool in backend.pools.values():
        pool.close()  # the real memory, freed here; the backend then closes the logged stand-ins
    backend.log = log = []
    backend.stream = _Log(log, "stream")
    backend.pools = {name: _Log(log, name) for name in ("target", "draft")}
    backend.close()
    assert log == ["stream synchronize", "own", "target close", "draft close", "stream close"]
    assert backend.pools is None and backend.stream is None and not backend.sessions and not backend.models
    backend.close()
    assert log[5:] == ["own"]  # a second close frees nothing again
    with pytest.raises(EngineError, match="closed"):
        backend.run(name, feeds, first)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_tensorrt_backend_refuses_without_gpu(tmp_path):
    """Bug: the tensorrt backend dies deep inside TensorRT/CUDA (or hangs) where there is no GPU."""
    with pytest.raises(CudaError, match="needs a CUDA GPU"):
        TensorRTBackend(tmp_path)
    with pytest.raises(EngineError, match="CUDA devices only"):
        TensorRTBackend(tmp_path, device="cpu")


# ------------------------------------------------------------------ GPU


@pytest.fixture(scope="module")
def cpu_reference(pair, torch_cpu):
    fill_pools(torch_cpu, seed=1)
    outputs = run_script(torch_cpu, pair[3])
    return outputs, pool_state(torch_cpu)


def _torch_cuda(pair, cuda_graphs: bool, kernels: str = "auto") -> TorchBackend:
    target_dir, draft_dir, out_dir, _ = pair
    return TorchBackend.from_checkpoints(target_dir, draft_dir, out_dir, max_sessions=ROWS, device="cuda", cuda_graphs=cuda_graphs, kernels=kernels)


@gpu
@pytest.mark.parametrize("cuda_graphs,kernels", [(False, "fast"), (True, "fast"), (True, "eager"), (True, "exact")])
def test_torch_cuda_matches_cpu(pair, cpu_reference, cuda_graphs, kernels):
    """Bug: the CUDA path (device-layer pools, backend stream, CUDA-graph replay, the fast or exact kernels)
    computes or writes something else than the CPU reference: fp32 proposals (tokens) must be equal."""
    with _torch_cuda(pair, cuda_graphs, kernels) as backend:
        assert backend.kernels == kernels
        assert all(pool.owners for pool in backend.pools.values())  # device-layer memory
        assert backend.pools["target"].keys[0].data_ptr() == backend.pools["target"].owners[0].ptr
        fill_pools(backend, seed=1)
        outputs = run_script(backend, pair[3])
        assert_same_outputs(cpu_reference[0], outputs, script(pair[3]), atol=1e-3)
        assert_same_pools(cpu_reference[1], pool_state(backend), atol=1e-3)


@gpu
def test_cuda_graph_replays_equal_eager_across_rows_and_repeats(pair):
    """Bug: a replay reads stale static inputs, writes the rows of the captured first_row, or returns
    outputs from another capture; static outputs must keep their addresses."""
    dims = pair[3]
    with _torch_cuda(pair, False) as eager, _torch_cuda(pair, True) as graphs:
        for backend in (eager, graphs):
            fill_pools(backend, seed=4)
        for _ in range(2):  # second pass: replays only (the pools have moved on)
            a, b = run_script(eager, dims), run_script(graphs, dims)
            assert_same_outputs(a, b, script(dims), atol=1e-5)
        assert_same_pools(pool_state(eager), pool_state(graphs), atol=1e-5)
        name, feeds, first = next(call for call in script(dims) if call[0] == "target_verify_2")
        one = graphs.run(name, to(feeds, "cuda"), first)
        two = graphs.run(name, to(feeds, "cuda"), first - 1)
        assert {k: v.data_ptr() for k, v in one.items()} == {k: v.data_ptr() for k, v in two.items()}
        assert len(graphs.graphs.captured) >= len(c.STATIC_KINDS) * dims.max_owners


@gpu
def test_onnxruntime_cuda_provider_matches_cpu(pair, cpu_reference):
    """Bug: with the CUDA provider, caches bound by raw device pointer are copied instead of written in place,
    or ORT runs on another stream than the one the feeds were ordered on."""
    import onnxruntime

    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        pytest.skip("onnxruntime-gpu is not installed (CPU onnxruntime only)")
    with OrtBackend.from_export(pair[2], max_sessions=ROWS, device="cuda") as backend:
        fill_pools(backend, seed=1)
        outputs = run_script(backend, pair[3])
        assert_same_outputs(cpu_reference[0], outputs, script(pair[3]), atol=1e-3)
        assert_same_pools(cpu_reference[1], pool_state(backend), atol=1e-3)
        assert backend.copied_outputs == 0


@gpu
def test_onnxruntime_cuda_refused_without_the_provider():
    """Bug: device='cuda' with CPU-only onnxruntime silently falls back to the CPU provider."""
    import onnxruntime

    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        pytest.skip("onnxruntime-gpu is installed")
    from dflash_trt.runtime.backends.ort_backend import _require_cuda_provider

    with pytest.raises(EngineError, match="onnxruntime-gpu"):
        _require_cuda_provider(onnxruntime)


def test_onnxruntime_holds_torch_threads_while_open_and_gives_them_back(pair, tmp_path):
    """Guards against torch's OpenMP pool spinning on the cores ONNX Runtime computes on (the executor's glue copies
    between runs: the main job's DFlash prefill ran ~40 ms slower) and against the setting outliving the backend:
    ``torch_threads`` holds while the backend is open, torch's count before comes back at close (a failed open
    included), nothing changes without it, and a bad value is a typed error naming the field and the value."""
    before = torch.get_num_threads()
    held = before + 1  # the suite runs torch at one thread (conftest): a count that differs from it
    with OrtBackend.from_export(pair[2], max_sessions=ROWS, threads=1, torch_threads=held):
        assert torch.get_num_threads() == held
    assert torch.get_num_threads() == before
    with OrtBackend.from_export(pair[2], max_sessions=ROWS, threads=1):
        assert torch.get_num_threads() == before
    with pytest.raises(EngineError, match=r"torch_threads must be an int >= 1 or None, got 0"):
        OrtBackend.from_export(pair[2], max_sessions=ROWS, torch_threads=0)
    broken = tmp_path / "export"
    shutil.copytree(pair[2], broken)
    next(broken.glob("draft*.onnx")).write_bytes(b"not a graph")  # fails while the sessions load, torch_threads set
    with pytest.raises(EngineError):
        OrtBackend.from_export(broken, max_sessions=ROWS, verify="none", torch_threads=held)
    assert torch.get_num_threads() == before
