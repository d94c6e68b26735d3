"""``manifest.json``: every fact the runtime and the engine builder need and check.

Written by the exporter beside the graphs (``write_manifest``); read back with
``load_manifest(directory)``, which refuses, with ``ManifestError`` naming the
field and both values, a manifest that is malformed, of an unknown schema
version, inconsistent in itself, or that disagrees with its graph files.

Fields (schema version 1):

==================  ==========================================================
schema_version      1
export_key          identity of the export's inputs (keys.export_key)
dtype               fp32 | fp16 | bf16 (model tensors; logits are fp32 always)
opset, ir_version   ONNX opset (24) and IR version (<= 13: ONNX Runtime's max)
causal              target causal formulation: lengths | mask (onnx_kernels)
block_size          B; ``proposals`` P, within [min_proposals, max_proposals]
verify_proposals    the verify lengths k a cycle may use (ascending, the last P;
                    graphs ``*_{n}_p{k}`` for the others: ``contract``);
                    optional: an older manifest without it offers [P] only
mask_token_id       the block's mask token (a row of the target's embedding)
tap_layer_ids       target layers whose outputs are the taps; ``tap_width`` m*H
max_owners          static graphs exist for n = 1..max_owners
max_sessions        cache rows the runtime allocates
max_context         L, the cache length; ``max_chunk`` max T / C of dynamic graphs
vocab_size          V
special_tokens      bos, eos (list), stop (list), pad
target, draft       layers, hidden_size, num_heads, kv_heads, head_dim,
                    windows (per layer, 0 = full), cache_key (distinct)
graphs              exported graph (``contract.export_names``: target_model,
                    draft_model, sample, verify_*_n) -> file, sha256,
                    data_files {file: sha256}, kind, owners, inputs,
                    outputs, dims (the contract's IO)
versions            torch, onnx, onnxruntime, onnxscript, dflash_trt
tokenizer           the target's tokenizer files copied beside the graphs
                    (``export.tokenizer.TOKENIZER_FILES``) -> sha256; empty
                    when the target has no tokenizer.json (optional: an
                    older manifest without it reads as empty)
==================  ==========================================================
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from google.protobuf.message import DecodeError

from dflash_trt.checks import is_int
from dflash_trt.errors import ManifestError
from dflash_trt.export import contract
from dflash_trt.export.contract import DTYPES, Dims, DimRange, GraphSpec, TensorSpec
from dflash_trt.export.identity import verified_sha256
from dflash_trt.export.onnx_io import declared_io, external_data_files, load_graph

SCHEMA_VERSION = 1
MANIFEST_FILE = "manifest.json"
MAX_IR_VERSION = 13  # ONNX Runtime refuses 14
VERIFY_NONE, VERIFY_IO, VERIFY_HASH = "none", "io", "hash"
VERIFY_LEVELS = (VERIFY_NONE, VERIFY_IO, VERIFY_HASH)

@dataclass(frozen=True)
class Geometry:
    """A decoder stack as the caches see it."""

    layers: int
    hidden_size: int
    num_heads: int
    kv_heads: int
    head_dim: int
    windows: tuple[int, ...]
    cache_key: str


@dataclass(frozen=True)
class SpecialTokens:
    bos: int | None
    eos: tuple[int, ...]
    stop: tuple[int, ...]
    pad: int | None


@dataclass(frozen=True)
class GraphFile:
    """One exported graph: its file (relative to the manifest), hashes and IO contract."""

    file: str
    sha256: str
    data_files: Mapping[str, str]
    io: GraphSpec

    def to_json(self) -> dict:
        return {
            "file": self.file,
            "sha256": self.sha256,
            "data_files": dict(self.data_files),
            "kind": self.io.kind,
            "owners": self.io.owners,
            **self.io.io_json(),
        }


@dataclass(frozen=True)
class Manifest:
    schema_version: int
    export_key: str
    dtype: str
    opset: int
    ir_version: int
    causal: str
    block_size: int
    proposals: int
    min_proposals: int
    max_proposals: int
    mask_token_id: int
    tap_layer_ids: tuple[int, ...]
    tap_width: int
    max_owners: int
    max_sessions: int
    max_context: int
    max_chunk: int
    vocab_size: int
    special_tokens: SpecialTokens
    target: Geometry
    draft: Geometry
    graphs: Mapping[str, GraphFile]
    versions: Mapping[str, str] = field(default_factory=dict)
    tokenizer: Mapping[str, str] = field(default_factory=dict)  # file name -> sha256
    verify_proposals: tuple[int, ...] = ()  # () as (proposals,): an export made before verify lengths

    def dims(self) -> Dims:
        """The contract dims these facts imply (ValueError if they are out of range)."""
        target, draft = ((g.layers, g.kv_heads, g.head_dim) for g in (self.target, self.draft))
        sizes = {name: getattr(self, name) for name in contract.SIZE_FIELDS}
        return Dims.of(target, draft, DTYPES[self.dtype], self.verify_proposals, **sizes)

    @property
    def short_verify(self) -> tuple[int, ...]:
        """The verify lengths below P (those with graphs of their own)."""
        return tuple(self.verify_proposals)[:-1]

    def to_json(self) -> dict:
        data = {k: v for k, v in asdict(self).items() if k != "graphs"}
        data["graphs"] = {name: g.to_json() for name, g in self.graphs.items()}
        return json.loads(json.dumps(data))  # tuples -> lists


def write_manifest(manifest: Manifest, directory: str | Path) -> Path:
    path = Path(directory) / MANIFEST_FILE
    path.write_text(json.dumps(manifest.to_json(), indent=2) + "\n")
    return path


def load_manifest(directory: str | Path, verify: str = VERIFY_HASH) -> Manifest:
    """Read and validate ``directory/manifest.json``.

    ``verify``: ``none`` checks the manifest alone (e.g. a copy beside engine
    plans, without the graphs); ``io`` also opens every graph file (not its
    weights) and compares its declared IO; ``hash`` also checks every file's
    sha256.
    """
    if verify not in VERIFY_LEVELS:
        raise ValueError(f"verify must be one of {VERIFY_LEVELS}, got {verify!r}")
    path = Path(directory) / MANIFEST_FILE
    manifest = _parse(_read(path), path)
    _check_consistency(manifest, path)
    if verify != VERIFY_NONE:
        _check_files(manifest, Path(directory), verify == VERIFY_HASH)
    return manifest


MAX_MANIFEST_BYTES = 64 << 20  # a real manifest is well under 1 MB; refuse before reading a huge file


def _read(path: Path) -> dict:
    """The manifest's JSON object; every OS / decode failure is a ManifestError naming the file."""
    try:
        size = path.stat().st_size
        if size > MAX_MANIFEST_BYTES:
            raise ManifestError(f"{path}: {size} bytes, more than any manifest ({MAX_MANIFEST_BYTES}); not a manifest")
        data = json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError as error:
        raise ManifestError(f"{path}: not found (export the graphs first)") from error
    except OSError as error:  # a directory, no permission, not a directory above it...
        raise ManifestError(f"{path}: cannot be read ({type(error).__name__}: {error.strerror or error})") from error
    except UnicodeDecodeError as error:
        raise ManifestError(f"{path}: not UTF-8 text (byte {error.start}); not a manifest") from error
    except (ValueError, RecursionError) as error:  # JSONDecodeError is a ValueError; deep nesting recurses
        raise ManifestError(f"{path}: not valid JSON ({type(error).__name__}: {str(error)[:200]})") from error
    if not isinstance(data, dict):
        raise ManifestError(f"{path}: must hold a JSON object, got {type(data).__name__}")
    return data


