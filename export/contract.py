"""The IO contract of every exported graph: names, shapes, dtypes, order.

Written once here; the exporter, the engine builder, the runtime and the tests
import it. A graph's inputs and outputs appear in exactly this order, and the
exported ONNX files declare exactly these bindings (a test checks by set
equality, plus shapes and dtypes).

Symbols: ``n`` owners (a static graph exists for every n in 1..max_owners),
``P`` proposals, ``B`` block size, ``V`` vocabulary, ``W`` tap width
(m * hidden), ``L`` max context, ``K``/``D`` kv heads / head dim of the
target (``Kd``/``Dd`` of the draft), ``M`` the model dtype (float32, float16
or bfloat16). ``"T"`` and ``"C"`` (1..max_chunk) and ``"R"`` (1..n·(P+1) for
max_owners n) are the only dynamic dims of the run graphs; the exported
models add ``"N"`` (owners), ``"S"`` (tokens per owner) and ``"Q"`` (picked rows).

Verify lengths: a cycle may verify only the first ``k`` of the draft's P
proposals, for ``k`` in ``Dims.verify_proposals`` (ascending, the last is P;
default ``default_verify_proposals``: 3, 7, 15 for P = 15). The graphs at
``k = P`` keep their names; a shorter ``k`` adds ``target_verify_{n}_p{k}``,
``verify_argmax_{n}_p{k}`` and ``verify_sample_{n}_p{k}``: the graphs below
with ``k`` in place of P (``[n, k+1]`` candidates and rows). An artifact set
without the field offers P only.

==================  ===========================================  ===========================================
graph               inputs                                       outputs
==================  ===========================================  ===========================================
target_prefill      tokens [1, T] int64, start [1] int64,        logits [1, V] float32 (last row only),
                    past_key_l / past_value_l [1, K, L, D] M     taps [1, T, W] M, present_key_l/_value_l
target_verify_{n}   tokens [n, P+1] int64, start [n] int64,      logits [n, P+1, V] float32,
                    past_key_l / past_value_l [n, K, L, D] M     taps [n, P+1, W] M, present_key_l/_value_l
target_decode_{n}   tokens [n, 1] int64, start [n] int64,        logits [n, V] float32,
                    past_key_l / past_value_l [n, K, L, D] M     taps [n, 1, W] M, present_key_l/_value_l
draft_context       taps [1, C, W] M, start [1] int64,           present_key_l / present_value_l
                    past_key_l / past_value_l [1, Kd, L, Dd] M
draft_{n}           ctx_taps [n, B, W] M, ctx_start [n] int64,   proposals [n, P] int64,
                    ctx_count [n] int64, anchor [n] int64,       present_key_l / present_value_l
                    past_key_l / past_value_l [n, Kd, L, Dd] M
verify_argmax_{n}   logits [n, P+1, V] float32,                  accepted [n] int64, next_token [n] int64
                    candidates [n, P+1] int64
verify_sample_{n}   logits, candidates (as above),               accepted [n] int64, next_token [n] int64
                    temperature [n] float32, top_k [n] int64,
                    top_p [n] float32, seed [n, 3] int64,
                    position [n] int64
{kind}_{n}_p{k}     target_verify, verify_argmax, verify_sample  their outputs; a verify length k < P
                    inputs with k in place of P (k + 1 rows)
sample              logits [R, V] float32, temperature [R]       token [R] int64
                    float32, top_k [R] int64, top_p [R] float32,
                    seed [R, 3] int64, position [R] int64
==================  ===========================================  ===========================================

The graphs above are what the runtime runs ("run graphs"). The export holds
fewer files, so that every model's weights exist once: ONE network per model
computes all of its run graphs at different shapes, and the small graphs are
exported as they are ("exported graphs", ``export_specs``):

==================  ===========================================  ===========================================
exported graph      inputs                                       outputs
==================  ===========================================  ===========================================
target_model        tokens [N, S] int64, start [N] int64,        logits [N, Q, V] float32 (rows ``picks``
                    picks [Q] int64,                             of every owner), taps [N, S, W] M,
                    past_key_l / past_value_l [N, K, L, D] M     present_key_l/_value_l
draft_model         ctx_taps [N, C, W] M, ctx_start [N] int64,   proposals [N, P] int64,
                    ctx_count [N] int64, anchor [N] int64,       present_key_l / present_value_l
                    past_key_l / past_value_l [N, Kd, L, Dd] M
==================  ===========================================  ===========================================

Each run graph is one ``Profile`` of its exported graph (a TensorRT
optimization profile; ``profiles_of``), fed as follows:

- ``target_prefill``: N 1, S = T, picks = [T-1] (logits [1, 1, V] are the run graph's [1, V]);
- ``target_verify_{n}``: N n, S = Q = P+1, picks = 0..P (``target_verify_{n}_p{k}``: S = Q = k+1, picks = 0..k);
- ``target_decode_{n}``: N n, S = Q = 1, picks = [0] (logits [n, 1, V] are [n, V]);
- ``draft_context``: N 1, C = C, ctx_taps = taps, ctx_start = start, ctx_count = [C],
  anchor = [-1]: a negative anchor writes no block, proposals are not read;
- ``draft_{n}``: N n, C = B, as it is.

Cache bindings (``past_*`` in, ``present_*`` out, per layer l, interleaved
key/value in layer order) are meant to be bound to the SAME buffer: the graph
writes the new rows in place. Graph batch index i is owner i and addresses the
i-th of n CONSECUTIVE cache rows: the caller binds a view of the pool that
starts at the first owner's row, so no graph takes a ``rows`` input.

Semantics (positions are cache slots):

- ``target_*``: row i holds tokens at ``start[i] ..``; their K/V are written at
  those slots and attention is causal over slots ``< start[i] + T`` (plus the
  layer's sliding window). Taps are the residual outputs of the tap layers.
  ``target_decode_{n}`` is plain decoding: one token per owner, the logits of
  the token after it (speculation off, or a block no longer fits the cache).
- ``draft_context``: context rows ``taps`` at ``start ..`` into the draft cache.
- ``draft_{n}``: the ``ctx_count`` real rows of ``ctx_taps`` are written at
  ``ctx_start ..``, the block ``[anchor, MASK × (B-1)]`` runs (and is
  written) at ``ctx_start + ctx_count``; ``proposals`` = argmax of the
  target's head over block slots 1..P. Other slots keep their values.
- ``verify_*``: ``candidates`` = [anchor, d_1..d_P] (``_p{k}``: [anchor, d_1..d_k]);
  ``accepted`` = longest prefix with ``d_{i+1} == choice_i``; ``next_token`` = ``choice[accepted]``.
  ``choice_j`` of owner i is the target's token at position ``position[i] + j``
  (verify_argmax: the argmax).
- ``sample``: row r's token at ``position[r]``; it and ``verify_sample_{n}``
  compute ``export.sampling.choose``: temperature (0 = argmax), top_k (0 =
  off, <= min(3840, V)), top_p (>= 1 = off), ``seed`` = the session's 64-bit
  seed as three parts < 2**22, low first (``sampling.seed_parts``).

TensorRT engine sets add two inputs to both models' engines, ``shared_embedding``
[V, H] M (the rows the token ids gather) and ``shared_head`` [H, V] M (hidden
rows @ head = logits): the target's embedding and LM head, which the draft
reads too. TensorRT plans share no weights, so the build lifts them out of
both networks into one file beside the plans and the runtime binds one device
copy to every context of both engines (``with_shared_weights``; ``H`` is the
hidden size, recorded by the build). ONNX Runtime and torch run the exported
graphs as they are.

Pure data: no torch, no onnx. Dtype names are ``float32``, ``float16``,
``bfloat16``, ``int64`` (the names TensorRT and ONNX reports map to).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace

from dflash_trt.checks import is_int

Dim = int | str  # an int is a static extent; a str names a dynamic dim

# Export dtype labels (CLI, manifest) -> contract dtype names of the model tensors.
DTYPES: dict[str, str] = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
INT64 = "int64"
FLOAT32 = "float32"

# Contract dtype name -> ONNX element type (the values of onnx.TensorProto.FLOAT etc.,
# written out so that this module and the runtime need not import onnx).
ONNX_ELEMENT_TYPES: dict[str, int] = {
    "float32": 1,
    "uint8": 2,
    "int8": 3,
    "int32": 6,
    "int64": 7,
    "bool": 9,
    "float16": 10,
    "bfloat16": 16,
    "float8e4m3fn": 17,
}

# Graph kinds. Static kinds exist once per owner count n and are named f"{kind}_{n}".
TARGET_PREFILL = "target_prefill"
TARGET_VERIFY = "target_verify"
TARGET_DECODE = "target_decode"
DRAFT_CONTEXT = "draft_context"
DRAFT = "draft"
VERIFY_ARGMAX = "verify_argmax"
VERIFY_SAMPLE = "verify_sample"
SAMPLE = "sample"
# Exported networks, one per model: each computes several run graphs (its profiles).
TARGET_MODEL = "target_model"
DRAFT_MODEL = "draft_model"
MODEL_KINDS = (TARGET_MODEL, DRAFT_MODEL)
DYNAMIC_KINDS = (TARGET_PREFILL, DRAFT_CONTEXT, SAMPLE)
STATIC_KINDS = (TARGET_VERIFY, TARGET_DECODE, DRAFT, VERIFY_ARGMAX, VERIFY_SAMPLE)
KINDS = DYNAMIC_KINDS + STATIC_KINDS
# Kinds only sampled sessions need: an engine set may lack them (greedy only).
SAMPLED_KINDS = (VERIFY_SAMPLE,)
# Kinds with a graph per verify length k (``Dims.verify_proposals``): ``f"{kind}_{n}_p{k}"`` for k < P.
LENGTH_KINDS = (TARGET_VERIFY, VERIFY_ARGMAX, VERIFY_SAMPLE)

# Tensor names.
TOKENS = "tokens"
START = "start"
LOGITS = "logits"
TAPS = "taps"
CTX_TAPS = "ctx_taps"
CTX_START = "ctx_start"
CTX_COUNT = "ctx_count"
ANCHOR = "anchor"
PROPOSALS = "proposals"
CANDIDATES = "candidates"
TEMPERATURE = "temperature"
TOP_K = "top_k"
TOP_P = "top_p"
SEED = "seed"
POSITION = "position"
ACCEPTED = "accepted"
NEXT_TOKEN = "next_token"
TOKEN = "token"
PICKS = "picks"

# Dynamic dims.
TOKENS_DIM = "T"  # target_prefill token count
CONTEXT_DIM = "C"  # draft_context row count
ROWS_DIM = "R"  # sample row count
OWNERS_DIM = "N"  # owners of one model run
STEP_DIM = "S"  # tokens per owner of one target_model run
PICKS_DIM = "Q"  # rows per owner whose logits target_model returns

NO_ANCHOR = -1  # draft_model anchor: write the context rows only (no block)

SEED_PARTS = 3  # export.sampling.seed_parts: a 64-bit seed as three int64 parts < 2**22

MIN_PROPOSALS = 2


def past_key(layer: int) -> str:
    return f"past_key_{layer}"


def past_value(layer: int) -> str:
    return f"past_value_{layer}"


def present_key(layer: int) -> str:
    return f"present_key_{layer}"


def present_value(layer: int) -> str:
    return f"present_value_{layer}"


def present_of(past_name: str) -> str:
    """The output bound to the same buffer as a ``past_*`` input."""
    return "present_" + past_name.removeprefix("past_")


def graph_name(kind: str, owners: int | None = None, proposals: int | None = None) -> str:
    """``target_prefill`` / ``draft_context`` / ``target_model``..., or ``f"{kind}_{owners}"`` for static
    kinds; ``proposals``: a verify length k shorter than P (``LENGTH_KINDS`` only): ``f"{kind}_{owners}_p{k}"``."""
    if kind in DYNAMIC_KINDS or kind in MODEL_KINDS:
        if owners is not None:
            raise ValueError(f"graph kind {kind!r} has no owner count, got {owners}")
        return kind
    if kind not in STATIC_KINDS:
        raise ValueError(f"graph kind must be one of {KINDS}, got {kind!r}")
    if not is_int(owners) or owners < 1:
        raise ValueError(f"graph kind {kind!r} needs an owner count >= 1, got {owners!r}")
    if proposals is None:
        return f"{kind}_{owners}"
    if kind not in LENGTH_KINDS or not is_int(proposals) or proposals < MIN_PROPOSALS:
        raise ValueError(f"graph kind {kind!r}: a verify length must be an int >= {MIN_PROPOSALS} of {LENGTH_KINDS}, got {proposals!r}")
    return f"{kind}_{owners}_p{proposals}"


def verify_graph(dims: Dims, kind: str, owners: int, proposals: int) -> str:
    """The graph of ``kind`` verifying ``proposals`` (one of ``dims.verify_proposals``) for ``owners``."""
    if proposals not in dims.verify_proposals:
        raise ValueError(f"verify length must be one of {dims.verify_proposals} (verify_proposals), got {proposals!r}")
    return graph_name(kind, owners, None if proposals == dims.proposals else proposals)


_STATIC_NAME = re.compile(r"^(" + "|".join(STATIC_KINDS) + r")_([1-9][0-9]*)(?:_p([1-9][0-9]*))?$")


def _match(name: str) -> re.Match:
    match = _STATIC_NAME.match(name)
    if match is None or (match.group(3) is not None and match.group(1) not in LENGTH_KINDS):
        raise ValueError(f"not a graph name of the contract: {name!r}")
    return match


def parse_graph_name(name: str) -> tuple[str, int | None]:
    """Inverse of ``graph_name``: (kind, owners or None); ``verify_length`` reads a ``_p{k}`` suffix."""
    if name in DYNAMIC_KINDS or name in MODEL_KINDS:
        return name, None
    match = _match(name)
    return match.group(1), int(match.group(2))


def verify_length(name: str) -> int | None:
    """The verify length k of a ``_p{k}`` graph name; None for every other graph (P for the verify kinds)."""
    if name in DYNAMIC_KINDS or name in MODEL_KINDS:
        return None
    suffix = _match(name).group(3)
    return None if suffix is None else int(suffix)


@dataclass(frozen=True)
class DimRange:
    """Range of one dynamic dim (a TensorRT optimization profile's min/opt/max)."""

    min: int
    opt: int
    max: int


@dataclass(frozen=True)
class Profile:
    """One run graph as a range of shapes of the exported graph that computes it (a TensorRT
    optimization profile). ``shape``: each dim of the exported graph as the run graph feeds it,
    an extent or the run graph's own dynamic dim; ``dims``: the profile's ranges (``_extent``)."""

    graph: str  # the run graph
    shape: Mapping[str, int | str]
    dims: Mapping[str, DimRange]

    def sizes(self, run_sizes: Mapping[str, int]) -> dict[str, int]:
        """The exported graph's dims for one run, given the run graph's dynamic sizes."""
        return {d: run_sizes[v] if isinstance(v, str) else v for d, v in self.shape.items()}


@dataclass(frozen=True)
class TensorSpec:
    """One graph input or output: name, shape (ints and dim symbols), dtype name."""

    name: str
    shape: tuple[Dim, ...]
    dtype: str

    def to_json(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_json(cls, data: Mapping) -> TensorSpec:
        return cls(str(data["name"]), tuple(data["shape"]), str(data["dtype"]))

    def resolve(self, sizes: Mapping[str, int]) -> tuple[int, ...]:
        """Concrete shape with dim symbols taken from ``sizes``."""
        return tuple(sizes[d] if isinstance(d, str) else d for d in self.shape)


@dataclass(frozen=True)
class GraphSpec:
    """Every binding of one graph, in contract order, and its dynamic dim ranges."""

    name: str
    kind: str
    owners: int | None
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    dims: Mapping[str, DimRange] = field(default_factory=dict)
    # Exported models: one per run graph they compute. Derived from the dims, not part of the IO
    # (a manifest records the IO): equality ignores them.
    profiles: tuple[Profile, ...] = field(default=(), compare=False)

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.inputs)

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.outputs)

    @property
    def cache_inputs(self) -> tuple[TensorSpec, ...]:
        """The ``past_*`` inputs, each bound in place with ``present_of(name)``."""
        return tuple(s for s in self.inputs if s.name.startswith("past_"))

    def io_json(self) -> dict:
        return {
            "inputs": [s.to_json() for s in self.inputs],
            "outputs": [s.to_json() for s in self.outputs],
            "dims": {k: [r.min, r.opt, r.max] for k, r in self.dims.items()},
        }


