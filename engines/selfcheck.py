"""``dflash-trt selfcheck``: run every engine on random inputs, compare with ONNX Runtime.

    dflash-trt selfcheck --engines DIR --onnx DIR [--backend tensorrt|tensorrt_rtx]
                         [--seed N] [--int-range LOW HIGH] [--only NAME ...]

For a user with a GPU the engines support (TensorRT: the build GPU or
Ampere+; TensorRT-RTX: SM80..SM121, not Hopper). It loads the set through the
checking loader, then per engine and per optimization profile (a model
engine has one per run graph it computes): random feeds from the contract
(dynamic dims at the profile's opt value, less room for the integer feeds;
floats uniform in [0, 1), integers uniform in [LOW, HIGH) so token ids
stay valid for any export; ``picks`` within the rows fed; the cache writes
at a different start per owner, the last one ending at the cache's end,
``owner_feeds``: a lower-right diagonal anchored anywhere but at each
owner's own length shows), runs the engine (execute_async_v3 over CUDA
buffers bound with set_tensor_address; cache outputs alias their inputs, as
the runtime binds them; the model engines read the set's shared weights)
and the exact ONNX graph in ONNX Runtime on the same
feeds (CUDA provider where onnxruntime-gpu is installed: the CPU provider
cannot run bf16 graphs), and compares every output.

Buffers are torch tensors: ONNX Runtime binds the same bf16 buffers by
pointer, which numpy cannot hold. Not runnable on a CPU-only machine; it
says so instead of failing inside TensorRT.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_trt.engines.bindings import FLOAT_PRECISION, compute_dtype
from dflash_trt.engines.command import AUTO
from dflash_trt.engines.execute import execute
from dflash_trt.engines.flavour import FLAVOURS, Flavour, load_flavour
from dflash_trt.engines.load import load_engine_set
from dflash_trt.engines.shared_weights import read_shared_weights
from dflash_trt.engines.sources import GraphSource, export_sources
from dflash_trt.errors import EngineError
from dflash_trt.export.contract import (
    CTX_COUNT,
    CTX_START,
    CTX_TAPS,
    MODEL_KINDS,
    ONNX_ELEMENT_TYPES,
    PICKS,
    START,
    STEP_DIM,
    TOKENS,
    DimRange,
    GraphSpec,
    TensorSpec,
    present_of,
    profiles_of,
)
from dflash_trt.export.manifest import load_manifest
from dflash_trt.export.torch_dtypes import TORCH_DTYPES

# (rtol, atol) per compute dtype: engines fuse and reorder, so they round differently. An
# output is held to the coarser of its own dtype and its graph's (``compute_dtype``): a bf16
# graph's fp32 logits carry bf16 rounding.
TOLERANCES = {"float32": (1e-3, 1e-3), "float16": (1e-2, 1e-2), "bfloat16": (5e-2, 5e-2)}


@dataclass(frozen=True)
class OutputCheck:
    engine: str
    output: str
    ok: bool
    detail: str  # max |diff| for floats, mismatching elements for ints/bools
    skipped: bool = False  # the engine is not in the set (only sampled sessions need it)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engines", type=Path, required=True, help="engine-set directory (engines.json + plans)")
    parser.add_argument("--onnx", type=Path, required=True, help="the export directory the set was built from")
    parser.add_argument(
        "--backend", choices=[AUTO, *FLAVOURS], default=AUTO, help="TensorRT runtime; auto: the one engines.json names (or a lean/dispatch runtime)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--int-range", type=int, nargs=2, default=(1, 3), metavar=("LOW", "HIGH"))
    parser.add_argument("--only", action="append", default=[], help="check only this engine, repeatable")


def run(args: argparse.Namespace) -> int:
    require_gpu()
    flavour = None if args.backend == AUTO else load_flavour(args.backend)
    sources, _manifest = export_sources(args.onnx)
    block = load_manifest(args.onnx, verify="none").block_size
    checks = selfcheck(args.engines, sources, flavour, args.seed, tuple(args.int_range), set(args.only), block)
    for check in checks:
        label = "skip" if check.skipped else "ok  " if check.ok else "FAIL"
        print(f"{label} {check.engine}.{check.output}: {check.detail}")
    failed = [c for c in checks if not c.ok]
    skipped = sum(c.skipped for c in checks)
    print(f"{len(checks) - len(failed) - skipped} passed, {len(failed)} failed, {skipped} skipped")
    return 1 if failed else 0


def require_gpu() -> None:
    if not torch.cuda.is_available():
        msg = (
            "selfcheck runs every engine on a CUDA GPU and none is visible here (torch.cuda.is_available() is False). "
            "On a CPU-only machine `dflash-trt build` checks that every graph compiles; run selfcheck where the engines can run."
        )
        raise EngineError(msg)


def selfcheck(
    engines_dir: Path,
    sources: list[GraphSource],
    flavour: Flavour | None,
    seed: int,
    int_range: tuple[int, int],
    only: set[str],
    block: int = 0,
) -> list[OutputCheck]:
    """Load (with every check), run each engine and its graph, compare outputs."""
    contract = {s.name: s.io for s in sources}
    loaded = load_engine_set(engines_dir, contract, flavour)
    flavour = loaded.flavour
    checks: list[OutputCheck] = []
    try:
        shared = loaded.record.shared_weights
        weights = read_shared_weights(engines_dir, shared) if shared is not None else {}
        for index, source in enumerate(sources):
            if only and source.name not in only:
                continue
            if source.name not in loaded.engines:  # a greedy-only set: not built, engines.json says why
                why = loaded.record.skipped.get(source.name, "not in the engine set")
                checks.append(OutputCheck(source.name, "*", True, f"skipped at build: {why}", skipped=True))
                continue
            mine = weights if source.io.kind in MODEL_KINDS else {}
            checks.extend(check_one(flavour, loaded.engines[source.name], source, seed + index, int_range, engines_dir, block, mine))
    finally:
        loaded.close()
    return checks


def check_one(
    flavour: Flavour, engine, source: GraphSource, seed: int, int_range, cache_dir: Path, block: int = 0, weights: Mapping[str, torch.Tensor] | None = None
) -> list[OutputCheck]:
    """One engine against its graph at every profile; a run that fails is one failed check, not
    the end of the selfcheck. Checks of a model engine are named ``engine[run graph]``; its
    engine is fed the set's shared ``weights`` too (the graph holds them)."""
    profiles = profiles_of(source.io)
    checks = []
    for index, profile in enumerate(profiles or (None,)):
        dims = None if profile is None else profile.dims
        label = source.name if len(profiles) <= 1 else f"{source.name}[{profile.graph}]"
        cache_name = source.name if len(profiles) <= 1 else f"{source.name}.{profile.graph}"
        feeds = random_feeds(source.io, seed, int_range, dims, block)
        try:
            engine_out = execute(flavour, engine, feeds | dict(weights or {}), cache_aliases(source.io), torch.device("cuda"), Path(cache_dir), cache_name, index)
            reference = run_reference(source, feeds)
        except EngineError as error:
            checks.append(OutputCheck(label, "*", False, str(error)))
            continue
        checks.extend(compare(label, source.io, engine_out, reference))
    return checks


