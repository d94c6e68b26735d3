"""Build an engine set: every exported graph -> one TensorRT plan + engines.json.

Per graph: parse with TensorRT's ONNX parser into a strongly typed network
(precision comes from the graph), give every attention the causality and
key/value lengths of its ONNX node (``engines.attention``: the parser drops
the lengths and misaligns ``is_causal``), refuse any graph input or layer
output that nothing reads (TensorRT dropped what it meant: there is no
option to build anyway), add the contract's optimization profiles (a model
network gets one per run graph it computes: ``target_model`` serves
prefill, every verify_n and decode_n, so its weights are in ONE plan; a
static graph gets none), check the network's IO against the contract, then build. Failures do not stop the run: every failing graph and node is
collected and raised at the end as one ``EngineBuildError`` — except when
only graphs that sampled sessions alone need (``verify_sample_{n}``) failed:
the set is then written without them, greedy-only, and engines.json says
why each is ``skipped`` (the runtime refuses sampled sessions on it). One
builder and one timing cache (TensorRT; a file in the output directory)
serve all graphs. The two models' shared weights (the target's embedding
and LM head) are lifted out of their graphs before parsing, into one file
beside the plans (``engines.shared_weights``). The set's semantics probe
(``engines.probe``) is exported and built the same way, and run where the
builder has a GPU that runs the plans: a failed probe fails the build
(``engines.verdict``).
"""

from __future__ import annotations

import hashlib
import re
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from dflash_trt.engines.attention import (
    ATTENTION,
    AttentionBindError,
    BoundAttention,
    attention_digest,
    attention_nodes,
    attention_tag,
    bind_attention,
)
from dflash_trt.engines.bindings import (
    INPUT,
    OUTPUT,
    Binding,
    check_ranges,
    compute_dtype,
    io_mismatches,
    profile_shapes,
    trt_dtype_name,
)
from dflash_trt.engines.engine_set import (
    ENGINES_JSON,
    PROBE_NAME,
    SHARED_WEIGHTS_FILE,
    EngineRecord,
    EngineSetRecord,
    ProbeRecord,
    SharedWeightsRecord,
    write_engine_set,
)
from dflash_trt.engines.flavour import TIMING_CACHE_FILE, Flavour
from dflash_trt.engines.probe import ProbeSpec, export_probe, probe_io
from dflash_trt.engines.shared_weights import Lifted, lift_shared_weights, write_shared_weights
from dflash_trt.engines.sources import GraphSource, load_graph, source_files
from dflash_trt.engines.verdict import Site, refusal, run_probe
from dflash_trt.errors import EngineBuildError, EngineError, UnsupportedExportError
from dflash_trt.export.contract import GraphSpec, profiles_of, sampled_only, with_shared_weights
from dflash_trt.export.graph_passes import live_key_slices
from dflash_trt.export.identity import file_sha256

Progress = Callable[[str], None]
GRAPH_INPUT = "graph input"  # BuildFailure.operator of an input nothing reads
UNREAD_OUTPUT = "layer output read by nothing"  # ... of a dangling layer output
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_.@-]+$")  # engine names become file names
AUTO = object()  # build_engine_set's site: the current CUDA GPU, if any


@dataclass(frozen=True)
class BuildOptions:
    """The few knobs a build takes; recorded verbatim in engines.json."""

    workspace_mb: int | None = None  # None: TensorRT's default (the device's memory)
    targets: tuple[str, ...] = ()  # compute capabilities; () = the flavour's default
    version_compatible: bool = False  # TensorRT only

    def to_json(self) -> dict:
        data = asdict(self)
        data["targets"] = list(self.targets)
        return data


@dataclass(frozen=True)
class BuildFailure:
    """One problem: a graph, the node (or binding) at fault, TensorRT's words."""

    graph: str
    node: str
    operator: str
    message: str
    tensor: str = ""  # the tensor at fault, for unread tensors

    def __str__(self) -> str:
        if self.operator == GRAPH_INPUT:
            where = GRAPH_INPUT
        elif self.node:
            where = f"node {self.node!r}" + (f" ({self.operator})" if self.operator else "")
        else:
            where = self.operator or "graph"
        text = self.message.strip().replace("\n", "\n      ")
        return f"{self.graph}: {where}: {text}"