@dataclass(frozen=True)
class Dims:
    """The few numbers every graph shape is computed from."""

    vocab_size: int
    tap_width: int
    block_size: int
    proposals: int
    max_owners: int
    max_context: int
    max_chunk: int  # largest T of target_prefill and C of draft_context
    target_layers: int
    target_kv_heads: int
    target_head_dim: int
    draft_layers: int
    draft_kv_heads: int
    draft_head_dim: int
    dtype: str  # model dtype name: float32 | float16 | bfloat16
    # The verify lengths a cycle may use, ascending, the last P (graphs ``_p{k}`` for the others);
    # () means (P,): an artifact set exported before verify lengths existed.
    verify_proposals: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name not in ("dtype", "verify_proposals") and (not is_int(value) or value < 1):
                raise ValueError(f"Dims.{f.name} must be an int >= 1, got {value!r}")
        if self.dtype not in DTYPES.values():
            raise ValueError(f"Dims.dtype must be one of {sorted(DTYPES.values())}, got {self.dtype!r}")
        if not MIN_PROPOSALS <= self.proposals <= self.block_size - 1:
            raise ValueError(f"Dims.proposals must be in [2, {self.block_size - 1}] (block size - 1), got {self.proposals}")
        if not self.max_chunk <= self.max_context:
            raise ValueError(f"Dims.max_chunk must be <= max_context {self.max_context}, got {self.max_chunk}")
        lengths = tuple(self.verify_proposals) or (self.proposals,)
        object.__setattr__(self, "verify_proposals", lengths)  # frozen: normalized once, here
        if not check_verify_lengths(lengths, self.proposals):
            msg = f"Dims.verify_proposals must increase within [{MIN_PROPOSALS}, {self.proposals}] and end at proposals {self.proposals}, got {lengths!r}"
            raise ValueError(msg)

    @property
    def short_verify(self) -> tuple[int, ...]:
        """The verify lengths below P: the ones with graphs of their own (``_p{k}``)."""
        return self.verify_proposals[:-1]

    @classmethod
    def of(
        cls, target: tuple[int, int, int], draft: tuple[int, int, int], dtype: str, verify_proposals: tuple[int, ...] = (), **sizes: int
    ) -> Dims:
        """The dims of a pair from each model's decoder stack as (layers, kv_heads, head_dim), the
        model dtype name, the verify lengths and the other sizes by field name (``SIZE_FIELDS``);
        ValueError if one is out of range. The exporter (from the models) and the manifest (from its
        facts) both build their dims here."""
        stacks = {f"{model}_{name}": value for model, stack in (("target", target), ("draft", draft))
                  for name, value in zip(STACK_FIELDS, stack, strict=True)}
        return cls(**sizes, **stacks, dtype=dtype, verify_proposals=tuple(verify_proposals))

    def to_json(self) -> dict:
        return asdict(self)