def cache_aliases(io: GraphSpec) -> dict[str, str]:
    """present_* output -> the past_* input whose buffer it is written into (the contract's rule)."""
    return {present_of(spec.name): spec.name for spec in io.cache_inputs}


def dynamic_sizes(io: GraphSpec, int_range: tuple[int, int], dims: Mapping[str, DimRange] | None = None) -> dict[str, int]:
    """Each dynamic dim at its opt value (in ``dims``, one profile's ranges; default the graph's),
    but leaving room for the integer feeds: a prefill chunk of T rows written at ``start`` must
    fit the cache (start + T <= max_context), and max_chunk may equal max_context."""
    headroom = int_range[1] - 1  # the largest integer fed
    return {d: max(r.min, min(r.opt, r.max - headroom)) for d, r in (io.dims if dims is None else dims).items()}


def concrete_shape(io: GraphSpec, spec: TensorSpec, sizes: Mapping[str, int]) -> tuple[int, ...]:
    return tuple(sizes[d] if isinstance(d, str) else d for d in spec.shape)


def random_feeds(
    io: GraphSpec, seed: int, int_range: tuple[int, int], dims: Mapping[str, DimRange] | None = None, block: int = 0
) -> dict[str, torch.Tensor]:
    """Host tensors for every input of ``io`` at one profile's shapes (``dims``; default the
    graph's ranges); see the module doc for value ranges. Cache writes start per owner
    (``owner_feeds``; ``block``: the draft's block size, kept free after its context rows)."""
    generator = torch.Generator().manual_seed(seed)
    sizes = dynamic_sizes(io, int_range, dims)
    feeds = {}
    for spec in io.inputs:
        shape, dtype = concrete_shape(io, spec, sizes), TORCH_DTYPES[spec.dtype]
        if dtype.is_floating_point:
            feeds[spec.name] = torch.rand(shape, generator=generator).to(dtype)
        elif dtype == torch.bool:
            feeds[spec.name] = torch.rand(shape, generator=generator) < 0.5
        elif spec.name == PICKS:  # row indices into the S tokens of each owner
            feeds[spec.name] = torch.randint(0, sizes[STEP_DIM], shape, generator=generator, dtype=dtype)
        else:
            feeds[spec.name] = torch.randint(*int_range, shape, generator=generator, dtype=dtype)
    return feeds | owner_feeds(io, feeds, block)


