"""The engine-set manifest, ``engines.json``, written beside the plans.

Layout of an engine-set directory::

    engines.json        this record
    <graph>.plan        one serialized TensorRT plan per exported graph (target_model,
                        draft_model: one per model, a profile per run graph)
    shared_weights.safetensors
                        the target's embedding and LM head, which both models'
                        engines take as inputs (``engines.shared_weights``)
    manifest.json       the export manifest, copied unchanged (hash recorded)
    timing.cache        TensorRT only: the timing cache reused by later builds

``engines.json`` (format_version 4)::

    format, format_version
    flavour             "tensorrt" | "tensorrt_rtx"
    trt_version         e.g. "1.7.1.116"; plans only load on the same version
                        unless build_options.version_compatible
    targets             compute capabilities the plans were built for
    build_options       BuildOptions.to_json()
    source_manifest     {"file", "sha256"} of the export manifest, or null
    engines             {graph name: EngineRecord.to_json()}
    shared_weights      {file, sha256, bytes, tensors: [{name, shape, dtype}]}: the
                        weights both models' engines read (their bindings list
                        them too); null for a set without model engines
    skipped             {graph name: why}: graphs only sampled sessions need
                        that failed to build; the set serves greedy sessions
    probe               the semantics probe (``engines.probe``): its plan, bindings
                        and attention as an engine record, ``spec`` (what it was
                        built for) and ``verdicts``: one per GPU it ran on
                        ({gpu, flavour, trt_version, passed, detail, at}: "build"
                        or "load"), added by the build (a GPU there) or the first
                        load on a GPU; null for a set of hand-made graphs

Each engine records its plan's and source graph's sha256, its profiles (the
run graph each serves, in profile order), the bindings of the built network
(names, shapes, dtypes, every profile's ranges) so the IO can be
checked against the contract on machines that cannot deserialize the plan,
and every attention as built: its ONNX node, causal alignment (``LOWER_RIGHT``
or ``NONE``), the graph tensor bound as its key/value lengths, and whether it
takes a mask, with their sha256 (``attention_sha256``; the plan carries the
same digest as its network name, so the loader checks the records against
the deserialized engine). A set recorded with tensors nothing reads (older
builds allowed it) is refused.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dflash_trt.engines.attention import BoundAttention
from dflash_trt.engines.bindings import Binding
from dflash_trt.errors import EngineError
from dflash_trt.export.contract import TensorSpec

ENGINES_JSON = "engines.json"
PROBE_NAME = "probe"  # the semantics probe's graph and plan: probe.onnx, probe.plan
FORMAT = "dflash-trt/engines"
# 2: one plan per model with a profile per run graph; 3: the semantics probe; 4: the shared weights.
FORMAT_VERSION = 4
SHARED_WEIGHTS_FILE = "shared_weights.safetensors"


@dataclass(frozen=True)
class EngineRecord:
    """One built graph: its plan, its source, its bindings."""

    name: str
    plan: str  # file name inside the engine-set directory
    plan_sha256: str
    plan_bytes: int
    sources: Mapping[str, str]  # source file name (graph + external data) -> sha256
    bindings: tuple[Binding, ...]
    build_seconds: float
    profiles: tuple[str, ...] = ()  # the run graph each optimization profile serves, in order
    attention: tuple[BoundAttention, ...] = ()  # every attention's causality and lengths tensor, as built
    warnings: tuple[str, ...] = ()  # TensorRT's warnings while parsing/building
    attention_sha256: str = ""  # attention.attention_digest(attention), also in the plan (its network name)

    def to_json(self) -> dict:
        return {
            "plan": self.plan,
            "plan_sha256": self.plan_sha256,
            "plan_bytes": self.plan_bytes,
            "sources": dict(self.sources),
            "bindings": [b.to_json() for b in self.bindings],
            "build_seconds": round(self.build_seconds, 3),
            "profiles": list(self.profiles),
            "attention": [a.to_json() for a in self.attention],
            "attention_sha256": self.attention_sha256,
            "warnings": list(self.warnings),
        }

    @classmethod
    def from_json(cls, name: str, data: Mapping) -> EngineRecord:
        if data.get("unread_tensors"):
            msg = (
                f"engine {name!r} was built leaving tensors read by nothing ({list(data['unread_tensors'])}): "
                "it computes something else than its graph; rebuild the set"
            )
            raise EngineError(msg)
        return cls(
            name=name,
            plan=str(data["plan"]),
            plan_sha256=str(data["plan_sha256"]),
            plan_bytes=int(data["plan_bytes"]),
            sources={str(k): str(v) for k, v in data["sources"].items()},
            bindings=tuple(Binding.from_json(b) for b in data["bindings"]),
            build_seconds=float(data["build_seconds"]),
            profiles=tuple(str(p) for p in data.get("profiles", ())),
            attention=tuple(BoundAttention.from_json(a) for a in data.get("attention", ())),
            warnings=tuple(data.get("warnings", ())),
            attention_sha256=str(data.get("attention_sha256", "")),
        )


@dataclass(frozen=True)
class SharedWeightsRecord:
    """The file of the weights both model engines read, and what it holds."""

    file: str
    sha256: str
    bytes: int
    tensors: tuple[TensorSpec, ...]  # contract.SHARED_WEIGHTS, in order

    def to_json(self) -> dict:
        return {"file": self.file, "sha256": self.sha256, "bytes": self.bytes, "tensors": [t.to_json() for t in self.tensors]}

    @classmethod
    def from_json(cls, data: Mapping) -> SharedWeightsRecord:
        return cls(str(data["file"]), str(data["sha256"]), int(data["bytes"]), tuple(TensorSpec.from_json(t) for t in data["tensors"]))


@dataclass(frozen=True)
class Verdict:
    """What the probe found on one GPU, with one TensorRT."""

    gpu: str  # e.g. "NVIDIA GeForce RTX 4090 (sm_89)"
    flavour: str
    trt_version: str
    passed: bool
    detail: str  # what differed, or what was checked
    at: str  # "build" | "load"

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping) -> Verdict:
        return cls(str(data["gpu"]), str(data["flavour"]), str(data["trt_version"]), bool(data["passed"]), str(data["detail"]), str(data["at"]))


@dataclass(frozen=True)
class ProbeRecord:
    """The probe's plan (an engine record), what it was built for, and its verdicts."""

    engine: EngineRecord
    spec: Mapping[str, object]  # engines.probe.ProbeSpec.to_json()
    verdicts: tuple[Verdict, ...] = ()

    def verdict_for(self, gpu: str, flavour: str, version: str) -> Verdict | None:
        """The verdict recorded for this GPU and TensorRT, if any."""
        return next((v for v in self.verdicts if (v.gpu, v.flavour, v.trt_version) == (gpu, flavour, version)), None)

    def to_json(self) -> dict:
        return {**self.engine.to_json(), "spec": dict(self.spec), "verdicts": [v.to_json() for v in self.verdicts]}

    @classmethod
    def from_json(cls, data: Mapping) -> ProbeRecord:
        engine = EngineRecord.from_json(PROBE_NAME, data)
        return cls(engine, dict(data["spec"]), tuple(Verdict.from_json(v) for v in data.get("verdicts", ())))