def _file_name(value: str, where: str, path: Path) -> str:
    """A file the manifest names must be a bare name inside its directory: no path, no '..'."""
    if not value or value in (".", "..") or "/" in value or "\\" in value or "\0" in value or Path(value).is_absolute():
        raise ManifestError(f"{path}: field '{where}' must be a file name inside {path.parent} (no directories, no '..'), got {value!r}")
    return value


class _Fields:
    """Typed access to one JSON object, naming the field on any error."""

    def __init__(self, data: Any, where: str, path: Path) -> None:
        if not isinstance(data, dict):
            raise ManifestError(f"{path}: field '{where}' must be an object, got {data!r}")
        self.data, self.where, self.path = data, where, path

    def _name(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def get(self, key: str, kinds: tuple[type, ...], label: str):
        if key not in self.data:
            raise ManifestError(f"{self.path}: required field '{self._name(key)}' is missing")
        value = self.data[key]
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            raise ManifestError(f"{self.path}: field '{self._name(key)}' must be {label}, got {value!r}")
        return value

    def int(self, key: str) -> int:
        return self.get(key, (int,), "an int")

    def opt_int(self, key: str) -> int | None:
        return self.get(key, (int, type(None)), "an int or null")

    def str(self, key: str) -> str:
        return self.get(key, (str,), "a string")

    def ints(self, key: str) -> tuple[int, ...]:
        value = self.get(key, (list,), "a list of ints")
        if not all(is_int(v) for v in value):
            raise ManifestError(f"{self.path}: field '{self._name(key)}' must be a list of ints, got {value!r}")
        return tuple(value)

    def obj(self, key: str) -> _Fields:
        return _Fields(self.get(key, (dict,), "an object"), self._name(key), self.path)

    def exactly(self, keys: set[str]) -> None:
        unknown = sorted(set(self.data) - keys)
        if unknown:
            where = f"'{self.where}'" if self.where else "the manifest"
            raise ManifestError(f"{self.path}: unknown field '{unknown[0]}' in {where} (known: {sorted(keys)})")


_TOP = {f for f in Manifest.__dataclass_fields__}


def _parse(data: dict, path: Path) -> Manifest:
    top = _Fields(data, "", path)
    version = top.int("schema_version")
    if version != SCHEMA_VERSION:
        raise ManifestError(f"{path}: schema_version is {version} but this reader knows {SCHEMA_VERSION}: re-export")
    top.exactly(_TOP)
    special = top.obj("special_tokens")
    versions = top.obj("versions")
    return Manifest(
        schema_version=version,
        export_key=top.str("export_key"),
        dtype=top.str("dtype"),
        opset=top.int("opset"),
        ir_version=top.int("ir_version"),
        causal=top.str("causal"),
        block_size=top.int("block_size"),
        proposals=top.int("proposals"),
        min_proposals=top.int("min_proposals"),
        max_proposals=top.int("max_proposals"),
        mask_token_id=top.int("mask_token_id"),
        tap_layer_ids=top.ints("tap_layer_ids"),
        tap_width=top.int("tap_width"),
        max_owners=top.int("max_owners"),
        max_sessions=top.int("max_sessions"),
        max_context=top.int("max_context"),
        max_chunk=top.int("max_chunk"),
        vocab_size=top.int("vocab_size"),
        special_tokens=SpecialTokens(
            special.opt_int("bos"), special.ints("eos"), special.ints("stop"), special.opt_int("pad")
        ),
        target=_geometry(top.obj("target")),
        draft=_geometry(top.obj("draft")),
        graphs={name: _graph(top.obj("graphs"), name) for name in top.obj("graphs").data},
        versions={key: versions.str(key) for key in versions.data},
        tokenizer=_tokenizer_files(top, path),
        verify_proposals=top.ints("verify_proposals") if "verify_proposals" in top.data else (top.int("proposals"),),
    )


def _tokenizer_files(top: _Fields, path: Path) -> dict[str, str]:
    if "tokenizer" not in top.data:
        return {}
    files = top.obj("tokenizer")
    return {_file_name(name, f"tokenizer.{name}", path): files.str(name) for name in files.data}


def _geometry(fields: _Fields) -> Geometry:
    fields.exactly(set(Geometry.__dataclass_fields__))
    return Geometry(
        layers=fields.int("layers"),
        hidden_size=fields.int("hidden_size"),
        num_heads=fields.int("num_heads"),
        kv_heads=fields.int("kv_heads"),
        head_dim=fields.int("head_dim"),
        windows=fields.ints("windows"),
        cache_key=fields.str("cache_key"),
    )


def _tensors(fields: _Fields, key: str) -> tuple[TensorSpec, ...]:
    specs = []
    for index, item in enumerate(fields.get(key, (list,), "a list of tensors")):
        one = _Fields(item, f"{fields.where}.{key}[{index}]", fields.path)
        shape = one.get("shape", (list,), "a list of ints and dim names")
        if not all(is_int(d) or isinstance(d, str) for d in shape):
            raise ManifestError(f"{fields.path}: field '{one.where}.shape' must hold ints and dim names, got {shape!r}")
        specs.append(TensorSpec(one.str("name"), tuple(shape), one.str("dtype")))
    return tuple(specs)


def _graph(graphs: _Fields, name: str) -> GraphFile:
    entry = graphs.obj(name)
    entry.exactly({"file", "sha256", "data_files", "kind", "owners", "inputs", "outputs", "dims"})
    data_files = entry.obj("data_files")
    dims = entry.obj("dims")
    ranges = {key: DimRange(*dims.ints(key)) for key in dims.data if len(dims.ints(key)) == 3}
    if len(ranges) != len(dims.data):
        raise ManifestError(f"{graphs.path}: field '{dims.where}' must map dim names to [min, opt, max]")
    io = GraphSpec(name, entry.str("kind"), entry.opt_int("owners"), _tensors(entry, "inputs"), _tensors(entry, "outputs"), ranges)
    file = _file_name(entry.str("file"), f"{entry.where}.file", graphs.path)
    data = {_file_name(k, f"{data_files.where}.{k}", graphs.path): data_files.str(k) for k in data_files.data}
    return GraphFile(file, entry.str("sha256"), data, io)


def _refuse(path: Path, field_name: str, got: Any, want: Any, why: str) -> None:
    if got != want:
        raise ManifestError(f"{path}: {field_name} is {got!r} but {why} {want!r}")


def _check_consistency(m: Manifest, path: Path) -> None:
    """The manifest's facts agree with each other and with its graphs' recorded IO.

    Facts the graphs' shapes show (block size, proposals, vocabulary...) are
    checked against those shapes first, so an edited field is named as such.
    """
    if m.dtype not in DTYPES:
        raise ManifestError(f"{path}: dtype must be one of {sorted(DTYPES)}, got {m.dtype!r}")
    if m.ir_version > MAX_IR_VERSION:
        raise ManifestError(f"{path}: ir_version must be <= {MAX_IR_VERSION} (ONNX Runtime's max), got {m.ir_version}")
    _check_bounds(m, path)
    # max_owners sizes everything static: bound it by the graphs actually listed before using it.
    if m.max_owners > len(m.graphs):
        count = len(contract.export_names(1)) + (len(contract.export_names(2)) - len(contract.export_names(1))) * (m.max_owners - 1)
        raise ManifestError(f"{path}: max_owners {m.max_owners} needs {count} graphs, 'graphs' lists {len(m.graphs)}")
    # verify_proposals sizes the graph list too: bound it before using it (``_check_facts`` relates it to proposals,
    # after the graphs' shapes have named an edited proposals field as such).
    lengths = list(m.verify_proposals)
    if not contract.check_verify_lengths(lengths, lengths[-1] if lengths else 0) or lengths[-1] > INT32_MAX or len(lengths) > len(m.graphs):
        raise ManifestError(f"{path}: verify_proposals must be ints increasing from >= {contract.MIN_PROPOSALS}, got {lengths}")
    expected = contract.export_names(m.max_owners, m.short_verify)
    missing = [n for n in expected if n not in m.graphs]
    if missing:
        raise ManifestError(f"{path}: graphs lacks '{missing[0]}' (max_owners {m.max_owners} needs every n in 1..{m.max_owners})")
    extra = [n for n in m.graphs if n not in expected]
    if extra:
        raise ManifestError(f"{path}: graphs has '{extra[0]}', not a graph of max_owners {m.max_owners}")
    _check_observed_dims(m, {name: g.io for name, g in m.graphs.items()}, path, "recorded IO of graph")
    _check_facts(m, path)
    try:
        dims = m.dims()
    except ValueError as error:
        raise ManifestError(f"{path}: {error}") from error
    for name, graph in m.graphs.items():
        _compare_io(graph.io, contract.graph_spec(dims, name), path, f"graphs.{name}", "recorded", "the contract for these fields")


INT32_MAX = (1 << 31) - 1  # TensorRT shapes are int32: no extent of a graph may exceed it

# Every count a buffer or a graph list is sized from: bounded before anything is allocated.
_COUNTS = (
    "block_size", "proposals", "max_owners", "max_sessions", "max_context", "max_chunk", "vocab_size", "tap_width",
    "target.layers", "target.hidden_size", "target.num_heads", "target.kv_heads", "target.head_dim",
    "draft.layers", "draft.hidden_size", "draft.num_heads", "draft.kv_heads", "draft.head_dim",
)  # fmt: skip


def _check_bounds(m: Manifest, path: Path) -> None:
    for name in _COUNTS:
        value = _field_value(m, name)
        if not 1 <= value <= INT32_MAX:
            raise ManifestError(f"{path}: {name} must be in [1, {INT32_MAX}], got {value}")


def _check_facts(m: Manifest, path: Path) -> None:
    _refuse(path, "min_proposals", m.min_proposals, contract.MIN_PROPOSALS, "the verifiers need")
    _refuse(path, "max_proposals", m.max_proposals, m.block_size - 1, "block_size - 1 is")
    if not m.min_proposals <= m.proposals <= m.max_proposals:
        raise ManifestError(f"{path}: proposals must be in [{m.min_proposals}, {m.max_proposals}], got {m.proposals}")
    if not contract.check_verify_lengths(m.verify_proposals, m.proposals):
        msg = f"{path}: verify_proposals must increase within [{m.min_proposals}, {m.proposals}] and end at proposals {m.proposals}, got {list(m.verify_proposals)}"
        raise ManifestError(msg)
    ids = list(m.tap_layer_ids)
    if not ids or ids != sorted(set(ids)) or ids[0] < 0 or ids[-1] >= m.target.layers:
        raise ManifestError(f"{path}: tap_layer_ids must increase within [0, {m.target.layers - 1}], got {ids}")
    _refuse(path, "tap_width", m.tap_width, len(ids) * m.target.hidden_size, "len(tap_layer_ids) * target.hidden_size is")
    if not 0 <= m.mask_token_id < m.vocab_size:
        raise ManifestError(f"{path}: mask_token_id must be in [0, {m.vocab_size - 1}], got {m.mask_token_id}")
    if m.target.cache_key == m.draft.cache_key:
        raise ManifestError(f"{path}: target.cache_key and draft.cache_key must differ, both are {m.target.cache_key!r}")
    if m.max_chunk + m.block_size > m.max_context:
        raise ManifestError(f"{path}: max_chunk must be <= max_context - block_size = {m.max_context - m.block_size} (draft_model's write window), got {m.max_chunk}")
    if m.max_sessions < m.max_owners:
        raise ManifestError(f"{path}: max_sessions must be >= max_owners {m.max_owners}, got {m.max_sessions}")
    for role, geometry in (("target", m.target), ("draft", m.draft)):
        _refuse(path, f"{role}.windows length", len(geometry.windows), geometry.layers, f"{role}.layers is")


# (manifest field, graph, tensor, axis or None for the dtype): how each fact shows in the graphs.
def _probes() -> tuple[tuple[str, str, str, int | None], ...]:
    target, draft = contract.TARGET_MODEL, contract.DRAFT_MODEL
    key = contract.past_key(0)
    return (
        ("vocab_size", target, contract.LOGITS, 2),
        ("tap_width", target, contract.TAPS, 2),
        ("dtype", target, contract.TAPS, None),
        ("max_context", target, key, 2),
        ("target.kv_heads", target, key, 1),
        ("target.head_dim", target, key, 3),
        ("draft.kv_heads", draft, key, 1),
        ("draft.head_dim", draft, key, 3),
        ("proposals", draft, contract.PROPOSALS, 1),
    )


def _field_value(m: Manifest, name: str):
    value = m
    for part in name.split("."):
        value = getattr(value, part)
    return DTYPES[value] if name == "dtype" else value


def _check_observed_dims(m: Manifest, graphs: Mapping[str, GraphSpec], path: Path, source: str) -> None:
    """Name the manifest field a graph's shapes contradict, with both values."""
    for name, graph_name_, tensor, axis in _probes():
        spec = {s.name: s for s in graphs[graph_name_].inputs + graphs[graph_name_].outputs}.get(tensor)
        if spec is None:
            continue  # reported by the IO comparison
        seen = spec.dtype if axis is None else (spec.shape[axis] if axis < len(spec.shape) else None)
        mine = _field_value(m, name)
        if seen != mine:
            raise ManifestError(
                f"{path}: {name} is {mine!r} in the manifest but {seen!r} in the {source} "
                f"{graph_name_!r} ({tensor} {list(spec.shape)} {spec.dtype})"
            )
    for role, graph_name_ in (("target", contract.TARGET_MODEL), ("draft", contract.DRAFT_MODEL)):
        layers = sum(s.name.startswith("past_key_") for s in graphs[graph_name_].inputs)
        _refuse(path, f"{role}.layers", getattr(m, role).layers, layers, f"the {source} {graph_name_!r} has caches of")


def _compare_io(got: GraphSpec, want: GraphSpec, path: Path, where: str, got_label: str, want_label: str) -> None:
    for side in ("inputs", "outputs"):
        mine = {s.name: s for s in getattr(got, side)}
        theirs = {s.name: s for s in getattr(want, side)}
        if set(mine) != set(theirs):
            only_mine, only_theirs = sorted(set(mine) - set(theirs)), sorted(set(theirs) - set(mine))
            raise ManifestError(
                f"{path}: {where} {side} differ: only in {got_label}: {only_mine}, only in {want_label}: {only_theirs}"
            )
        for name, spec in mine.items():
            other = theirs[name]
            if (list(spec.shape), spec.dtype) != (list(other.shape), other.dtype):
                raise ManifestError(
                    f"{path}: {where} {side[:-1]} '{name}' is {list(spec.shape)} {spec.dtype} in {got_label} "
                    f"but {list(other.shape)} {other.dtype} in {want_label}"
                )
        if [s.name for s in getattr(got, side)] != [s.name for s in getattr(want, side)]:
            raise ManifestError(f"{path}: {where} {side} order differs between {got_label} and {want_label}")
    if got.kind != want.kind or got.owners != want.owners:
        raise ManifestError(
            f"{path}: {where} is kind {got.kind!r} owners {got.owners} in {got_label}, "
            f"{want.kind!r} owners {want.owners} in {want_label}"
        )
    if dict(got.dims) != dict(want.dims):
        raise ManifestError(f"{path}: {where} dims are {dict(got.dims)} in {got_label} but {dict(want.dims)} in {want_label}")


def _check_tokenizer(m: Manifest, directory: Path, hashes: bool) -> None:
    """The tokenizer files the manifest names exist and (``hashes``) are the ones exported."""
    manifest_path = directory / MANIFEST_FILE
    for file, want in m.tokenizer.items():
        if not (directory / file).is_file():
            raise ManifestError(f"{manifest_path}: tokenizer names file '{file}', which is missing from {directory}")
        if hashes and (got := verified_sha256(directory / file)) != want:
            raise ManifestError(f"{manifest_path}: tokenizer sha256 of '{file}' is {want} in the manifest but {got} on disk (the file changed after export)")


def _check_files(m: Manifest, directory: Path, hashes: bool) -> None:
    """Every graph file exists, declares the recorded IO and (``hashes``) has the recorded sha256."""
    manifest_path = directory / MANIFEST_FILE
    on_disk, data_files = {}, {}  # what each graph file declares
    for name, graph in m.graphs.items():
        for file in (graph.file, *graph.data_files):
            if not (directory / file).is_file():
                raise ManifestError(f"{manifest_path}: graphs.{name} names file '{file}', which is missing from {directory}")
        try:
            model = load_graph(directory / graph.file)
        except (OSError, DecodeError) as error:
            raise ManifestError(f"{manifest_path}: graphs.{name} file '{graph.file}' is not a readable ONNX graph: {error}") from error
        kind, owners = contract.parse_graph_name(name)
        on_disk[name] = GraphSpec(name, kind, owners, *declared_io(model))
        data_files[name] = external_data_files(model)
    _check_observed_dims(m, on_disk, manifest_path, "file of graph")
    _check_tokenizer(m, directory, hashes)
    digests: dict[str, str] = {}  # a shared weights file is hashed once
    for name, graph in m.graphs.items():
        recorded = GraphSpec(name, graph.io.kind, graph.io.owners, graph.io.inputs, graph.io.outputs)
        _compare_io(recorded, on_disk[name], manifest_path, f"graphs.{name}", "the manifest", f"file {graph.file}")
        _refuse(manifest_path, f"graphs.{name}.data_files", sorted(graph.data_files), data_files[name], f"{graph.file} points to")
        if hashes:
            for file, want in ((graph.file, graph.sha256), *graph.data_files.items()):
                if file not in digests:
                    digests[file] = verified_sha256(directory / file)
                got = digests[file]
                if got != want:
                    raise ManifestError(
                        f"{manifest_path}: graphs.{name} sha256 of '{file}' is {want} in the manifest "
                        f"but {got} on disk (the file changed after export)"
                    )
