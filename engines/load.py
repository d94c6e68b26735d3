"""Load an engine set only after checking it, in two stages.

1. ``check_engine_set`` — files + manifest, works on any machine: engines.json
   is well formed, names exactly the contract's engines (its exported
   graphs), every plan exists and hashes to what was recorded, each engine's
   profiles serve the contract's run graphs in the contract's order, the
   bindings recorded at build time equal the contract (names, shapes,
   dtypes, every profile's ranges; the models' with the shared weights), every
   attention record is one the build makes and the records hash to their
   recorded digest, the probe's plan and bindings are there, and the shared
   weights' file (the target's embedding and head, inputs of both model
   engines: ``engines.shared_weights``) is there, hashes to its record and
   holds what the models read.
2. ``load_engine_set`` — needs a TensorRT runtime and a GPU it supports: the
   flavour and version that built the set are the ones loading it, the
   runtime says the plan is valid on this GPU (compute capability, driver;
   asked on the plan's header), the plan deserializes streamed from its file
   and hashed on the way (``plan_reader``: stage 1 then checks sizes only,
   so each plan is read once), the engine's name (the digest of its
   attention as built) matches engines.json's attention records, the
   engine's own bindings equal the contract, and
   every ``present_*`` cache output is the in-place alias of its ``past_*``
   input (the runtime binds both to the same pool rows), and the semantics
   probe passed on this GPU with this TensorRT (``prove``: the verdict
   recorded in engines.json, else the probe runs now and its verdict is
   recorded).

Every refusal is an ``EngineError`` naming the engine, the binding or file,
and both values; nothing is left half-loaded.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from dflash_trt.engines.attention import attention_digest, attention_tag, record_problems
from dflash_trt.engines.calls import trt_call
from dflash_trt.engines.plan_reader import plan_reader_class
from dflash_trt.engines.bindings import INPUT, OUTPUT, Binding, check_io, trt_dtype_name
from dflash_trt.engines.engine_set import ENGINES_JSON, PROBE_NAME, EngineRecord, EngineSetRecord, read_engine_set, write_engine_set
from dflash_trt.engines.flavour import Flavour, runtime_flavour
from dflash_trt.engines.verdict import Site, check_verdict, run_probe
from dflash_trt.errors import EngineError
from dflash_trt.export.contract import (
    CTX_TAPS,
    LOGITS,
    MODEL_KINDS,
    SHARED_WEIGHTS,
    TAPS,
    GraphSpec,
    TensorSpec,
    present_of,
    profiles_of,
    sampled_only,
    shared_weight_specs,
    with_shared_weights,
)
from dflash_trt.export.identity import file_sha256
from dflash_trt.export.manifest import MANIFEST_FILE

AUTO = object()  # load_engine_set's site: the current CUDA device, if any


@dataclass
class LoadedEngineSet:
    """Deserialized engines, checked; the runtime must outlive them."""

    directory: Path
    record: EngineSetRecord
    flavour: Flavour
    runtime: object
    engines: dict[str, object]  # name -> ICudaEngine
    log: object

    def close(self) -> None:
        """Engines first, then the runtime that deserialized them."""
        self.engines.clear()
        self.runtime = None


def check_engine_set(directory: Path, contract: Mapping[str, GraphSpec], hash_plans: bool = True) -> EngineSetRecord:
    """Stage 1 (no TensorRT needed): manifest, plan files (sizes; sha256 unless ``hash_plans`` is
    False: the loader hashes each plan while it streams it into the runtime), recorded IO vs
    contract, attention records."""
    return _checked_set(Path(directory), contract, hash_plans)[0]


def _checked_set(directory: Path, contract: Mapping[str, GraphSpec], hash_plans: bool) -> tuple[EngineSetRecord, dict[str, GraphSpec]]:
    """``check_engine_set``: the record, and the contract its engines have (``engine_contract``)."""
    record = read_engine_set(directory)
    _check_source_manifest(directory, record)
    _check_engine_names(directory, record, contract)
    contract = engine_contract(directory, record, contract, hash_plans)
    for name, engine in record.engines.items():
        _check_plan_file(directory, engine, hash_plans)
        _check_profiles(directory, engine, contract[name])
        check_io(name, contract[name], engine.bindings, f"{ENGINES_JSON} (bindings recorded at build)")
        _check_attention(directory, engine)
    _check_probe(directory, record, hash_plans)
    return record, contract


def engine_contract(directory: Path, record: EngineSetRecord, contract: Mapping[str, GraphSpec], hash_file: bool = True) -> dict[str, GraphSpec]:
    """The contract the set's engines have: the models' IO plus the shared weights engines.json
    records (``contract.with_shared_weights``), once their file and record check out."""
    models = [name for name in record.engines if contract[name].kind in MODEL_KINDS]
    shared = record.shared_weights
    where = f"{directory / ENGINES_JSON}: field 'shared_weights'"
    if shared is None:
        if models:
            raise EngineError(f"{where} is null, yet the set has model engines {models} (they read the shared weights); rebuild the set")
        return dict(contract)
    names = tuple(t.name for t in shared.tensors)
    if names != SHARED_WEIGHTS:
        raise EngineError(f"{where}: tensors must be {list(SHARED_WEIGHTS)}, got {list(names)}; rebuild the set")
    problems = [line for name in models for line in shared_problems(contract[name], shared.tensors)]
    if problems:
        raise EngineError(f"{where}: {'; '.join(problems)}; rebuild the set")
    _check_file(directory, shared.file, shared.bytes, shared.sha256 if hash_file else None, "shared weights")
    return with_shared_weights(contract, shared.tensors)


def shared_problems(model: GraphSpec, tensors: tuple[TensorSpec, ...]) -> list[str]:
    """How recorded shared weights differ from what ``model`` reads: [V, H] and [H, V] of its dtype,
    V the target's vocabulary (the draft's IO does not name V)."""
    embedding = tensors[0]
    dtype = next(s.dtype for s in model.inputs + model.outputs if s.name in (TAPS, CTX_TAPS))
    vocab = next((s.shape[-1] for s in model.outputs if s.name == LOGITS), embedding.shape[0])
    hidden = embedding.shape[1] if len(embedding.shape) == 2 else -1
    want = shared_weight_specs(vocab, hidden, dtype)
    return [f"{got.name} is {list(got.shape)} {got.dtype}, {model.name} reads {list(w.shape)} {w.dtype}" for got, w in zip(tensors, want) if got != w]


def _check_attention(directory: Path, engine: EngineRecord) -> None:
    """Each record is an attention the build makes (``attention.record_problems``), and the records
    hash to what the build recorded: a hand-edited record is refused naming the field."""
    where = f"{directory / ENGINES_JSON}: engine {engine.name!r}"
    problems = record_problems(engine.attention)
    if problems:
        raise EngineError(f"{where}: {'; '.join(problems)}; rebuild the set")
    digest = attention_digest(engine.attention)
    if engine.attention and engine.attention_sha256 != digest:
        msg = (
            f"{where}: field 'attention' hashes to {digest}, field 'attention_sha256' says {engine.attention_sha256!r}: "
            "the attention records were edited after the build; rebuild the set"
        )
        raise EngineError(msg)


def _check_probe(directory: Path, record: EngineSetRecord, hash_plans: bool = True) -> None:
    """The probe's plan is there and its recorded IO is the probe its spec describes; a set whose
    attention relies on TensorRT's causal alignment or key/value lengths and has no probe is
    refused (nothing would prove their semantics)."""
    from dflash_trt.engines.probe import ProbeSpec, probe_io

    where = directory / ENGINES_JSON
    if record.probe is None:
        if any(a.causal != "NONE" or a.lengths for engine in record.engines.values() for a in engine.attention):
            msg = (
                f"{where}: field 'probe' is null, yet the set's attention relies on TensorRT's causal alignment and "
                "key/value lengths: nothing would prove that TensorRT computes them as the graphs mean on this GPU; "
                "rebuild the set with `dflash-trt build --onnx DIR`"
            )
            raise EngineError(msg)
        return
    try:
        spec = ProbeSpec.from_json(record.probe.spec)
    except (KeyError, TypeError, ValueError) as error:
        raise EngineError(f"{where}: field 'probe.spec' is malformed ({type(error).__name__}: {error}); rebuild the set") from error
    _check_plan_file(directory, record.probe.engine, hash_plans)
    _check_attention(directory, record.probe.engine)
    check_io(PROBE_NAME, probe_io(spec), record.probe.engine.bindings, f"{ENGINES_JSON} (bindings recorded at build)")


def _check_profiles(directory: Path, engine: EngineRecord, io: GraphSpec) -> None:
    """Profile k must serve the contract's k-th run graph: the runtime selects profiles by index."""
    want = tuple(p.graph for p in profiles_of(io))
    if engine.profiles != want:
        msg = (
            f"{directory / ENGINES_JSON}: engine {engine.name!r} profiles serve {list(engine.profiles)}, "
            f"the contract's are {list(want)}; rebuild the set"
        )
        raise EngineError(msg)