@dataclass(frozen=True)
class EngineSetRecord:
    """Everything ``engines.json`` says about a set of plans."""

    flavour: str
    trt_version: str
    targets: tuple[str, ...]
    build_options: Mapping[str, object]
    engines: Mapping[str, EngineRecord]
    source_manifest: Mapping[str, str] | None = None
    skipped: Mapping[str, str] = field(default_factory=dict)  # graph -> why it is not in the set
    probe: ProbeRecord | None = None
    shared_weights: SharedWeightsRecord | None = None
    format_version: int = FORMAT_VERSION
    extra: Mapping[str, object] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "format_version": self.format_version,
            "flavour": self.flavour,
            "trt_version": self.trt_version,
            "targets": list(self.targets),
            "build_options": dict(self.build_options),
            "source_manifest": None if self.source_manifest is None else dict(self.source_manifest),
            **dict(self.extra),
            "skipped": dict(self.skipped),
            "probe": None if self.probe is None else self.probe.to_json(),
            "shared_weights": None if self.shared_weights is None else self.shared_weights.to_json(),
            "engines": {name: rec.to_json() for name, rec in self.engines.items()},
        }


def write_engine_set(directory: Path, record: EngineSetRecord) -> Path:
    """Write ``engines.json`` last, atomically: it only ever describes plans that exist."""
    path = Path(directory) / ENGINES_JSON
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record.to_json(), indent=2) + "\n")
    tmp.replace(path)
    return path


