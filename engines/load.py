"""Load an engine set only after checking it, in two stages.

1. ``check_engine_set`` — files + manifest, works on any machine: engines.json
   is well formed, names exactly the contract's engines, every plan exists
   and hashes to what was recorded, and the bindings recorded at build time
   equal the contract (names, shapes, dtypes, profile ranges).
2. ``load_engine_set`` — needs a TensorRT runtime and a GPU it supports: the
   flavour and version that built the set are the ones loading it, the
   runtime says the plan is valid on this GPU (compute capability, driver),
   the plan deserializes, and the engine's own bindings equal the contract.

Every refusal is an ``EngineError`` naming the engine, the binding or file,
and both values; nothing is left half-loaded.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from dflash_trt.engines.bindings import INPUT, OUTPUT, Binding, check_io, trt_dtype_name
from dflash_trt.engines.engine_set import ENGINES_JSON, EngineRecord, EngineSetRecord, read_engine_set
from dflash_trt.engines.flavour import Flavour, load_flavour
from dflash_trt.errors import EngineError
from dflash_trt.export.contract import GraphSpec
from dflash_trt.export.identity import file_sha256


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


def check_engine_set(directory: Path, contract: Mapping[str, GraphSpec]) -> EngineSetRecord:
    """Stage 1 (no TensorRT needed): manifest, plan files, recorded IO vs contract."""
    directory = Path(directory)
    record = read_engine_set(directory)
    _check_engine_names(directory, record, contract)
    for name, engine in record.engines.items():
        _check_plan_file(directory, engine)
        check_io(name, contract[name], engine.bindings, f"{ENGINES_JSON} (bindings recorded at build)")
    return record


def _check_engine_names(directory: Path, record: EngineSetRecord, contract: Mapping[str, GraphSpec]) -> None:
    missing = sorted(set(contract) - set(record.engines))
    extra = sorted(set(record.engines) - set(contract))
    if missing or extra:
        msg = (
            f"{directory / ENGINES_JSON}: engines do not match the contract: "
            f"missing {missing}, not in the contract {extra}"
        )
        raise EngineError(msg)


def _check_plan_file(directory: Path, engine: EngineRecord) -> None:
    path = directory / engine.plan
    if Path(engine.plan).name != engine.plan:
        msg = f"engine {engine.name!r}: plan {engine.plan!r} must be a file name inside {directory}"
        raise EngineError(msg)
    if not path.is_file():
        msg = f"engine {engine.name!r}: plan file {engine.plan!r} named in {ENGINES_JSON} is missing from {directory}"
        raise EngineError(msg)
    size = path.stat().st_size
    if size != engine.plan_bytes:
        msg = f"engine {engine.name!r}: plan {engine.plan!r} has {size} bytes, {ENGINES_JSON} says {engine.plan_bytes}; rebuild the set"
        raise EngineError(msg)
    digest = file_sha256(path)
    if digest != engine.plan_sha256:
        msg = (
            f"engine {engine.name!r}: plan {engine.plan!r} sha256 {digest} differs from "
            f"{ENGINES_JSON}'s {engine.plan_sha256}: the plan changed after the build; rebuild the set"
        )
        raise EngineError(msg)


def check_flavour(record: EngineSetRecord, flavour: Flavour) -> None:
    """Plans load only on the TensorRT that built them (unless version-compatible)."""
    built = f"{record.flavour} {record.trt_version}"
    here = f"{flavour.name} {flavour.version}"
    if record.flavour != flavour.name:
        msg = f"engine set was built with {built}; this loader uses {here}: rebuild with --backend {flavour.name}"
        raise EngineError(msg)
    compatible = bool(record.build_options.get("version_compatible"))
    if record.trt_version != flavour.version and not compatible:
        msg = f"engine set was built with {built}; installed is {here}: plans are tied to their TensorRT version, rebuild them"
        raise EngineError(msg)


def load_engine_set(
    directory: Path, contract: Mapping[str, GraphSpec], flavour: Flavour | None = None
) -> LoadedEngineSet:
    """Stage 1, then deserialize every plan and check its bindings (needs a supported GPU)."""
    directory = Path(directory)
    record = check_engine_set(directory, contract)
    flavour = flavour or load_flavour(record.flavour)
    check_flavour(record, flavour)
    log = flavour.new_log()
    runtime = flavour.new_runtime(log, version_compatible=bool(record.build_options.get("version_compatible")))
    engines = {}
    for name, engine_record in record.engines.items():
        engine = _deserialize(flavour, runtime, log, record, engine_record, directory)
        check_io(name, contract[name], engine_bindings(engine), "the deserialized plan")
        engines[name] = engine
    return LoadedEngineSet(directory, record, flavour, runtime, engines, log)


def _deserialize(flavour: Flavour, runtime, log, record: EngineSetRecord, engine: EngineRecord, directory: Path):
    data = (directory / engine.plan).read_bytes()
    if hashlib.sha256(data).hexdigest() != engine.plan_sha256:
        msg = f"engine {engine.name!r}: plan {engine.plan!r} changed while loading (sha256 differs from {ENGINES_JSON})"
        raise EngineError(msg)
    _check_validity(flavour, runtime, record, engine.name, data)
    mark = log.mark()
    try:
        deserialized = runtime.deserialize_cuda_engine(data)
    except Exception as error:  # the bindings raise plain RuntimeError/TypeError
        deserialized, errors = None, [str(error)]
    else:
        errors = log.since(mark, "ERROR", "INTERNAL_ERROR")
    if deserialized is None:
        detail = "; ".join(errors) or "no message from TensorRT"
        msg = (
            f"engine {engine.name!r}: {record.flavour} {record.trt_version} could not deserialize {engine.plan!r} "
            f"(built for {list(record.targets)}): {detail}"
        )
        raise EngineError(msg)
    return deserialized


def _check_validity(flavour: Flavour, runtime, record: EngineSetRecord, name: str, data: bytes) -> None:
    """Ask the runtime whether this GPU/driver/version can run the plan, before deserializing."""
    if not hasattr(runtime, "get_engine_validity"):
        return  # older TensorRT: deserialization itself reports the problem
    validity, diagnostics = runtime.get_engine_validity(data)
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
    """IO of a deserialized engine, with profile 0's min/opt/max for dynamic inputs."""
    bindings = []
    for i in range(engine.num_io_tensors):
        name = engine.get_tensor_name(i)
        mode = INPUT if engine.get_tensor_mode(name).name == "INPUT" else OUTPUT
        shape = tuple(int(d) for d in engine.get_tensor_shape(name))
        profile = None
        if mode == INPUT and -1 in shape:
            profile = tuple(tuple(int(d) for d in s) for s in engine.get_tensor_profile_shape(name, 0))
        bindings.append(Binding(name, mode, shape, trt_dtype_name(engine.get_tensor_dtype(name)), profile))
    return bindings