class _GraphFailed(Exception):
    def __init__(self, failures: Sequence[BuildFailure]):
        super().__init__(len(failures))
        self.failures = list(failures)


def build_engine_set(
    sources: Sequence[GraphSource],
    out_dir: Path,
    flavour: Flavour,
    options: BuildOptions = BuildOptions(),
    progress: Progress | None = None,
    source_manifest: Path | None = None,
    echo: Progress | None = None,
    site: Site | None | object = AUTO,
    probe: ProbeSpec | None = None,
) -> EngineSetRecord:
    """Build every source into ``out_dir``; raise ``EngineBuildError`` listing all failures.

    ``progress`` gets one line per graph; ``echo`` (optional) every TensorRT
    warning and error as it is logged. The semantics probe (``probe``; by
    default the one of ``source_manifest``'s export, none without) is built
    too, and run on ``site`` (default: the current CUDA GPU, if any; None:
    not at build).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # An old engines.json must never describe the plans this run rewrites.
    (out_dir / ENGINES_JSON).unlink(missing_ok=True)
    _check_sources(sources)
    refuse_unbuildable(sources)
    say = progress or (lambda _line: None)
    sources, lifted, shared = _lift(sources, out_dir, say)
    builder = _SetBuilder(flavour, options, out_dir, echo)
    records, failures = {}, []
    for index, source in enumerate(sources, start=1):
        start = time.perf_counter()
        try:
            records[source.name] = builder.build(source, lifted.graphs.get(source.name) if lifted else None)
        except _GraphFailed as failed:
            failures.extend(failed.failures)
            say(f"[{index}/{len(sources)}] {source.name}: FAILED after {time.perf_counter() - start:.2f} s")
            continue
        rec = records[source.name]
        profiles = f", {len(rec.profiles)} profiles" if len(rec.profiles) > 1 else ""
        say(f"[{index}/{len(sources)}] {source.name}: built in {rec.build_seconds:.2f} s, plan {rec.plan_bytes / 1e6:.1f} MB{profiles}")
    probe = probe or _manifest_probe(source_manifest)
    probe_record = _build_probe(builder, probe, failures, say)
    builder.save_cache()  # what the good graphs timed is kept even when others failed
    if not records or any(not sampled_only(f.graph) for f in failures):
        raise _build_error(failures, len(sources) + (probe is not None))
    skipped: dict[str, str] = {}
    for failure in failures:
        skipped.setdefault(failure.graph, str(failure))
    record = EngineSetRecord(
        flavour=flavour.name,
        trt_version=flavour.version,
        targets=tuple(builder.targets),
        build_options=options.to_json(),
        engines=records,
        source_manifest=_copy_manifest(source_manifest, out_dir),
        skipped=skipped,
        probe=probe_record,
        shared_weights=shared,
    )
    record = _probe_at_build(record, out_dir, flavour, say, Site.current() if site is AUTO else site)
    write_engine_set(out_dir, record)
    return record


def _lift(sources: Sequence[GraphSource], out_dir: Path, say: Progress) -> tuple[list[GraphSource], Lifted | None, SharedWeightsRecord | None]:
    """The model graphs with their shared weights lifted out (``engines.shared_weights``): their
    sources with the engine-level IO, the rewritten graphs, and the shared file, written."""
    out_dir.joinpath(SHARED_WEIGHTS_FILE).unlink(missing_ok=True)
    lifted = lift_shared_weights(sources)
    if lifted is None:
        return list(sources), None, None
    start = time.perf_counter()
    record = write_shared_weights(out_dir, lifted)
    engine_io = with_shared_weights({s.name: s.io for s in sources}, lifted.specs)
    names = ", ".join(f"{t.name} {list(t.shape)}" for t in record.tensors)
    say(f"[shared] {names}: {record.bytes / 1e6:.1f} MB in {record.file}, one copy for both models ({time.perf_counter() - start:.2f} s)")
    return [replace(s, io=engine_io[s.name]) for s in sources], lifted, record


def _manifest_probe(manifest: Path | None) -> ProbeSpec | None:
    if manifest is None:
        return None
    from dflash_trt.export.manifest import load_manifest

    return ProbeSpec.from_manifest(load_manifest(Path(manifest).parent, verify="none"))


def _build_probe(builder: _SetBuilder, spec: ProbeSpec | None, failures: list, say: Progress) -> ProbeRecord | None:
    """The semantics probe (``engines.probe``), exported and built like the set's graphs; None without a spec."""
    if spec is None:
        return None
    start = time.perf_counter()
    try:
        engine = builder.build(GraphSource(PROBE_NAME, export_probe(spec, builder.out_dir), probe_io(spec)))
    except _GraphFailed as failed:
        failures.extend(failed.failures)
        say(f"[probe] FAILED after {time.perf_counter() - start:.2f} s")
        return None
    say(f"[probe] built in {time.perf_counter() - start:.2f} s (export and build), plan {engine.plan_bytes / 1e6:.1f} MB")
    return ProbeRecord(engine, spec.to_json())