def _check_source_manifest(directory: Path, record: EngineSetRecord) -> None:
    """The export manifest beside the plans (the runtime reads its dims) must be the one they were built from."""
    source, beside = record.source_manifest, directory / MANIFEST_FILE
    where = directory / ENGINES_JSON
    if source is None:
        if beside.exists():
            msg = (
                f"{where} records no source_manifest, yet {beside} is present: nothing ties them together; "
                "rebuild the set with `dflash-trt build --onnx DIR` so the manifest's hash is recorded"
            )
            raise EngineError(msg)
        return
    if not isinstance(source, Mapping) or source.get("file") != MANIFEST_FILE or not isinstance(source.get("sha256"), str):
        msg = f"{where}: field 'source_manifest' must be {{'file': {MANIFEST_FILE!r}, 'sha256': hex}} or null, got {source!r}"
        raise EngineError(msg)
    if not beside.is_file():
        raise EngineError(f"{where} was built from {MANIFEST_FILE} (sha256 {source['sha256']}), which is missing from {directory}")
    digest = file_sha256(beside)
    if digest != source["sha256"]:
        msg = (
            f"{beside} has sha256 {digest} but {where} records {source['sha256']}: "
            "the manifest beside the plans is not the one they were built from (copy the right one, or rebuild)"
        )
        raise EngineError(msg)