# The fields of Dims: SIZE_FIELDS, then each stack's "<model>_<STACK_FIELDS>", then dtype, verify_proposals.
SIZE_FIELDS = ("vocab_size", "tap_width", "block_size", "proposals", "max_owners", "max_context", "max_chunk")
STACK_FIELDS = ("layers", "kv_heads", "head_dim")


def check_verify_lengths(lengths, proposals: int) -> bool:
    """Whether ``lengths`` are valid verify lengths for P = ``proposals``: ints strictly increasing
    within [MIN_PROPOSALS, P], the last P."""
    values = list(lengths) if isinstance(lengths, (tuple, list)) else []
    return (
        bool(values)
        and all(is_int(k) and MIN_PROPOSALS <= k <= proposals for k in values)
        and all(a < b for a, b in zip(values, values[1:]))
        and values[-1] == proposals
    )


def default_verify_proposals(proposals: int) -> tuple[int, ...]:
    """The verify lengths an export offers by default: k = 2^j - 1 (j >= 2) while 2k + 1 <= P, then P
    itself — each length about half the next, so a few graphs cover short and long verifies (on the
    CPU a verify costs about its rows; acceptance past ~7 proposals is rare for a small draft).

    >>> [default_verify_proposals(p) for p in (2, 7, 15, 31)]
    [(2,), (3, 7), (3, 7, 15), (3, 7, 15, 31)]
    """
    lengths, k = [], 3
    while 2 * k + 1 <= proposals:
        lengths.append(k)
        k = 2 * k + 1
    return (*lengths, proposals)