def owner_starts(owners: int, room: int) -> list[int]:
    """Every owner at another slot, spread over [0, room], the last AT ``room`` (its rows end
    where the cache ends); none at 0 unless room is 0. The slot a row's length and causal
    diagonal are anchored at differs per owner, as the runtime's sessions' do."""
    return [room * (i + 1) // owners for i in range(owners)]


def owner_feeds(io: GraphSpec, feeds: Mapping[str, torch.Tensor], block: int = 0) -> dict[str, torch.Tensor]:
    """The cache-writing inputs at non-trivial starts per owner: a target graph's ``start``
    (``owner_starts`` over L - S), a draft's ``ctx_start`` (over L - C - B: its context rows
    and block fit) with ``ctx_count`` C, C-1, ... (at least 1). Graphs without caches: nothing."""
    length = next((int(s.shape[2]) for s in io.cache_inputs), None)
    if length is None:
        return {}
    if START in feeds and TOKENS in feeds:
        owners, tokens = feeds[TOKENS].shape
        return {START: torch.tensor(owner_starts(owners, length - tokens), dtype=torch.int64)}
    if CTX_START not in feeds:
        return {}
    owners, rows, _ = feeds[CTX_TAPS].shape
    counts = [max(1, rows - i) for i in range(owners)]
    return {
        CTX_START: torch.tensor(owner_starts(owners, max(0, length - rows - block)), dtype=torch.int64),
        CTX_COUNT: torch.tensor(counts, dtype=torch.int64),
    }


def run_reference(source: GraphSource, feeds: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The exact ONNX graph in ONNX Runtime, buffers bound by pointer (bf16-safe)."""
    import onnxruntime as ort

    cuda = "CUDAExecutionProvider" in ort.get_available_providers()
    device = "cuda" if cuda else "cpu"
    providers = ["CUDAExecutionProvider"] if cuda else ["CPUExecutionProvider"]
    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors only: TensorScatter's copy notice is expected here
    session = ort.InferenceSession(str(source.onnx_path), options, providers=providers)
    binding = session.io_binding()
    inputs = {name: tensor.to(device).contiguous() for name, tensor in feeds.items()}  # kept alive until run ends
    for name, tensor in inputs.items():
        binding.bind_input(name, device, 0, ONNX_ELEMENT_TYPES[_spec(source.io, name).dtype], list(tensor.shape), tensor.data_ptr())
    # Dynamic output extents follow the inputs: read the fed sizes back off them.
    sizes = {d: feeds[s.name].shape[axis] for s in source.io.inputs for axis, d in enumerate(s.shape) if isinstance(d, str)}
    outputs = {}
    for spec in source.io.outputs:
        outputs[spec.name] = torch.empty(concrete_shape(source.io, spec, sizes), dtype=TORCH_DTYPES[spec.dtype], device=device)
        tensor = outputs[spec.name]
        binding.bind_output(spec.name, device, 0, ONNX_ELEMENT_TYPES[spec.dtype], list(tensor.shape), tensor.data_ptr())
    try:
        session.run_with_iobinding(binding)
    except Exception as error:  # onnxruntime raises its own exception types
        msg = f"ONNX Runtime ({providers[0]}) could not run {source.onnx_path.name}: {error}"
        raise EngineError(msg) from error
    return {name: tensor.cpu() for name, tensor in outputs.items()}


def _spec(io: GraphSpec, name: str) -> TensorSpec:
    return next(s for s in io.inputs if s.name == name)


def compare(engine: str, io: GraphSpec, got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> list[OutputCheck]:
    checks = []
    for spec in io.outputs:
        a, b = got[spec.name], want[spec.name]
        if a.shape != b.shape:
            checks.append(OutputCheck(engine, spec.name, False, f"shape {list(a.shape)} vs reference {list(b.shape)}"))
        elif spec.dtype in TOLERANCES:
            rtol, atol = TOLERANCES[max(spec.dtype, compute_dtype(io), key=FLOAT_PRECISION.index)]
            diff = (a.float() - b.float()).abs().max().item() if a.numel() else 0.0
            ok = torch.allclose(a.float(), b.float(), rtol=rtol, atol=atol, equal_nan=True)
            checks.append(OutputCheck(engine, spec.name, ok, f"max |diff| {diff:.3g} (rtol {rtol}, atol {atol})"))
        else:
            bad = int((a != b).sum())
            checks.append(OutputCheck(engine, spec.name, bad == 0, f"{bad} of {a.numel()} elements differ"))
    return checks
