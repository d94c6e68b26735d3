"""Engine IO: what the contract expects, what a built plan has, and the check.

Two views of one graph's IO meet here:

- the contract's ``GraphSpec`` (``dflash_trt.export.contract``): tensor
  names, shapes whose dynamic dims are symbols (``"T"``), dtypes, and its
  optimization profiles (``contract.profiles_of``: one per run graph a model
  computes, each a ``DimRange`` min/opt/max per symbol);
- ``Binding``: what TensorRT reports for a built network or a deserialized
  engine: ``-1`` for a dynamic dim, and for dynamic inputs every profile's
  min/opt/max shapes.

``io_mismatches`` compares them and names the binding and both values;
``check_io`` turns any mismatch into one ``EngineError`` that also names the
engine. Pure data and functions: nothing here imports TensorRT.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dflash_trt.errors import EngineError
from dflash_trt.export.contract import DimRange, GraphSpec, TensorSpec, profiles_of

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


def symbols(graph: GraphSpec) -> set[str]:
    """The dynamic dims a graph's IO uses."""
    return {d for spec in graph.inputs + graph.outputs for d in spec.shape if isinstance(d, str)}


# Float dtypes from the finest to the coarsest rounding.
FLOAT_PRECISION = ("float32", "float16", "bfloat16")


def compute_dtype(graph: GraphSpec) -> str:
    """The precision a graph computes in: its coarsest float binding (a bf16 graph's fp32
    logits were computed in bf16); float32 for graphs with fp32 floats only (the verifiers)."""
    floats = {s.dtype for s in graph.inputs + graph.outputs if s.dtype in FLOAT_PRECISION}
    return max(floats, key=FLOAT_PRECISION.index, default="float32")


def check_ranges(graph: GraphSpec) -> None:
    """Every dynamic dim has a range in every profile, and min <= opt <= max for each."""
    for where, dims in [(p.graph, p.dims) for p in profiles_of(graph)] or [(graph.name, graph.dims)]:
        label = f"graph {graph.name!r}" + (f" profile {where!r}" if where != graph.name else "")
        missing = sorted(symbols(graph) - set(dims))
        if missing:
            msg = f"{label} uses dynamic dims {missing} without a min/opt/max range (ranges given: {sorted(dims)})"
            raise EngineError(msg)
        for dim, r in dims.items():
            if not 0 <= r.min <= r.opt <= r.max:
                msg = f"{label}: dim {dim!r} range must satisfy 0 <= min <= opt <= max, got {r.min}/{r.opt}/{r.max}"
                raise EngineError(msg)


Shapes = tuple[tuple[int, ...], ...]  # (min, opt, max) shapes of one input in one profile


def profile_shapes(dims: Mapping[str, DimRange], spec: TensorSpec) -> Shapes | None:
    """(min, opt, max) shapes of a dynamic input under one profile's ranges; None for a static one."""
    if not any(isinstance(d, str) for d in spec.shape):
        return None
    return tuple(tuple(getattr(dims[d], end) if isinstance(d, str) else d for d in spec.shape) for end in ("min", "opt", "max"))


def input_profiles(graph: GraphSpec, spec: TensorSpec) -> tuple[Shapes, ...] | None:
    """Every profile's (min, opt, max) shapes of a dynamic input, in profile order; None for a static one."""
    if not any(isinstance(d, str) for d in spec.shape):
        return None
    return tuple(profile_shapes(p.dims, spec) for p in profiles_of(graph))


@dataclass(frozen=True)
class Binding:
    """One IO tensor of a built network or engine, as TensorRT reports it."""

    name: str
    mode: str  # INPUT | OUTPUT
    shape: tuple[int, ...]  # -1 where dynamic
    dtype: str
    profiles: tuple[Shapes, ...] | None = None  # dynamic inputs: (min, opt, max) in each profile

    def to_json(self) -> dict:
        profiles = None if self.profiles is None else [[list(s) for s in p] for p in self.profiles]
        return {"name": self.name, "mode": self.mode, "shape": list(self.shape), "dtype": self.dtype, "profiles": profiles}

    @classmethod
    def from_json(cls, data: Mapping) -> Binding:
        profiles = data.get("profiles")
        return cls(
            name=str(data["name"]),
            mode=str(data["mode"]),
            shape=tuple(int(d) for d in data["shape"]),
            dtype=str(data["dtype"]),
            profiles=None if profiles is None else tuple(tuple(tuple(int(d) for d in s) for s in p) for p in profiles),
        )


def trt_dtype_name(dtype) -> str:
    """Contract dtype name of a TensorRT ``DataType`` (either flavour)."""
    return TRT_DTYPES.get(dtype.name, dtype.name.lower())


def expected_shape(spec: TensorSpec) -> tuple[int, ...]:
    """The shape TensorRT reports for ``spec``: symbols become -1."""
    return tuple(-1 if isinstance(d, str) else d for d in spec.shape)


def io_mismatches(expected: GraphSpec, actual: Sequence[Binding]) -> list[str]:
    """Every difference between the contract and the bindings, one line each."""
    check_ranges(expected)
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


def _binding_mismatches(graph: GraphSpec, spec: TensorSpec, binding: Binding) -> list[str]:
    where = f"{binding.mode} {spec.name!r}"
    lines = []
    if binding.dtype != spec.dtype:
        lines.append(f"{where} dtype: contract {spec.dtype}, engine {binding.dtype}")
    want_shape = expected_shape(spec)
    if binding.shape != want_shape:
        lines.append(f"{where} shape: contract {list(spec.shape)} (= {list(want_shape)}), engine {list(binding.shape)}")
    # Outputs carry no profile in TensorRT; their dynamic extents follow the inputs.
    if binding.mode == INPUT:
        want = input_profiles(graph, spec)
        if (want is None) != (binding.profiles is None) or (want is not None and len(want) != len(binding.profiles)):
            lines.append(f"{where} profiles: contract {_count(want)}, engine {_count(binding.profiles)}")
        elif want is not None:
            names = [p.graph for p in profiles_of(graph)]
            for name, mine, theirs in zip(names, want, binding.profiles):
                if mine != theirs:
                    lines.append(f"{where} profile {name!r} min/opt/max: contract {_show(mine)}, engine {_show(theirs)}")
    return lines


def _count(profiles) -> str:
    return "none (static)" if profiles is None else f"{len(profiles)}"


def _show(profile: Shapes | None) -> str:
    return "none (static)" if profile is None else " / ".join(str(list(s)) for s in profile)


def check_io(engine: str, expected: GraphSpec, actual: Sequence[Binding], source: str) -> None:
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