def _caches(prefix: str, layers: int, shape: tuple[Dim, ...], dtype: str) -> tuple[TensorSpec, ...]:
    key, value = (past_key, past_value) if prefix == "past" else (present_key, present_value)
    return tuple(TensorSpec(name(l), shape, dtype) for l in range(layers) for name in (key, value))


def _target_caches(dims: Dims, n: Dim, prefix: str) -> tuple[TensorSpec, ...]:
    shape = (n, dims.target_kv_heads, dims.max_context, dims.target_head_dim)
    return _caches(prefix, dims.target_layers, shape, dims.dtype)


def _draft_caches(dims: Dims, n: Dim, prefix: str) -> tuple[TensorSpec, ...]:
    shape = (n, dims.draft_kv_heads, dims.max_context, dims.draft_head_dim)
    return _caches(prefix, dims.draft_layers, shape, dims.dtype)


def _chunk(dims: Dims) -> DimRange:
    return DimRange(1, dims.max_chunk, dims.max_chunk)


def _target_prefill(dims: Dims, n: None) -> GraphSpec:
    T = TOKENS_DIM
    return GraphSpec(
        TARGET_PREFILL,
        TARGET_PREFILL,
        None,
        (TensorSpec(TOKENS, (1, T), INT64), TensorSpec(START, (1,), INT64)) + _target_caches(dims, 1, "past"),
        (TensorSpec(LOGITS, (1, dims.vocab_size), FLOAT32), TensorSpec(TAPS, (1, T, dims.tap_width), dims.dtype))
        + _target_caches(dims, 1, "present"),
        {T: _chunk(dims)},
    )


