"""The semantics probe: a tiny network built with the set's own constructions, checked on the GPU it runs on.

No plan of a set says by itself that TensorRT computes what its ONNX graph
means; the questions a build cannot answer (docs/design.md §7) are about
attention and integer arithmetic, so the probe asks exactly those, with the
exporter's own node builders (``export.onnx_kernels.OnnxKernels``: the KV
write as ``TensorScatter``, the attention as ``Attention``; the sampler as
``export.sampling.choose_op``), traced by the exporter's ``export_graph``
and built by the set's own builder (``engines.attention.bind_attention``
included). Its network has three independent parts:

- ``target``: q [N, Hq, S, D] and the new K/V [N, Hkv, S, D] written at
  ``t_start`` per owner into [N, Hkv, L, D] caches, then attention with the
  target's causality (``--causal lengths``: lower-right with per-owner
  key/value lengths ``start + S``; ``--causal mask``: the mask); N and S are
  dynamic (one optimization profile), as in ``target_model``;
- ``draft``: the same with the draft's geometry, non-causal over slots
  ``< min(start + B, L)``, 3 owners, B queries;
- ``sampler``: ``choose`` over R rows of V logits (greedy rows with a tie,
  rows of pure noise whose token is decided by the int64 hash alone).

``probe_cases`` feeds it adversarially: every owner starts elsewhere (one at
0, one inside the cache, one whose block ends at the cache's end), stale
cache slots past each owner's length hold keys that would dominate any
query that saw them, and the block's keys dominate the context's, so a
query that sees one block token too many (the diagonal anchored at the
padded length instead of the owner's own), too few (upper-left) or a stale
slot (lengths dropped) moves its output by O(1) — far beyond rounding
(``engines.probe_reference`` holds the numpy semantics and the comparison).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from dflash_trt.engines.engine_set import PROBE_NAME
from dflash_trt.export.contract import FLOAT32, INT64, SEED_PARTS, DimRange, GraphSpec, TensorSpec
from dflash_trt.export.sampling import choose_op, seed_parts
from dflash_trt.export.torch_dtypes import TORCH_DTYPES

DRAFT_OWNERS = 3
SAMPLER_VOCAB = 512  # below TensorRT's TopK limit: the probe asks about the hash, not TopK's size
ALIGNED_SCORE = 12.0  # scaled q.k of a block (or stale) key: e^12 outweighs every context key
STALE_VALUE = 3.0  # the value of every stale slot: a query that sees them drifts towards it
SEED = 20261201

# Owner-wise inputs and outputs (names of the probe's IO).
T_Q, T_K, T_V, T_START, T_OUT = "t_q", "t_k", "t_v", "t_start", "t_out"
D_Q, D_K, D_V, D_START, D_OUT = "d_q", "d_k", "d_v", "d_start", "d_out"
LOGITS, TEMPERATURE, TOP_K, TOP_P, SEEDS, POSITION, TOKEN = "logits", "temperature", "top_k", "top_p", "seed", "position", "token"
OWNERS_DIM, STEP_DIM = "N", "S"


@dataclass(frozen=True)
class Heads:
    """One model's attention geometry: query heads, key/value heads, head dim."""

    heads: int
    kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class ProbeSpec:
    """What the probe is built for: the set's dtype, causal formulation and attention geometries."""

    dtype: str  # contract dtype name of the model tensors
    causal: str  # "lengths" | "mask" (export.onnx_kernels)
    target: Heads
    draft: Heads
    max_context: int  # L of both caches
    block_size: int  # B: the draft's queries
    verify_tokens: int  # P + 1: the target's opt S
    prefill_tokens: int  # the target's max S

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping) -> ProbeSpec:
        fields = dict(data)
        fields["target"], fields["draft"] = Heads(**data["target"]), Heads(**data["draft"])
        return cls(**fields)

    @classmethod
    def from_manifest(cls, manifest) -> ProbeSpec:
        """The probe of an export (``export.manifest.Manifest``)."""
        t, d = manifest.target, manifest.draft
        length, block = manifest.max_context, manifest.block_size
        return cls(
            dtype=manifest.dims().dtype,
            causal=manifest.causal,
            target=Heads(t.num_heads, t.kv_heads, t.head_dim),
            draft=Heads(d.num_heads, d.kv_heads, d.head_dim),
            max_context=length,
            block_size=block,
            verify_tokens=manifest.proposals + 1,
            prefill_tokens=max(manifest.proposals + 1, min(2 * block, manifest.max_chunk, length // 2)),
        )


def probe_io(spec: ProbeSpec) -> GraphSpec:
    """The probe's bindings, in order: target, draft and sampler inputs, then the four caches."""
    t, d, m, length = spec.target, spec.draft, spec.dtype, spec.max_context
    n, s, b, r, v = OWNERS_DIM, STEP_DIM, spec.block_size, len(SAMPLER_ROWS), SAMPLER_VOCAB
    inputs = (
        TensorSpec(T_Q, (n, t.heads, s, t.head_dim), m),
        TensorSpec(T_K, (n, t.kv_heads, s, t.head_dim), m),
        TensorSpec(T_V, (n, t.kv_heads, s, t.head_dim), m),
        TensorSpec(T_START, (n,), INT64),
        TensorSpec(D_Q, (DRAFT_OWNERS, d.heads, b, d.head_dim), m),
        TensorSpec(D_K, (DRAFT_OWNERS, d.kv_heads, b, d.head_dim), m),
        TensorSpec(D_V, (DRAFT_OWNERS, d.kv_heads, b, d.head_dim), m),
        TensorSpec(D_START, (DRAFT_OWNERS,), INT64),
        TensorSpec(LOGITS, (r, v), FLOAT32),
        TensorSpec(TEMPERATURE, (r,), FLOAT32),
        TensorSpec(TOP_K, (r,), INT64),
        TensorSpec(TOP_P, (r,), FLOAT32),
        TensorSpec(SEEDS, (r, SEED_PARTS), INT64),
        TensorSpec(POSITION, (r,), INT64),
    )
    target_cache, draft_cache = (n, t.kv_heads, length, t.head_dim), (DRAFT_OWNERS, d.kv_heads, length, d.head_dim)
    caches = tuple(TensorSpec(f"past_{kind}_{i}", shape, m) for i, shape in enumerate((target_cache, draft_cache)) for kind in ("key", "value"))
    outputs = (
        TensorSpec(T_OUT, (n, t.heads, s, t.head_dim), m),
        TensorSpec(D_OUT, (DRAFT_OWNERS, d.heads, b, d.head_dim), m),
        TensorSpec(TOKEN, (r,), INT64),
        *(TensorSpec("present_" + c.name.removeprefix("past_"), c.shape, m) for c in caches),
    )
    dims = {OWNERS_DIM: DimRange(1, DRAFT_OWNERS, DRAFT_OWNERS), STEP_DIM: DimRange(1, spec.verify_tokens, spec.prefill_tokens)}
    return GraphSpec(PROBE_NAME, PROBE_NAME, None, inputs + caches, outputs, dims)


class ProbeNetwork(nn.Module):
    """The probe's computation through ``kernels`` (``OnnxKernels`` to export; see the module docstring).

    Each part is what a target / draft layer does with its cache
    (``export.layers.DecoderLayer``, ``export.graph_modules.Draft``): write
    the new K/V at ``start``, attend with lengths ``start + S`` (the draft's
    clamped to L), positions ``start ..``.
    """

    def __init__(self, kernels) -> None:
        super().__init__()
        self.kernels = kernels

    def forward(self, t_q, t_k, t_v, t_start, d_q, d_k, d_v, d_start, logits, temperature, top_k, top_p, seed, position, *caches):
        t_keys, t_values, d_keys, d_values = caches
        t_out, t_keys, t_values = self._part(t_q, t_k, t_v, t_start, t_keys, t_values, causal=True)
        d_out, d_keys, d_values = self._part(d_q, d_k, d_v, d_start, d_keys, d_values, causal=False)
        token = choose_op(logits, temperature, top_k, top_p, seed, position)
        return t_out, d_out, token, t_keys, t_values, d_keys, d_values

    def _part(self, q, k, v, start, keys, values, causal: bool):
        keys = self.kernels.write_cache(keys, None, start, k)
        values = self.kernels.write_cache(values, None, start, v)
        tokens = q.shape[2]
        lengths = start + tokens if causal else torch.clamp(start + tokens, max=keys.shape[2])
        positions = start[:, None] + torch.arange(tokens, device=start.device)  # [n, S]
        return self.kernels.attention(q, keys, values, None, positions, lengths, causal, 0), keys, values


def export_probe(spec: ProbeSpec, directory: Path) -> Path:
    """``directory/probe.onnx``, traced like every exported graph (``export.exporter.export_graph``)."""
    from dflash_trt.export.exporter import export_graph
    from dflash_trt.export.onnx_kernels import OnnxKernels

    directory.mkdir(parents=True, exist_ok=True)
    graph = export_graph(ProbeNetwork(OnnxKernels(spec.causal, emit=True)), probe_io(spec), directory)
    return directory / graph.file


# --------------------------------------------------------------------------- the feeds


@dataclass(frozen=True)
class SamplerRow:
    """One row of the sampler part: how its logits look and its sampling parameters."""

    logits: str  # "tie" (greedy, two equal maxima), "random", "zeros" (the hash alone decides)
    temperature: float
    top_k: int
    seed: int
    position: int


SAMPLER_ROWS = (
    SamplerRow("tie", 0.0, 0, 0, 3),
    SamplerRow("random", 0.0, 0, 0, 11),
    SamplerRow("zeros", 1.0, 0, 0, 0),
    SamplerRow("zeros", 1.0, 0, 2**64 - 1, 2_147_000_000),
    SamplerRow("zeros", 1.0, 0, 123_456_789_012_345, 77_777),
    SamplerRow("random", 0.7, 40, 42, 1_000_003),
)
TIE = (5, 9)  # the tied maxima of the "tie" row: the first index wins


@dataclass(frozen=True)
class ProbeCase:
    """One run of the probe: its feeds (host tensors) and the owners' starts, for messages."""

    name: str
    feeds: Mapping[str, torch.Tensor]
    target_starts: tuple[int, ...]
    draft_starts: tuple[int, ...]


def probe_cases(spec: ProbeSpec) -> list[ProbeCase]:
    """``verify``: 3 owners of P+1 tokens at 0, inside and at the cache's end; ``prefill``: one
    owner of the profile's most tokens inside the cache. Both share the draft (owners at 2,
    inside and at the end) and the sampler rows."""
    length, block = spec.max_context, spec.block_size
    verify, prefill = spec.verify_tokens, spec.prefill_tokens
    draft_starts = (min(2, length - block), (length - block) // 2, length - block)
    cases = [("verify", (0, (length - verify) // 3, length - verify), verify), ("prefill", ((length - prefill) // 2,), prefill)]
    return [_case(spec, name, starts, tokens, draft_starts, index) for index, (name, starts, tokens) in enumerate(cases)]


def _case(spec: ProbeSpec, name: str, starts, tokens: int, draft_starts, index: int) -> ProbeCase:
    rng = np.random.default_rng(SEED + index)
    dtype = TORCH_DTYPES[spec.dtype]
    feeds = {}
    target = _attention_feeds(rng, spec.target, starts, tokens, spec.max_context)
    draft = _attention_feeds(rng, spec.draft, draft_starts, spec.block_size, spec.max_context)
    for prefix, part, start_name in (("t_", target, T_START), ("d_", draft, D_START)):
        q, k, v, start, keys, values = part
        feeds |= {prefix + "q": q, prefix + "k": k, prefix + "v": v}
        feeds[start_name] = torch.tensor(start, dtype=torch.int64)
        layer = 0 if prefix == "t_" else 1
        feeds[f"past_key_{layer}"], feeds[f"past_value_{layer}"] = keys, values
    feeds = {key: value.to(dtype) if value.is_floating_point() else value for key, value in feeds.items()}
    return ProbeCase(name, feeds | _sampler_feeds(rng), tuple(starts), tuple(draft_starts))


def _attention_feeds(rng, heads: Heads, starts, tokens: int, length: int):
    """q, new k, new v, starts, key cache, value cache (float32 tensors; see the module docstring).

    Per owner and key/value head a direction u: queries and the block's keys lie along it
    (scaled q.k = ALIGNED_SCORE), context keys are small noise (q.k ~ 0), stale slots hold
    keys along u with value STALE_VALUE; every value of the block and the context is random.
    """
    n, groups, dim = len(starts), heads.heads // heads.kv_heads, heads.head_dim
    size = math.sqrt(ALIGNED_SCORE * math.sqrt(dim))
    u = rng.standard_normal((n, heads.kv_heads, 1, dim))
    u *= size / np.linalg.norm(u, axis=-1, keepdims=True)
    q = np.repeat(u, groups, axis=1) + 0.1 * rng.standard_normal((n, heads.heads, tokens, dim))
    k = u + 0.1 * rng.standard_normal((n, heads.kv_heads, tokens, dim))
    v = rng.standard_normal((n, heads.kv_heads, tokens, dim))
    keys = np.broadcast_to(u, (n, heads.kv_heads, length, dim)).copy()
    values = np.full((n, heads.kv_heads, length, dim), STALE_VALUE)
    for owner, start in enumerate(starts):
        keys[owner, :, :start] = 0.3 * rng.standard_normal((heads.kv_heads, start, dim))
        values[owner, :, :start] = rng.standard_normal((heads.kv_heads, start, dim))
    as_tensor = lambda x: torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))  # noqa: E731
    return as_tensor(q), as_tensor(k), as_tensor(v), tuple(starts), as_tensor(keys), as_tensor(values)


def _sampler_feeds(rng) -> dict[str, torch.Tensor]:
    rows = []
    for row in SAMPLER_ROWS:
        logits = np.zeros(SAMPLER_VOCAB) if row.logits == "zeros" else rng.standard_normal(SAMPLER_VOCAB) * 2.0
        if row.logits == "tie":
            logits[list(TIE)] = logits.max() + 1.0
        rows.append(logits)
    return {
        LOGITS: torch.tensor(np.array(rows), dtype=torch.float32),
        TEMPERATURE: torch.tensor([r.temperature for r in SAMPLER_ROWS], dtype=torch.float32),
        TOP_K: torch.tensor([r.top_k for r in SAMPLER_ROWS], dtype=torch.int64),
        TOP_P: torch.ones(len(SAMPLER_ROWS), dtype=torch.float32),
        SEEDS: torch.tensor([seed_parts(r.seed) for r in SAMPLER_ROWS], dtype=torch.int64),
        POSITION: torch.tensor([r.position for r in SAMPLER_ROWS], dtype=torch.int64),
    }