def _probe_at_build(record: EngineSetRecord, out_dir: Path, flavour: Flavour, say: Progress, site: Site | None) -> EngineSetRecord:
    """Run the probe where the builder has a GPU that runs the plans; a failed probe refuses the
    set (nothing is written). Elsewhere the first load on a GPU runs it."""
    if record.probe is None or site is None:
        return record
    from dflash_trt.engines.load import deserialize

    log = flavour.new_log()
    try:
        engine = deserialize(flavour, flavour.new_runtime(log), log, record, record.probe.engine, out_dir)
    except EngineError as error:
        say(f"[probe] not run at build ({error}); the first load on a GPU runs it")
        return record
    verdict = run_probe(flavour, engine, ProbeSpec.from_json(record.probe.spec), site, "build")
    say(f"[probe] {'passed' if verdict.passed else 'FAILED'} on {verdict.gpu}: {verdict.detail}")
    if not verdict.passed:
        raise EngineBuildError(refusal(out_dir, verdict))
    return replace(record, probe=replace(record.probe, verdicts=(verdict,)))


def _check_sources(sources: Sequence[GraphSource]) -> None:
    """Names usable as file names, each once; every dynamic dim has a range."""
    for source in sources:
        check_ranges(source.io)
    names = [s.name for s in sources]
    bad = [n for n in names if not _SAFE_NAME.match(n) or n == PROBE_NAME]  # the probe's plan is probe.plan
    dupes = sorted({n for n in names if names.count(n) > 1})
    if bad or dupes or not names:
        msg = f"engine names must be unique file-safe names ([A-Za-z0-9_.@-]+), non-empty list; bad {bad}, duplicated {dupes}, count {len(names)}"
        raise EngineBuildError(msg)


def refuse_unbuildable(sources: Sequence[GraphSource]) -> None:
    """Exports that are ONNX Runtime's configuration, refused before parsing in one line (each graph's proto
    read once, without weights):

    - an fp32 graph with attention: TensorRT has no fused fp32 attention kernel and fails deep in its
      builder (Myelin: "Attention operation was not supported by a dedicated kernel"), for every head dim;
    - a graph whose attention reads a slice of its cache sized from a tensor (``export --live-keys``,
      ONNX Runtime's default): a data-dependent shape no TensorRT profile covers, and ``bind_attention``
      binds lengths to the whole cache."""
    fp32, live = [], []
    for source in sources:
        graph = load_graph(source.onnx_path)
        if compute_dtype(source.io) == "float32" and attention_nodes(graph):
            fp32.append(source.name)
        if live_key_slices(graph):
            live.append(source.name)
    if fp32:
        msg = (
            f"{', '.join(fp32)}: float32 attention is ONNX Runtime's configuration and TensorRT has no kernel for it; "
            "re-export for TensorRT (`dflash-trt export --backend tensorrt`, bf16; or --dtype bf16 / fp16) to build engines"
        )
        raise UnsupportedExportError(msg)
    if live:
        msg = (
            f"{', '.join(live)}: attention over the live cache slots (`dflash-trt export --live-keys`) is ONNX Runtime's "
            "configuration; re-export for TensorRT (`dflash-trt export --backend tensorrt`, or --no-live-keys) to build engines"
        )
        raise UnsupportedExportError(msg)