def read_engine_set(directory: Path) -> EngineSetRecord:
    """Parse ``engines.json``; ``EngineError`` names the missing or bad field."""
    path = Path(directory) / ENGINES_JSON
    if not path.is_file():
        msg = f"no {ENGINES_JSON} in {directory}: not an engine set (build one with `dflash-trt build`)"
        raise EngineError(msg)
    data = _read_json(path)
    _check_header(path, data)
    try:
        return _record_from_json(data)
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        msg = f"{path}: malformed field ({type(error).__name__}: {error})"
        raise EngineError(msg) from error


MAX_ENGINES_JSON_BYTES = 64 << 20  # a real record is well under 1 MB


def _read_json(path: Path) -> object:
    """The parsed file; every OS / decode failure is an EngineError naming the file."""
    try:
        size = path.stat().st_size
        if size > MAX_ENGINES_JSON_BYTES:
            raise EngineError(f"{path}: {size} bytes, more than any {ENGINES_JSON} ({MAX_ENGINES_JSON_BYTES}); not an engine set record")
        return json.loads(path.read_bytes().decode("utf-8"))
    except OSError as error:
        raise EngineError(f"{path}: cannot be read ({type(error).__name__}: {error.strerror or error})") from error
    except UnicodeDecodeError as error:
        raise EngineError(f"{path} is not UTF-8 text (byte {error.start}): not an engine set record") from error
    except (ValueError, RecursionError) as error:  # JSONDecodeError is a ValueError
        raise EngineError(f"{path} is not valid JSON: {type(error).__name__}: {str(error)[:200]}") from error


def _check_header(path: Path, data: object) -> None:
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        seen = data.get("format") if isinstance(data, dict) else type(data).__name__
        msg = f"{path}: field 'format' must be {FORMAT!r}, got {seen!r}"
        raise EngineError(msg)
    if data.get("format_version") != FORMAT_VERSION:
        msg = f"{path}: field 'format_version' must be {FORMAT_VERSION}, got {data.get('format_version')!r}; rebuild the engines"
        raise EngineError(msg)


def _record_from_json(data: Mapping) -> EngineSetRecord:
    known = {"format", "format_version", "flavour", "trt_version", "targets", "build_options", "source_manifest", "engines", "skipped", "probe", "shared_weights"}
    probe, shared = data.get("probe"), data.get("shared_weights")
    return EngineSetRecord(
        flavour=str(data["flavour"]),
        trt_version=str(data["trt_version"]),
        targets=tuple(str(t) for t in data["targets"]),
        build_options=dict(data["build_options"]),
        engines={str(n): EngineRecord.from_json(str(n), e) for n, e in data["engines"].items()},
        source_manifest=data.get("source_manifest"),
        skipped={str(k): str(v) for k, v in data.get("skipped", {}).items()},
        probe=None if probe is None else ProbeRecord.from_json(probe),
        shared_weights=None if shared is None else SharedWeightsRecord.from_json(shared),
        extra={k: v for k, v in data.items() if k not in known},
    )