def _target_verify(dims: Dims, n: int, k: int | None = None) -> GraphSpec:
    rows = (k or dims.proposals) + 1
    return GraphSpec(
        graph_name(TARGET_VERIFY, n, k),
        TARGET_VERIFY,
        n,
        (TensorSpec(TOKENS, (n, rows), INT64), TensorSpec(START, (n,), INT64)) + _target_caches(dims, n, "past"),
        (TensorSpec(LOGITS, (n, rows, dims.vocab_size), FLOAT32), TensorSpec(TAPS, (n, rows, dims.tap_width), dims.dtype))
        + _target_caches(dims, n, "present"),
    )


def _target_decode(dims: Dims, n: int) -> GraphSpec:
    return GraphSpec(
        graph_name(TARGET_DECODE, n),
        TARGET_DECODE,
        n,
        (TensorSpec(TOKENS, (n, 1), INT64), TensorSpec(START, (n,), INT64)) + _target_caches(dims, n, "past"),
        (TensorSpec(LOGITS, (n, dims.vocab_size), FLOAT32), TensorSpec(TAPS, (n, 1, dims.tap_width), dims.dtype))
        + _target_caches(dims, n, "present"),
    )


def _draft_context(dims: Dims, n: None) -> GraphSpec:
    C = CONTEXT_DIM
    return GraphSpec(
        DRAFT_CONTEXT,
        DRAFT_CONTEXT,
        None,
        (TensorSpec(TAPS, (1, C, dims.tap_width), dims.dtype), TensorSpec(START, (1,), INT64))
        + _draft_caches(dims, 1, "past"),
        _draft_caches(dims, 1, "present"),
        {C: _chunk(dims)},
    )