def _build_error(failures: Sequence[BuildFailure], total: int) -> EngineBuildError:
    graphs = sorted({f.graph for f in failures})
    lines = "\n  ".join(str(f) for f in failures)
    msg = f"{len(graphs)} of {total} graphs failed to build ({', '.join(graphs)}):\n  {lines}"
    return EngineBuildError(msg, failures)


def _copy_manifest(manifest: Path | None, out_dir: Path) -> dict | None:
    if manifest is None:
        return None
    target = out_dir / manifest.name
    if Path(manifest).resolve() != target.resolve():
        shutil.copyfile(manifest, target)
    return {"file": manifest.name, "sha256": file_sha256(target)}


class _SetBuilder:
    """One TensorRT builder, logger and build cache shared by all graphs of a set."""

    def __init__(self, flavour: Flavour, options: BuildOptions, out_dir: Path, echo: Progress | None = None):
        self.flavour, self.options, self.out_dir = flavour, options, out_dir
        self.trt = flavour.trt
        self.log = flavour.new_log(echo)
        self.builder = self.trt.Builder(self.log)
        self.cache = None  # created from the first builder config
        self.targets: list[str] = []
        self._hashes: dict[Path, str] = {}  # graphs may share one external-data file

    def build(self, source: GraphSource, model: bytes | None = None) -> EngineRecord:
        """``model``: the graph to parse in place of the source file's (its shared weights lifted)."""
        mark, start = self.log.mark(), time.perf_counter()
        graph = parse_graph(self.flavour, self.builder, self.log, source, model)
        network = graph.network
        failures = unread_failures(source.name, network)
        config = self._config(source)
        profiles = self._profiles(network, source.io)
        for profile in profiles:
            config.add_optimization_profile(profile)
        bindings = network_bindings(network, profiles)
        failures += [BuildFailure(source.name, "", "IO contract", line) for line in io_mismatches(source.io, bindings)]
        if failures:  # both kinds at once: one rebuild fixes all
            raise _GraphFailed(failures)
        network.name = attention_tag(graph.attention)  # in the plan: the loader checks engines.json's records against it
        plan = self.builder.build_serialized_network(network, config)
        if plan is None:
            errors = self.log.since(mark, "ERROR", "INTERNAL_ERROR") or ["build_serialized_network returned no plan"]
            raise _GraphFailed([BuildFailure(source.name, "", "", "\n".join(errors))])
        attention = graph.attention
        del graph  # the parser holds the weights until the plan exists
        return self._record(source, plan, bindings, attention, mark, time.perf_counter() - start)

    def _config(self, source: GraphSource):
        config = self.builder.create_builder_config()
        if self.options.workspace_mb is not None:
            config.set_memory_pool_limit(self.trt.MemoryPoolType.WORKSPACE, self.options.workspace_mb << 20)
        self.targets = self.flavour.set_targets(config, self.options.targets)
        self.flavour.set_version_compatible(config, self.options.version_compatible)
        self.flavour.configure(config, compute_dtype(source.io))
        if self.cache is None:
            self.cache = self.flavour.open_build_cache(config, self.out_dir / TIMING_CACHE_FILE, self.log.note)
        else:
            self.flavour.use_build_cache(config, self.cache)
        return config

    def _profiles(self, network, io: GraphSpec) -> list:
        """The contract's profiles, in order (``contract.profiles_of``); none for a static graph."""
        specs = {s.name: s for s in io.inputs}
        profiles = []
        for ranges in profiles_of(io):
            profile = self.builder.create_optimization_profile()
            for i in range(network.num_inputs):
                spec = specs.get(network.get_input(i).name)
                shapes = None if spec is None else profile_shapes(ranges.dims, spec)
                if shapes is not None:
                    profile.set_shape(spec.name, *shapes)
            profiles.append(profile)
        return profiles

    def _record(self, source, plan, bindings, attention, mark, seconds) -> EngineRecord:
        plan_path = self.out_dir / f"{source.name}.plan"
        plan_path.write_bytes(memoryview(plan))
        model = None if source.file_hashes else load_graph(source.onnx_path)
        return EngineRecord(
            name=source.name,
            plan=plan_path.name,
            plan_sha256=hashlib.sha256(memoryview(plan)).hexdigest(),  # from memory: no second read of the file
            plan_bytes=plan_path.stat().st_size,
            sources=dict(source.file_hashes) or {p.name: self._hash(p) for p in source_files(source.onnx_path, model)},
            bindings=tuple(bindings),
            build_seconds=seconds,
            profiles=tuple(p.graph for p in profiles_of(source.io)),
            attention=tuple(attention),
            warnings=tuple(self.log.since(mark, "WARNING")),
            attention_sha256=attention_digest(attention),
        )

    def _hash(self, path: Path) -> str:
        if path not in self._hashes:
            self._hashes[path] = file_sha256(path)
        return self._hashes[path]

    def save_cache(self) -> Path | None:
        return None if self.cache is None else self.flavour.save_build_cache(self.cache, self.out_dir / TIMING_CACHE_FILE)


