"""Shared helpers of the executor tests (no tests here): tiny pair, dims, backends, reference outputs."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch

from dflash_trt.export import contract as c
from dflash_trt.export.contract import Dims
from dflash_trt.export.pair import load_pair
from dflash_trt.export.reference import ReferenceDecoder, Sampling
from dflash_trt.runtime.backends.base import Backend

MAX_CONTEXT = 64
MAX_CHUNK = 16
MAX_OWNERS = 4


def tiny_dims(target, draft, max_context: int = MAX_CONTEXT, max_chunk: int = MAX_CHUNK, max_owners: int = MAX_OWNERS) -> Dims:
    t, d = target.config, draft.config
    return Dims(
        vocab_size=t.vocab_size,
        tap_width=target.tap_width,
        block_size=d.block_size,
        proposals=d.block_size - 1,
        max_owners=max_owners,
        max_context=max_context,
        max_chunk=max_chunk,
        target_layers=t.num_layers,
        target_kv_heads=t.num_kv_heads,
        target_head_dim=t.head_dim,
        draft_layers=d.num_layers,
        draft_kv_heads=d.num_kv_heads,
        draft_head_dim=d.head_dim,
        dtype="float32",
    )


class LocalGraphBackend(Backend):
    """Runs export.graphs modules eagerly over two CPU pools (a stand-in until runtime backends land)."""

    name = "local"

    def __init__(self, target, draft, dims: Dims, max_sessions: int) -> None:
        from dflash_trt.export.graphs import graph_module

        self.device = torch.device("cpu")
        self.dims = dims
        self.pools = {
            "target": target.new_cache(max_sessions, dims.max_context),
            "draft": draft.new_cache(max_sessions, dims.max_context),
        }
        self.modules = {name: graph_module(spec, target, draft, dims) for name, spec in c.graph_specs(dims).items()}
        self.specs = c.graph_specs(dims)
        self.calls: list[tuple[str, int]] = []

    def _pool(self, kind: str) -> str:
        return "draft" if kind in (c.DRAFT, c.DRAFT_CONTEXT) else "target"

    @torch.no_grad()
    def run(self, graph, feeds, first_row):
        spec = self.specs[graph]
        self.calls.append((graph, first_row))
        names = [s.name for s in spec.inputs if not s.name.startswith("past_")]
        args = [feeds[name] for name in names]
        caches = []
        if spec.cache_inputs:
            n = 1 if spec.owners is None else spec.owners
            keys, values = self.pools[self._pool(spec.kind)]
            caches = [t[first_row : first_row + n] for pair in zip(keys, values) for t in pair]
        out = self.modules[graph](*args, *caches)
        out = out if isinstance(out, tuple) else (out,)
        return {s.name: t for s, t in zip(spec.outputs, out) if not s.name.startswith("present_")}

    def copy_rows(self, pool, source, destination, upto):
        keys, values = self.pools[pool]
        for t in (*keys, *values):
            t[destination, :, :upto] = t[source, :, :upto]


@lru_cache(maxsize=4)
def pair(target_dir: Path, draft_dir: Path):
    return load_pair(target_dir, draft_dir)


def reference_target(target, prompt: list[int], max_new: int, sampling: Sampling = Sampling()) -> list[int]:
    return ReferenceDecoder(target).generate_target(prompt, max_new, sampling).tokens