def _draft(dims: Dims, n: int) -> GraphSpec:
    return GraphSpec(
        graph_name(DRAFT, n),
        DRAFT,
        n,
        (
            TensorSpec(CTX_TAPS, (n, dims.block_size, dims.tap_width), dims.dtype),
            TensorSpec(CTX_START, (n,), INT64),
            TensorSpec(CTX_COUNT, (n,), INT64),
            TensorSpec(ANCHOR, (n,), INT64),
        )
        + _draft_caches(dims, n, "past"),
        (TensorSpec(PROPOSALS, (n, dims.proposals), INT64),) + _draft_caches(dims, n, "present"),
    )


def _verdict_outputs(n: int) -> tuple[TensorSpec, ...]:
    return (TensorSpec(ACCEPTED, (n,), INT64), TensorSpec(NEXT_TOKEN, (n,), INT64))


def _verify_inputs(dims: Dims, n: int, k: int | None) -> tuple[TensorSpec, ...]:
    rows = (k or dims.proposals) + 1
    return (TensorSpec(LOGITS, (n, rows, dims.vocab_size), FLOAT32), TensorSpec(CANDIDATES, (n, rows), INT64))


def _verify_argmax(dims: Dims, n: int, k: int | None = None) -> GraphSpec:
    return GraphSpec(graph_name(VERIFY_ARGMAX, n, k), VERIFY_ARGMAX, n, _verify_inputs(dims, n, k), _verdict_outputs(n))


def _sampling_inputs(rows: Dim) -> tuple[TensorSpec, ...]:
    """Per row: temperature, top_k, top_p, seed parts, position of the first token chosen."""
    return (
        TensorSpec(TEMPERATURE, (rows,), FLOAT32),
        TensorSpec(TOP_K, (rows,), INT64),
        TensorSpec(TOP_P, (rows,), FLOAT32),
        TensorSpec(SEED, (rows, SEED_PARTS), INT64),
        TensorSpec(POSITION, (rows,), INT64),
    )


def _verify_sample(dims: Dims, n: int, k: int | None = None) -> GraphSpec:
    inputs = _verify_inputs(dims, n, k) + _sampling_inputs(n)
    return GraphSpec(graph_name(VERIFY_SAMPLE, n, k), VERIFY_SAMPLE, n, inputs, _verdict_outputs(n))


def _sample(dims: Dims, n: None) -> GraphSpec:
    R = ROWS_DIM
    inputs = (TensorSpec(LOGITS, (R, dims.vocab_size), FLOAT32),) + _sampling_inputs(R)
    rows = DimRange(1, 1, dims.max_owners * (dims.proposals + 1))
    return GraphSpec(SAMPLE, SAMPLE, None, inputs, (TensorSpec(TOKEN, (R,), INT64),), {R: rows})


def _fixed(value: int) -> DimRange:
    return DimRange(value, value, value)


def _model_dims(dims: Dims, profiles: tuple[Profile, ...]) -> dict[str, DimRange]:
    """An exported model's dim ranges: the union of its profiles' (opt: the first profile's)."""
    symbols = profiles[0].dims
    return {
        d: DimRange(min(p.dims[d].min for p in profiles), symbols[d].opt, max(p.dims[d].max for p in profiles))
        for d in symbols
    }


# A profile never pins a row count (tokens per owner S, picked rows Q) at exactly 1: TensorRT-RTX
# 1.7 then stores a second, one-row layout of every weight those rows meet (seen at the Qwen3-8B
# width: a target plan with prefill and decode_1 among its profiles held its layers twice, one
# with decode_1 and decode_2 nearly all its weights twice; with [1, 2] each weight is stored once).
ROW_DIMS = (STEP_DIM, PICKS_DIM)
ONE_ROW = DimRange(1, 1, 2)