@dataclass
class ParsedGraph:
    """A parsed network with its attentions bound; the parser holds the weights, keep it alive."""

    network: object
    parser: object
    attention: list[BoundAttention]


def parse_graph(flavour: Flavour, builder, log, source: GraphSource, model: bytes | None = None) -> ParsedGraph:
    """Parse ``source`` (or ``model``, a rewrite of it) into a strongly typed network and bind its
    attentions; ``_GraphFailed`` lists what failed."""
    mark = log.mark()
    network = builder.create_network(flavour.network_flags())
    parser = flavour.trt.OnnxParser(network, log)
    # The source's path either way, so external weight files resolve.
    parsed = parser.parse_from_file(str(source.onnx_path)) if model is None else parser.parse(model, str(source.onnx_path))
    if not parsed:
        failures = []
        for index in range(parser.num_errors):
            error = parser.get_error(index)
            failures.append(BuildFailure(source.name, error.node_name(), error.node_operator(), error.desc()))
        raise _GraphFailed(failures or [BuildFailure(source.name, "", "", "\n".join(log.since(mark)) or "the ONNX parser failed")])
    try:
        bound = bind_attention(flavour.trt, network, attention_nodes(load_graph(source.onnx_path)), flavour.version)
    except AttentionBindError as error:
        raise _GraphFailed([BuildFailure(source.name, error.node, ATTENTION, error.message)]) from error
    return ParsedGraph(network, parser, bound)


def unread_failures(graph: str, network) -> list[BuildFailure]:
    """One failure per tensor nothing reads: TensorRT dropped what it means, so the
    engine would compute something else than the graph (e.g. Attention's
    nonpad_kv_seqlen, which the parser wires to nothing)."""
    why = "nothing in the parsed network reads it: TensorRT dropped what it means, so the engine would compute something else than the graph"
    return [BuildFailure(graph, producer, kind, f"{tensor!r}: {why}", tensor) for tensor, producer, kind in unread_tensors(network)]


def network_bindings(network, profiles=()) -> list[Binding]:
    """The IO of a parsed network, with every profile's min/opt/max for dynamic inputs."""
    bindings = []
    for mode, count, get in ((INPUT, network.num_inputs, network.get_input), (OUTPUT, network.num_outputs, network.get_output)):
        for i in range(count):
            tensor = get(i)
            shape = tuple(int(d) for d in tensor.shape)
            shapes = None
            if mode == INPUT and profiles and -1 in shape:
                shapes = tuple(tuple(tuple(int(d) for d in s) for s in p.get_shape(tensor.name)) for p in profiles)
            bindings.append(Binding(tensor.name, mode, shape, trt_dtype_name(tensor.dtype), shapes))
    return bindings


def unread_tensors(network) -> list[tuple[str, str, str]]:
    """(tensor, producer, kind) for every graph input no layer reads and every
    layer none of whose outputs is read or a network output (a dead layer).

    A layer with one output in use is live: ArgMax becomes a TopK whose
    values output is legitimately unread.
    """
    read = set()
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        read.update(layer.get_input(j).name for j in range(layer.num_inputs) if layer.get_input(j) is not None)
    read.update(network.get_output(i).name for i in range(network.num_outputs))
    unread = [(t.name, "", GRAPH_INPUT) for t in map(network.get_input, range(network.num_inputs)) if t.name not in read]
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        names = [layer.get_output(j).name for j in range(layer.num_outputs)]
        if names and not read.intersection(names):
            unread.extend((name, layer.name, UNREAD_OUTPUT) for name in names)
    return unread
