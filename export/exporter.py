"""Export a target + DFlash draft pair: every graph of the contract + manifest.json.

``export_pair(target_dir, draft_dir, out_dir, options)`` loads both
checkpoints in the export dtype, wires the models to ``OnnxKernels``, traces
one ``graphs`` wrapper per contract graph (``torch.export``, then
``torch.onnx.export`` at opset 24), checks each file (``onnx.checker`` and its
IO against the contract) and writes the manifest last: a directory with a
valid manifest is a complete export. When the manifest's ``export_key``
already matches the inputs (checkpoints, options, versions, exporting code),
nothing is re-exported. With ``shared_weights`` (default above 1 GiB of
checkpoint), every graph's large initializers point into one ``weights.data``
holding each distinct tensor once (``weights.SharedWeights``).
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import onnx
import onnx_ir as ir
import torch
from tqdm import tqdm

import dflash_trt
from dflash_trt.checks import is_int
from dflash_trt.errors import ExportError, ManifestError
from dflash_trt.export import contract, graph_passes, identity
from dflash_trt.export.config import check_pair, load_draft_config, load_target_config
from dflash_trt.export.contract import DTYPES, Dims, GraphSpec
from dflash_trt.export.draft import DraftModel
from dflash_trt.export.graph_modules import graph_module
from dflash_trt.export.manifest import (
    MANIFEST_FILE,
    VERIFY_HASH,
    Geometry,
    GraphFile,
    Manifest,
    SCHEMA_VERSION,
    SpecialTokens,
    load_manifest,
    write_manifest,
)
from dflash_trt.export.onnx_io import declared_io, external_data_files, load_graph
from dflash_trt.export.onnx_kernels import CAUSAL_LENGTHS, CAUSAL_MODES, OPSET, TRANSLATIONS, OnnxKernels
from dflash_trt.export.pair import load_pair
from dflash_trt.export.target import TargetModel
from dflash_trt.export.tokenizer import copy_tokenizer, tokenizer_files
from dflash_trt.export.torch_dtypes import TORCH_DTYPES
from dflash_trt.export.weights import SharedWeights

IR_VERSION = 10  # what torch writes today; ONNX Runtime reads <= 13
DEFAULT_MAX_CONTEXT = 4096
DEFAULT_MAX_CHUNK = 512
TRACE_SIZE = 2  # example extent of a dynamic dim while tracing (1 would specialize)
SHARED_WEIGHTS_MIN_BYTES = 1 << 30


@dataclass(frozen=True)
class ExportOptions:
    """The knobs of an export; ``None`` means the default, resolved per pair."""

    max_owners: int = 4
    max_sessions: int | None = None  # default: max_owners
    max_context: int | None = None  # default: min(4096, target max_position_embeddings)
    max_chunk: int | None = None  # default: min(512, max_context - block_size)
    proposals: int | None = None  # default: block_size - 1
    verify_proposals: tuple[int, ...] | None = None  # verify lengths below P (P is always one); default: contract.default_verify_proposals
    dtype: str = "bf16"
    causal: str = CAUSAL_LENGTHS
    shared_weights: bool | None = None  # one weights.data for all graphs; default: when the pair is > 1 GiB
    live_keys: bool = False  # attention reads the live cache slots only (ONNX Runtime's configuration: ``graph_passes``)

    def resolve(self, target_dir: str | Path, draft_dir: str | Path) -> ExportOptions:
        """Defaults filled in from the pair's configs; every value range-checked."""
        target, draft = load_target_config(target_dir), load_draft_config(draft_dir)
        check_pair(target, draft)
        block = draft.block_size
        max_context = self.max_context or min(DEFAULT_MAX_CONTEXT, target.max_position_embeddings)
        shared = self.shared_weights
        if shared is None:
            shared = _pair_bytes(target_dir, draft_dir) > SHARED_WEIGHTS_MIN_BYTES
        proposals = self.proposals or block - 1
        resolved = replace(
            self,
            max_sessions=self.max_sessions or self.max_owners,
            max_context=max_context,
            max_chunk=self.max_chunk or min(DEFAULT_MAX_CHUNK, max_context - block),
            proposals=proposals,
            verify_proposals=verify_lengths(self.verify_proposals, proposals),
            shared_weights=shared,
        )
        resolved._check(block)
        return resolved

    def _check(self, block: int) -> None:
        checks = [
            ("max_owners", self.max_owners, 1, None),
            ("max_sessions", self.max_sessions, self.max_owners, None),
            ("max_context", self.max_context, 2 * block, None),  # draft_n's fused write spans 2B slots
            # draft_model writes a chunk and a block in one C+B window of the cache
            ("max_chunk", self.max_chunk, TRACE_SIZE, self.max_context - block),
            ("proposals", self.proposals, contract.MIN_PROPOSALS, block - 1),
        ]
        for name, value, low, high in checks:
            if not is_int(value) or value < low or (high is not None and value > high):
                valid = f"[{low}, {high}]" if high is not None else f">= {low}"
                raise ExportError(f"export option {name} must be an int {valid}, got {value!r}")
        if not contract.check_verify_lengths(self.verify_proposals, self.proposals):
            msg = f"export option verify_proposals must be distinct ints in [{contract.MIN_PROPOSALS}, {self.proposals}] (proposals), got {self.verify_proposals!r}"
            raise ExportError(msg)
        if self.dtype not in DTYPES:
            raise ExportError(f"export option dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.causal not in CAUSAL_MODES:
            raise ExportError(f"export option causal must be one of {CAUSAL_MODES}, got {self.causal!r}")
        if not isinstance(self.live_keys, bool):
            raise ExportError(f"export option live_keys must be a bool, got {self.live_keys!r}")


def verify_lengths(given: tuple[int, ...] | None, proposals: int) -> tuple[int, ...] | list:
    """The verify lengths of an export: ``given`` (any order) with P added, or the contract's default;
    ``given`` unchanged when it holds anything but ints (``_check`` refuses it, naming the value)."""
    if given is None:
        return contract.default_verify_proposals(proposals)
    if not all(is_int(k) for k in given):
        return list(given)
    return tuple(sorted(set(given) | {proposals}))


def _pair_bytes(target_dir: str | Path, draft_dir: str | Path) -> int:
    return sum(f.stat().st_size for d in (target_dir, draft_dir) for f in Path(d).glob("*.safetensors"))


def tool_versions() -> dict[str, str]:
    import onnxruntime
    import onnxscript

    return {
        "dflash_trt": dflash_trt.__version__,
        "torch": torch.__version__,
        "onnx": onnx.__version__,
        "onnxruntime": onnxruntime.__version__,
        "onnxscript": onnxscript.__version__,
        "python": sys.version.split()[0],
    }


def _code_digest() -> str:
    from dflash_trt.export import checkpoint, config, draft, graph_modules, layers, manifest, onnx_io, onnx_kernels, sampling, target, torch_dtypes, weights

    modules = (
        checkpoint, config, contract, draft, graph_modules, graph_passes, identity, layers, manifest, onnx_io, onnx_kernels, sampling, target,
        torch_dtypes, weights,
    )
    return identity.source_digest([m.__file__ for m in modules] + [__file__])


def export_key(target_dir: str | Path, draft_dir: str | Path, resolved: ExportOptions) -> str:
    tokenizer = [[path.name, identity.file_sha256(path)] for path in tokenizer_files(target_dir)]
    settings = {"schema": SCHEMA_VERSION, "opset": OPSET, "options": asdict(resolved), "versions": tool_versions(), "tokenizer": tokenizer}
    return identity.export_key(target_dir, draft_dir, settings, _code_digest())


def up_to_date(target_dir: str | Path, draft_dir: str | Path, out_dir: str | Path, options: ExportOptions) -> Manifest | None:
    """The existing export in ``out_dir`` if it is valid and made from exactly these inputs."""
    if not (Path(out_dir) / MANIFEST_FILE).exists():
        return None
    try:
        manifest = load_manifest(out_dir, verify=VERIFY_HASH)
    except ManifestError:
        return None
    key = export_key(target_dir, draft_dir, options.resolve(target_dir, draft_dir))
    return manifest if manifest.export_key == key else None


def contract_dims(target: TargetModel, draft: DraftModel, options: ExportOptions) -> Dims:
    """The contract dims of a pair under resolved options."""
    t, d = target.config, draft.config
    return Dims.of(
        (t.num_layers, t.num_kv_heads, t.head_dim),
        (d.num_layers, d.num_kv_heads, d.head_dim),
        DTYPES[options.dtype],
        verify_lengths(options.verify_proposals, options.proposals),
        vocab_size=t.vocab_size,
        tap_width=target.tap_width,
        block_size=d.block_size,
        proposals=options.proposals,
        max_owners=options.max_owners,
        max_context=options.max_context,
        max_chunk=options.max_chunk,
    )


@contextlib.contextmanager
def kernels_of(models: list[torch.nn.Module], kernels) -> Iterator[None]:
    """Wire ``models`` to ``kernels`` (on these instances only) for the block's duration."""
    saved = [m.kernels for m in models]
    for m in models:
        m.kernels = kernels
    try:
        yield
    finally:
        for m, k in zip(models, saved):
            m.kernels = k


def trace_inputs(spec: GraphSpec) -> tuple[torch.Tensor, ...]:
    """Zero tensors of the contract's shapes (dynamic dims at TRACE_SIZE)."""
    sizes = {symbol: TRACE_SIZE for symbol in spec.dims}
    return tuple(torch.zeros(s.resolve(sizes), dtype=TORCH_DTYPES[s.dtype]) for s in spec.inputs)


def _dynamic_shapes(spec: GraphSpec) -> tuple:
    """torch.export dynamic_shapes for a wrapper ``forward(*named, *caches)``."""
    # A dim whose range is one value (N of max_owners 1) stays symbolic: torch.export needs
    # room to trace at TRACE_SIZE; the contract's ranges bound what is ever fed.
    dims = {symbol: torch.export.Dim(symbol, min=r.min, max=max(r.max, TRACE_SIZE)) for symbol, r in spec.dims.items()}

    def shape(s) -> dict | None:
        return {axis: dims[d] for axis, d in enumerate(s.shape) if isinstance(d, str)} or None

    named = [shape(s) for s in spec.inputs if not s.name.startswith("past_")]
    caches = tuple(shape(s) for s in spec.cache_inputs)
    return tuple(named) + ((caches,) if caches else ())


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence the exporter's progress chatter and known-benign warnings."""
    loggers = [logging.getLogger(name) for name in ("torch.onnx", "torch.export", "torch._dynamo", "onnxscript")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def export_graph(
    module: torch.nn.Module, spec: GraphSpec, directory: Path, weights: SharedWeights | None = None, live_keys: bool = False
) -> GraphFile:
    """Trace ``module`` (wired to emitting OnnxKernels) into ``directory/<name>.onnx`` and check it.

    The traced graph is rewritten before it is saved (``graph_passes``: norms as a division; with
    ``live_keys``, attention over the live cache slots only). With ``weights``, large initializers go
    to the shared external-data file. The returned ``data_files`` hashes are of the files as they are now.
    """
    path = directory / f"{spec.name}.onnx"
    args = trace_inputs(spec)
    with _quiet(), torch.no_grad():
        program = torch.export.export(module.eval(), args, dynamic_shapes=_dynamic_shapes(spec), strict=False)
        onnx_program = torch.onnx.export(
            program,
            (),
            dynamo=True,
            opset_version=OPSET,
            input_names=list(spec.input_names),
            output_names=list(spec.output_names),
            custom_translation_table=TRANSLATIONS,
            optimize=True,
            verbose=False,
        )
        _name_dynamic_dims(onnx_program, spec)
        graph_passes.divide_by_root(onnx_program.model.graph)
        if live_keys:
            graph_passes.live_keys(onnx_program.model.graph)
        onnx_program.model.ir_version = IR_VERSION
        if weights is None:
            onnx_program.save(path)  # external data of its own only past protobuf's 2 GB
        else:
            weights.externalize(onnx_program.model)
            ir.save(onnx_program.model, path)
    onnx.checker.check_model(str(path), full_check=True)
    model = load_graph(path)
    inputs, outputs = declared_io(model)
    if (inputs, outputs) != (spec.inputs, spec.outputs):
        msg = f"traced graph {spec.name} breaks the contract: declares {inputs + outputs}, contract {spec.inputs + spec.outputs}"
        raise ExportError(msg)
    data = {name: identity.file_sha256(directory / name) for name in external_data_files(model)}
    return GraphFile(path.name, identity.file_sha256(path), data, spec)


def _clear(directory: Path, names: list[str], target_dir: Path) -> None:
    """Remove the manifest, then previous files of these graphs and their external data, and the tokenizer
    files a previous export copied (its manifest names them; never the target's own, if exporting into it)."""
    try:
        previous = load_manifest(directory, verify="none").tokenizer if (directory / MANIFEST_FILE).exists() else {}
    except ManifestError:
        previous = {}
    if directory.resolve() == Path(target_dir).resolve():
        previous = {}
    (directory / MANIFEST_FILE).unlink(missing_ok=True)  # no manifest until every graph is written
    for name in previous:
        (directory / name).unlink(missing_ok=True)
    for name in names:
        path = directory / f"{name}.onnx"
        if path.exists():
            for data in external_data_files(load_graph(path)):
                (directory / data).unlink(missing_ok=True)
            path.unlink()


def _name_dynamic_dims(onnx_program, spec: GraphSpec) -> None:
    """torch names dynamic dims s0, s1...; rename them to the contract's symbols (T, C)."""
    mapping = {}
    for value, tensor in zip(onnx_program.model.graph.inputs, spec.inputs):
        for dim, want in zip(value.shape, tensor.shape):
            if isinstance(want, str):
                mapping[str(dim)] = want
    if mapping:
        onnx_program.rename_axes(mapping)


def _geometry(config, cache_key: str) -> Geometry:
    return Geometry(
        layers=config.num_layers,
        hidden_size=config.hidden_size,
        num_heads=config.num_heads,
        kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        windows=tuple(config.windows),
        cache_key=cache_key,
    )


def build_manifest(
    target: TargetModel,
    draft: DraftModel,
    options: ExportOptions,
    graphs: dict[str, GraphFile],
    key: str,
    digests: tuple[str, str],
) -> Manifest:
    """The manifest of an export (``digests``: checkpoint digests of target, draft)."""
    t, d = target.config, draft.config
    dtype = DTYPES[options.dtype]
    return Manifest(
        schema_version=SCHEMA_VERSION,
        export_key=key,
        dtype=options.dtype,
        opset=OPSET,
        ir_version=IR_VERSION,
        causal=options.causal,
        block_size=d.block_size,
        proposals=options.proposals,
        verify_proposals=tuple(options.verify_proposals),
        min_proposals=contract.MIN_PROPOSALS,
        max_proposals=d.block_size - 1,
        mask_token_id=d.mask_token_id,
        tap_layer_ids=tuple(target.tap_layers),
        tap_width=target.tap_width,
        max_owners=options.max_owners,
        max_sessions=options.max_sessions,
        max_context=options.max_context,
        max_chunk=options.max_chunk,
        vocab_size=t.vocab_size,
        special_tokens=SpecialTokens(t.bos_token_id, tuple(t.eos_token_ids), tuple(t.eos_token_ids), t.pad_token_id),
        target=_geometry(t, identity.target_cache_key(digests[0], dtype)),
        draft=_geometry(d, identity.draft_cache_key(digests[1], digests[0], tuple(target.tap_layers), dtype)),
        graphs=graphs,
        versions=tool_versions(),
    )


def export_pair(
    target_dir: str | Path,
    draft_dir: str | Path,
    out_dir: str | Path,
    options: ExportOptions = ExportOptions(),
    progress: bool = False,
    force: bool = False,
    on_graph: Callable[[str, GraphFile, float], None] | None = None,
) -> Manifest:
    """Export every graph of the pair into ``out_dir`` and write its manifest.

    Skips the work (returns the existing manifest) when ``out_dir`` already
    holds a valid export of exactly these inputs, unless ``force``.
    ``on_graph(name, graph, seconds)`` is called after each graph.
    """
    resolved = options.resolve(target_dir, draft_dir)
    if not force and (existing := up_to_date(target_dir, draft_dir, out_dir, options)) is not None:
        return existing
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    target, draft = load_pair(target_dir, draft_dir, TORCH_DTYPES[DTYPES[resolved.dtype]])
    dims = contract_dims(target, draft, resolved)
    specs = contract.export_specs(dims)
    _clear(out, list(specs), Path(target_dir))
    graphs: dict[str, GraphFile] = {}
    kernels = OnnxKernels(resolved.causal, emit=True)
    with contextlib.ExitStack() as stack:
        weights = stack.enter_context(SharedWeights(out)) if resolved.shared_weights else None
        stack.enter_context(kernels_of([target, draft], kernels))
        bar = stack.enter_context(tqdm(specs.values(), desc="export", unit="graph", disable=not progress))
        for spec in bar:
            bar.set_postfix_str(spec.name)
            started = time.perf_counter()
            graphs[spec.name] = export_graph(graph_module(spec, target, draft, dims), spec, out, weights, resolved.live_keys)
            if on_graph is not None:
                on_graph(spec.name, graphs[spec.name], time.perf_counter() - started)
    graphs = _rehash_data(graphs, out)
    digests = (identity.checkpoint_digest(target_dir), identity.checkpoint_digest(draft_dir))
    manifest = build_manifest(target, draft, resolved, graphs, export_key(target_dir, draft_dir, resolved), digests)
    manifest = replace(manifest, tokenizer=copy_tokenizer(target_dir, out))  # the export serves text on its own
    write_manifest(manifest, out)
    return load_manifest(out, verify=VERIFY_HASH)


def _rehash_data(graphs: dict[str, GraphFile], directory: Path) -> dict[str, GraphFile]:
    """Final hashes of the external-data files (a shared file grew while later graphs were written)."""
    hashes: dict[str, str] = {}
    for graph in graphs.values():
        for name in graph.data_files:
            if name not in hashes:
                hashes[name] = identity.file_sha256(directory / name)
    return {n: replace(g, data_files={f: hashes[f] for f in g.data_files}) for n, g in graphs.items()}