def _extent(dim: str, value: int) -> DimRange:
    """The profile range of a dim a run graph feeds at one extent."""
    return ONE_ROW if value == 1 and dim in ROW_DIMS else _fixed(value)


def _profile(graph: str, shape: Mapping[str, int | str], run_dims: Mapping[str, DimRange]) -> Profile:
    """Run graph ``graph`` feeding ``shape``: its own dynamic dims keep their ranges."""
    ranges = {d: run_dims[v] if isinstance(v, str) else _extent(d, v) for d, v in shape.items()}
    return Profile(graph, dict(shape), ranges)


def _target_model_profiles(dims: Dims) -> tuple[Profile, ...]:
    N, S, Q = OWNERS_DIM, STEP_DIM, PICKS_DIM
    rows = dims.proposals + 1
    profiles = [_profile(TARGET_PREFILL, {N: 1, S: TOKENS_DIM, Q: 1}, {TOKENS_DIM: _chunk(dims)})]
    for n in range(1, dims.max_owners + 1):
        profiles.append(_profile(graph_name(TARGET_VERIFY, n), {N: n, S: rows, Q: rows}, {}))
        profiles.append(_profile(graph_name(TARGET_DECODE, n), {N: n, S: 1, Q: 1}, {}))
    for k in dims.short_verify:  # shorter verifies: more profiles of the one network, no other weights
        profiles += [_profile(graph_name(TARGET_VERIFY, n, k), {N: n, S: k + 1, Q: k + 1}, {}) for n in range(1, dims.max_owners + 1)]
    return tuple(profiles)


def _draft_model_profiles(dims: Dims) -> tuple[Profile, ...]:
    N, C = OWNERS_DIM, CONTEXT_DIM
    profiles = [_profile(DRAFT_CONTEXT, {N: 1, C: CONTEXT_DIM}, {CONTEXT_DIM: _chunk(dims)})]
    profiles += [_profile(graph_name(DRAFT, n), {N: n, C: dims.block_size}, {}) for n in range(1, dims.max_owners + 1)]
    return tuple(profiles)


def _target_model(dims: Dims, n: None) -> GraphSpec:
    N, S, Q = OWNERS_DIM, STEP_DIM, PICKS_DIM
    profiles = _target_model_profiles(dims)
    inputs = (TensorSpec(TOKENS, (N, S), INT64), TensorSpec(START, (N,), INT64), TensorSpec(PICKS, (Q,), INT64))
    outputs = (TensorSpec(LOGITS, (N, Q, dims.vocab_size), FLOAT32), TensorSpec(TAPS, (N, S, dims.tap_width), dims.dtype))
    caches = _target_caches(dims, N, "past"), _target_caches(dims, N, "present")
    return GraphSpec(TARGET_MODEL, TARGET_MODEL, None, inputs + caches[0], outputs + caches[1], _model_dims(dims, profiles), profiles)


def _draft_model(dims: Dims, n: None) -> GraphSpec:
    N, C = OWNERS_DIM, CONTEXT_DIM
    profiles = _draft_model_profiles(dims)
    inputs = (
        TensorSpec(CTX_TAPS, (N, C, dims.tap_width), dims.dtype),
        TensorSpec(CTX_START, (N,), INT64),
        TensorSpec(CTX_COUNT, (N,), INT64),
        TensorSpec(ANCHOR, (N,), INT64),
    )
    outputs = (TensorSpec(PROPOSALS, (N, dims.proposals), INT64),)
    caches = _draft_caches(dims, N, "past"), _draft_caches(dims, N, "present")
    return GraphSpec(DRAFT_MODEL, DRAFT_MODEL, None, inputs + caches[0], outputs + caches[1], _model_dims(dims, profiles), profiles)


_BUILDERS = {
    TARGET_PREFILL: _target_prefill,
    TARGET_VERIFY: _target_verify,
    TARGET_DECODE: _target_decode,
    DRAFT_CONTEXT: _draft_context,
    DRAFT: _draft,
    VERIFY_ARGMAX: _verify_argmax,
    VERIFY_SAMPLE: _verify_sample,
    SAMPLE: _sample,
    TARGET_MODEL: _target_model,
    DRAFT_MODEL: _draft_model,
}