def _check_engine_names(directory: Path, record: EngineSetRecord, contract: Mapping[str, GraphSpec]) -> None:
    """Every engine is a contract graph; every contract graph is there, except those only sampled
    sessions need (a greedy-only set: the runtime refuses sampled sessions on it)."""
    missing = sorted(name for name in set(contract) - set(record.engines) if not sampled_only(name))
    extra = sorted(set(record.engines) - set(contract))
    if missing or extra:
        msg = (
            f"{directory / ENGINES_JSON}: engines do not match the contract: "
            f"missing {missing}, not in the contract {extra}"
        )
        raise EngineError(msg)


def _check_plan_file(directory: Path, engine: EngineRecord, hash_plans: bool = True) -> None:
    _check_file(directory, engine.plan, engine.plan_bytes, engine.plan_sha256 if hash_plans else None, f"engine {engine.name!r}: plan")


def _check_file(directory: Path, name: str, size: int, sha256: str | None, label: str) -> None:
    """A file engines.json names: inside ``directory``, there, of its recorded size and (unless
    ``sha256`` is None: hashed later, as it is read) of its recorded sha256."""
    path = directory / name
    if Path(name).name != name:
        raise EngineError(f"{label} {name!r} must be a file name inside {directory}")
    if not path.is_file():
        raise EngineError(f"{label} file {name!r} named in {ENGINES_JSON} is missing from {directory}")
    have = path.stat().st_size
    if have != size:
        raise EngineError(f"{label} {name!r} has {have} bytes, {ENGINES_JSON} says {size}; rebuild the set")
    if sha256 is None:
        return
    digest = file_sha256(path)
    if digest != sha256:
        msg = f"{label} {name!r} sha256 {digest} differs from {ENGINES_JSON}'s {sha256}: the file changed after the build; rebuild the set"
        raise EngineError(msg)


def check_flavour(record: EngineSetRecord, flavour: Flavour) -> None:
    """Plans load only on the TensorRT that built them, unless version-compatible (then also on a
    later TensorRT of the same major, or the lean / dispatch runtime)."""
    flavour.check_record(record)


