"""Engine IO: what the contract expects, what a built plan has, and the check.

Two views of one graph's IO meet here:

- ``GraphIO`` is the expectation, taken from the export contract: tensor names,
  shapes whose dynamic dims are symbols (``"tokens"``), dtypes, and for every
  symbol its ``DimRange`` (min/opt/max, the optimization profile).
- ``Binding`` is what TensorRT reports for a built network or a deserialized
  engine: ``-1`` for a dynamic dim, and for dynamic inputs the profile's
  min/opt/max shapes.

``io_mismatches`` compares them and names the binding and both values;
``check_io`` turns any mismatch into one ``EngineError`` that also names the
engine. Pure data and functions: nothing here imports TensorRT.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from dflash_trt.errors import EngineError

Dim = int | str  # an int is a static extent; a str names a dynamic dim

# TensorRT DataType member name -> the dtype names used by the contract.
TRT_DTYPES: dict[str, str] = {
    "FLOAT": "float32",
    "HALF": "float16",
    "BF16": "bfloat16",
    "INT8": "int8",
    "INT32": "int32",
    "INT64": "int64",
    "BOOL": "bool",
    "UINT8": "uint8",
    "FP8": "float8e4m3fn",
}

INPUT = "input"
OUTPUT = "output"


@dataclass(frozen=True)
class DimRange:
    """The optimization-profile range of one dynamic dim."""

    min: int
    opt: int
    max: int

    def __post_init__(self) -> None:
        if not 0 <= self.min <= self.opt <= self.max:
            msg = f"dim range must satisfy 0 <= min <= opt <= max, got {self.min}/{self.opt}/{self.max}"
            raise EngineError(msg)


@dataclass(frozen=True)
class TensorSpec:
    """One graph input or output as the contract states it."""

    name: str
    shape: tuple[Dim, ...]
    dtype: str


@dataclass(frozen=True)
class GraphIO:
    """Every input and output of one graph, plus the ranges of its symbols."""

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    dims: Mapping[str, DimRange] = field(default_factory=dict)

    def __post_init__(self) -> None:
        missing = sorted(self.symbols() - set(self.dims))
        if missing:
            msg = f"graph IO uses dynamic dims {missing} without a min/opt/max range (ranges given: {sorted(self.dims)})"
            raise EngineError(msg)

    def symbols(self) -> set[str]:
        return {d for spec in self.inputs + self.outputs for d in spec.shape if isinstance(d, str)}

    @property
    def dynamic(self) -> bool:
        return bool(self.symbols())

    def profile(self, spec: TensorSpec) -> tuple[tuple[int, ...], ...] | None:
        """(min, opt, max) shapes of a dynamic input; None for a static one."""
        if not any(isinstance(d, str) for d in spec.shape):
            return None
        return tuple(
            tuple(getattr(self.dims[d], end) if isinstance(d, str) else d for d in spec.shape)
            for end in ("min", "opt", "max")
        )


@dataclass(frozen=True)
class Binding:
    """One IO tensor of a built network or engine, as TensorRT reports it."""

    name: str
    mode: str  # INPUT | OUTPUT
    shape: tuple[int, ...]  # -1 where dynamic
    dtype: str
    profile: tuple[tuple[int, ...], ...] | None = None  # (min, opt, max) for dynamic inputs

    def to_json(self) -> dict:
        profile = None if self.profile is None else [list(s) for s in self.profile]
        return {"name": self.name, "mode": self.mode, "shape": list(self.shape), "dtype": self.dtype, "profile": profile}

    @classmethod
    def from_json(cls, data: Mapping) -> Binding:
        profile = data.get("profile")
        return cls(
            name=str(data["name"]),
            mode=str(data["mode"]),
            shape=tuple(int(d) for d in data["shape"]),
            dtype=str(data["dtype"]),
            profile=None if profile is None else tuple(tuple(int(d) for d in s) for s in profile),
        )


def trt_dtype_name(dtype) -> str:
    """Contract dtype name of a TensorRT ``DataType`` (either flavour)."""
    return TRT_DTYPES.get(dtype.name, dtype.name.lower())


def expected_shape(spec: TensorSpec) -> tuple[int, ...]:
    """The shape TensorRT reports for ``spec``: symbols become -1."""
    return tuple(-1 if isinstance(d, str) else d for d in spec.shape)


def io_mismatches(expected: GraphIO, actual: Sequence[Binding]) -> list[str]:
    """Every difference between the contract and the bindings, one line each."""
    lines: list[str] = []
    for mode, specs in ((INPUT, expected.inputs), (OUTPUT, expected.outputs)):
        have = {b.name: b for b in actual if b.mode == mode}
        want = {s.name: s for s in specs}
        for name in sorted(want.keys() - have.keys()):
            lines.append(f"{mode} {name!r}: in the contract, missing from the engine")
        for name in sorted(have.keys() - want.keys()):
            lines.append(f"{mode} {name!r}: in the engine, not in the contract")
        for name in sorted(want.keys() & have.keys()):
            lines.extend(_binding_mismatches(expected, want[name], have[name]))
    return lines


def _binding_mismatches(io: GraphIO, spec: TensorSpec, binding: Binding) -> list[str]:
    where = f"{binding.mode} {spec.name!r}"
    lines = []
    if binding.dtype != spec.dtype:
        lines.append(f"{where} dtype: contract {spec.dtype}, engine {binding.dtype}")
    want_shape = expected_shape(spec)
    if binding.shape != want_shape:
        lines.append(f"{where} shape: contract {list(spec.shape)} (= {list(want_shape)}), engine {list(binding.shape)}")
    # Outputs carry no profile in TensorRT; their dynamic extents follow the inputs.
    want_profile = io.profile(spec) if binding.mode == INPUT else None
    if binding.mode == INPUT and binding.profile != want_profile:
        lines.append(f"{where} profile min/opt/max: contract {_show(want_profile)}, engine {_show(binding.profile)}")
    return lines


def _show(profile: tuple[tuple[int, ...], ...] | None) -> str:
    return "none (static)" if profile is None else " / ".join(str(list(s)) for s in profile)


def check_io(engine: str, expected: GraphIO, actual: Sequence[Binding], source: str) -> None:
    """Raise ``EngineError`` naming the engine and every mismatching binding.

    ``source`` says where ``actual`` came from (e.g. "the built network",
    "engines.json", "the deserialized plan") so the message says which
    artifact disagrees with the contract.
    """
    lines = io_mismatches(expected, actual)
    if lines:
        detail = "\n  ".join(lines)
        msg = f"engine {engine!r}: {source} disagrees with the IO contract:\n  {detail}"
        raise EngineError(msg)