def graph_spec(dims: Dims, name: str) -> GraphSpec:
    """The contract of one graph, by name (``target_verify_3``, ``verify_argmax_2_p7``, ``draft_context``...)."""
    kind, owners = parse_graph_name(name)
    if owners is not None and owners > dims.max_owners:
        raise ValueError(f"graph {name!r}: owner count must be in [1, {dims.max_owners}] (max_owners), got {owners}")
    k = verify_length(name)
    if k is None:
        return _BUILDERS[kind](dims, owners)
    if k not in dims.short_verify:
        raise ValueError(f"graph {name!r}: verify length must be one of {dims.short_verify} (verify_proposals below P), got {k}")
    return _BUILDERS[kind](dims, owners, k)


def graph_names(max_owners: int, short: tuple[int, ...] = ()) -> tuple[str, ...]:
    """Every run graph, in contract order; ``short``: the verify lengths below P (``Dims.short_verify``)."""
    names = list(DYNAMIC_KINDS)
    for kind in STATIC_KINDS:
        names += [graph_name(kind, n) for n in range(1, max_owners + 1)]
        if kind in LENGTH_KINDS:
            names += [graph_name(kind, n, k) for k in short for n in range(1, max_owners + 1)]
    return tuple(names)


def sampled_only(name: str) -> bool:
    """Whether only sampled sessions need graph ``name`` (a greedy-only set may lack it);
    False for names outside the contract."""
    try:
        return parse_graph_name(name)[0] in SAMPLED_KINDS
    except ValueError:
        return False


def graph_specs(dims: Dims) -> dict[str, GraphSpec]:
    """Every run graph's contract, by name."""
    return {name: graph_spec(dims, name) for name in graph_names(dims.max_owners, dims.short_verify)}


# Run graphs computed by a model network rather than exported as they are.
MODEL_OF_KIND = {
    TARGET_PREFILL: TARGET_MODEL,
    TARGET_VERIFY: TARGET_MODEL,
    TARGET_DECODE: TARGET_MODEL,
    DRAFT_CONTEXT: DRAFT_MODEL,
    DRAFT: DRAFT_MODEL,
}


def export_names(max_owners: int, short: tuple[int, ...] = ()) -> tuple[str, ...]:
    """Every exported graph (one file, one engine each), in export order; ``short`` as ``graph_names``."""
    small = [name for name in graph_names(max_owners, short) if parse_graph_name(name)[0] not in MODEL_OF_KIND]
    return MODEL_KINDS + tuple(small)


def export_specs(dims: Dims) -> dict[str, GraphSpec]:
    """Every exported graph's contract, by name, in export order."""
    return {name: graph_spec(dims, name) for name in export_names(dims.max_owners, dims.short_verify)}


# Weights both models read, inputs of their TensorRT engines (see the module docstring).
SHARED_EMBEDDING = "shared_embedding"  # [V, H]: row t is token t's embedding
SHARED_HEAD = "shared_head"  # [H, V]: hidden @ shared_head = logits
SHARED_WEIGHTS = (SHARED_EMBEDDING, SHARED_HEAD)


def shared_weight_specs(vocab: int, hidden: int, dtype: str) -> tuple[TensorSpec, ...]:
    """The shared weights of a target of ``vocab`` tokens and ``hidden`` width, in ``SHARED_WEIGHTS`` order."""
    return TensorSpec(SHARED_EMBEDDING, (vocab, hidden), dtype), TensorSpec(SHARED_HEAD, (hidden, vocab), dtype)


def with_shared_weights(specs: Mapping[str, GraphSpec], shared: tuple[TensorSpec, ...]) -> dict[str, GraphSpec]:
    """Engine-level IO: each model's inputs followed by the shared weights; other graphs unchanged."""
    return {name: replace(spec, inputs=spec.inputs + tuple(shared)) if spec.kind in MODEL_KINDS else spec for name, spec in specs.items()}


def exported_as(name: str) -> str:
    """The exported graph that computes run graph ``name`` (itself for the small graphs)."""
    kind, _owners = parse_graph_name(name)
    return MODEL_OF_KIND.get(kind, name)


def profiles_of(spec: GraphSpec) -> tuple[Profile, ...]:
    """The run graphs an exported graph computes, as its profiles: a model's own list, else one
    profile over its dynamic dims (none for a static graph)."""
    if spec.profiles:
        return spec.profiles
    return (Profile(spec.name, {d: d for d in spec.dims}, dict(spec.dims)),) if spec.dims else ()


def profile_of(dims: Dims, name: str) -> tuple[GraphSpec, int, Profile]:
    """(exported graph, profile index, profile) computing run graph ``name``; index 0 for a
    static small graph (which has no profile: its one shape)."""
    exported = graph_spec(dims, exported_as(name))
    profiles = profiles_of(exported)
    for index, profile in enumerate(profiles):
        if profile.graph == name:
            return exported, index, profile
    return exported, 0, Profile(name, {}, {})