def load_engine_set(
    directory: Path, contract: Mapping[str, GraphSpec], flavour: Flavour | None = None, site: Site | None | object = AUTO
) -> LoadedEngineSet:
    """Stage 1, then deserialize every plan and check its bindings, then the probe's verdict for
    this GPU (run now if none is recorded). ``site``: where the probe runs (default: the current
    CUDA device). Needs a GPU the plans run on."""
    directory = Path(directory)
    # Each plan is hashed as it streams in, the shared weights' file as the runtime reads it.
    record, contract = _checked_set(directory, contract, hash_plans=False)
    flavour = flavour or runtime_flavour(record)
    check_flavour(record, flavour)
    log = flavour.new_log()
    runtime = flavour.new_runtime(log, version_compatible=bool(record.build_options.get("version_compatible")))
    engines = {}
    for name, engine_record in record.engines.items():
        engine = deserialize(flavour, runtime, log, record, engine_record, directory)
        check_io(name, contract[name], engine_bindings(engine), "the deserialized plan")
        check_aliases(name, contract[name], engine)
        engines[name] = engine
    record = prove(directory, record, flavour, runtime, log, Site.current() if site is AUTO else site)
    return LoadedEngineSet(directory, record, flavour, runtime, engines, log)


def prove(directory: Path, record: EngineSetRecord, flavour: Flavour, runtime, log, site: Site | None) -> EngineSetRecord:
    """The probe's verdict for this GPU and TensorRT: the recorded one, else run it now and record
    it in engines.json (a set in a read-only directory runs it at every load). A failed verdict
    refuses the set (``verdict.check_verdict``)."""
    probe = record.probe
    if probe is None:  # a set of hand-made graphs without attention (check_engine_set refuses the others)
        return record
    if site is None:
        msg = f"engine set {directory}: the semantics probe must run on the GPU that serves the set, and no CUDA GPU is visible"
        raise EngineError(msg)
    verdict = probe.verdict_for(site.gpu, flavour.name, flavour.version)
    if verdict is None:
        from dflash_trt.engines.probe import ProbeSpec

        engine = deserialize(flavour, runtime, log, record, probe.engine, directory)
        verdict = run_probe(flavour, engine, ProbeSpec.from_json(probe.spec), site, "load")
        record = replace(record, probe=replace(probe, verdicts=(*probe.verdicts, verdict)))
        _save_verdict(directory, record)
    check_verdict(directory, verdict)
    return record


def _save_verdict(directory: Path, record: EngineSetRecord) -> None:
    try:
        write_engine_set(directory, record)
    except OSError as error:
        logging.getLogger(__name__).warning("cannot record the probe's verdict in %s (%s): it runs again at the next load", directory / ENGINES_JSON, error)


def check_aliases(name: str, io: GraphSpec, engine) -> None:
    """Every cache output must alias its input (the KV-cache update writes in place): an engine
    that writes ``present_*`` elsewhere would, bound to the same buffer, race its own reads."""
    query = getattr(engine, "get_aliased_input_tensor", None)
    if query is None:  # TensorRT before 10.15: no query, and no in-place cache update either
        return
    wrong = [(present_of(s.name), s.name, query(present_of(s.name))) for s in io.cache_inputs]
    wrong = [(out, want, got) for out, want, got in wrong if got != want]
    if wrong:
        detail = "; ".join(f"output {out!r} aliases {got!r}, expected input {want!r}" for out, want, got in wrong)
        msg = f"engine {name!r}: the deserialized plan does not update its caches in place: {detail}"
        raise EngineError(msg)


def deserialize(flavour: Flavour, runtime, log, record: EngineSetRecord, engine: EngineRecord, directory: Path):
    """The plan of ``engine`` as an ICudaEngine: validity asked on its header, then streamed into the
    runtime and hashed on the way (``plan_reader``: one read of the file), the digest and the
    plan's attention tag checked against engines.json before the engine is handed out."""
    path = directory / engine.plan
    header = getattr(runtime, "engine_header_size", None)
    reader_class = plan_reader_class(flavour.trt) if header else None
    if reader_class is None:  # an older runtime: the plan whole in host memory, hashed from there
        data = path.read_bytes()
        _check_validity(flavour, runtime, record, engine.name, data)
        deserialized = _deserialize(runtime, log, data)
        digest = hashlib.sha256(data).hexdigest()
    else:
        with open(path, "rb") as handle:
            _check_validity(flavour, runtime, record, engine.name, handle.read(int(header)))
        reader = reader_class(path)
        try:
            deserialized = _deserialize(runtime, log, reader)
            digest = reader.sha256()
        finally:
            reader.close()
    if digest != engine.plan_sha256:
        msg = (
            f"engine {engine.name!r}: plan {engine.plan!r} sha256 {digest} differs from {ENGINES_JSON}'s {engine.plan_sha256}: "
            "the plan changed after the build (or while loading); rebuild the set"
        )
        raise EngineError(msg)
    if isinstance(deserialized, list):
        detail = "; ".join(deserialized) or "no message from TensorRT"
        msg = (
            f"engine {engine.name!r}: {record.flavour} {record.trt_version} could not deserialize {engine.plan!r} "
            f"(built for {list(record.targets)}): {detail}"
        )
        raise EngineError(msg)
    check_attention_tag(engine, getattr(deserialized, "name", None))
    return deserialized


def _deserialize(runtime, log, source):
    """The engine, or TensorRT's error messages (a list) when it made none."""
    mark = log.mark()
    try:
        deserialized = runtime.deserialize_cuda_engine(source)
    except Exception as error:  # the bindings raise plain RuntimeError/TypeError
        return [str(error)]
    return deserialized if deserialized is not None else log.since(mark, "ERROR", "INTERNAL_ERROR")


def check_attention_tag(engine: EngineRecord, name: str | None) -> None:
    """The network name the build gave the plan (``attention.attention_tag`` of its attention as
    built) must be that of engines.json's attention records: a record edited after the build (an
    upper-left or lengthless attention declared correct, or the reverse) is refused. A runtime
    that does not report the name (``None``) leaves the records to the digest of stage 1."""
    if name is None or not engine.attention:
        return
    want = attention_tag(engine.attention)
    if name != want:
        msg = (
            f"engine {engine.name!r}: field 'attention' of {ENGINES_JSON} is not what the plan was built with "
            f"(the plan says {name!r}, the records hash to {want!r}): engines.json was edited after the build; rebuild the set"
        )
        raise EngineError(msg)


def _check_validity(flavour: Flavour, runtime, record: EngineSetRecord, name: str, data: bytes) -> None:
    """Ask the runtime whether this GPU/driver/version can run the plan, before deserializing."""
    if not hasattr(runtime, "get_engine_validity"):
        return  # older TensorRT: deserialization itself reports the problem
    validity, diagnostics = trt_call(f"engine {name!r}", "get_engine_validity", runtime.get_engine_validity, data)
    if validity.name != "INVALID":
        return
    reasons = _diagnostic_names(flavour, int(diagnostics)) or ["no diagnostic: is a CUDA GPU and driver present?"]
    msg = (
        f"engine {name!r}: {flavour.name} {flavour.version} says this plan cannot run here: "
        f"{', '.join(reasons)} (plan built with {record.flavour} {record.trt_version} for {list(record.targets)})"
    )
    raise EngineError(msg)


def _diagnostic_names(flavour: Flavour, bits: int) -> list[str]:
    enum = getattr(flavour.trt, "EngineInvalidityDiagnostics", None)
    if enum is None:
        return [f"diagnostics bits {bits:#x}"] if bits else []
    return [name for name, member in enum.__members__.items() if bits & int(member)]


def engine_bindings(engine) -> list[Binding]:
    """IO of a deserialized engine, with every profile's min/opt/max for dynamic inputs."""
    bindings = []
    for i in range(engine.num_io_tensors):
        name = engine.get_tensor_name(i)
        mode = INPUT if engine.get_tensor_mode(name).name == "INPUT" else OUTPUT
        shape = tuple(int(d) for d in engine.get_tensor_shape(name))
        profiles = None
        if mode == INPUT and -1 in shape:
            profiles = tuple(
                tuple(tuple(int(d) for d in s) for s in engine.get_tensor_profile_shape(name, k))
                for k in range(engine.num_optimization_profiles)
            )
        bindings.append(Binding(name, mode, shape, trt_dtype_name(engine.get_tensor_dtype(name)), profiles))
    return bindings
