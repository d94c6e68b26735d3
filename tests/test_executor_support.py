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


class Oracle:
    """Reference target-only continuations: the tokens AT positions len(X), len(X)+1, ... for a sequence X.

    Because every choice uses the positional uniform of its position,
    cont(X + cont(X)[:k]) == cont(X)[k:], so one computed root answers every
    extension of it along its own continuation.
    """

    def __init__(self, target, max_context: int) -> None:
        self.reference = ReferenceDecoder(target)
        self.max_context = max_context
        self.roots: dict[tuple, dict[tuple[int, ...], list[int]]] = {}

    def continuation(self, sequence: list[int], sampling: Sampling = Sampling()) -> list[int]:
        key = (sampling.temperature, sampling.top_k, sampling.top_p, sampling.seed)
        roots = self.roots.setdefault(key, {})
        for root, cont in roots.items():
            k = len(sequence) - len(root)
            if k >= 0 and tuple(sequence[: len(root)]) == root and list(sequence[len(root) :]) == cont[:k] and k <= len(cont):
                return cont[k:]
        cont = self.reference.generate_target(list(sequence), self.max_context - len(sequence) + 1, sampling).tokens
        roots[tuple(sequence)] = cont
        return cont


class RecordingBackend(Backend):
    """Wraps a backend: records every draft call's real proposals; optionally substitutes oracle proposals.

    ``truth[row]`` (a token list by position) makes draft_n propose
    truth[start+1 .. start+P] for that row, with a wrong token at the offset
    a hash of ``start`` in 0..P (P = none wrong), so cycles accept 0..P proposals and
    the a > 0 bookkeeping runs even with an untrained draft.
    ``fail_on`` = (graph kind, k): raise on the k-th call of that kind.
    """

    name = "recording"

    def __init__(self, inner: Backend) -> None:
        self.inner, self.device = inner, inner.device
        self.drafts: list[tuple[int, int, int, list[int]]] = []  # (row, start, anchor, real proposals)
        self.truth: dict[int, list[int]] = {}
        self.fail_on: tuple[str, int] | None = None
        self.counts: dict[str, int] = {}

    def run(self, graph, feeds, first_row):
        kind, n = c.parse_graph_name(graph)
        self.counts[kind] = self.counts.get(kind, 0) + 1
        if self.fail_on and self.fail_on == (kind, self.counts[kind]):
            raise RuntimeError(f"injected failure in {graph}")
        out = self.inner.run(graph, feeds, first_row)
        if kind != c.DRAFT:
            return out
        starts = (feeds[c.CTX_START] + feeds[c.CTX_COUNT]).tolist()
        proposals = out[c.PROPOSALS].clone()
        for i, (start, anchor) in enumerate(zip(starts, feeds[c.ANCHOR].tolist())):
            self.drafts.append((first_row + i, start, anchor, proposals[i].tolist()))
            if first_row + i in self.truth:
                proposals[i] = torch.tensor(self._oracle(self.truth[first_row + i], start, proposals.shape[1]))
        return {**out, c.PROPOSALS: proposals}

    @staticmethod
    def _oracle(truth: list[int], start: int, width: int) -> list[int]:
        wrong = (start * 2654435761 >> 7) % (width + 1)  # scrambled: every acceptance length occurs
        guesses = [truth[start + 1 + j] if start + 1 + j < len(truth) else 0 for j in range(width)]
        if wrong < width:
            guesses[wrong] = (guesses[wrong] + 1) % 90
        return guesses

    def copy_rows(self, pool, source, destination, upto):
        self.inner.copy_rows(pool, source, destination, upto)


def reference_proposals(target, draft, before: list[int], anchor: int, proposals: int) -> list[int]:
    """The reference draft's proposals for the block at len(before) after context ``before``.

    A pure function of the sequence: taps are causal, so the draft cache for
    positions < start is the same however the cycles fell.
    """
    length = len(before) + draft.config.block_size
    decoder = ReferenceDecoder(target, draft)
    row = torch.zeros(1, dtype=torch.int64)
    d_cache = draft.new_cache(1, length)
    with torch.no_grad():
        if before:
            _, taps = decoder._target(before, 0, target.new_cache(1, length))
            draft.write_context(taps[None], torch.tensor([0]), row, *d_cache)
        return decoder._propose(anchor, len(before), proposals, d_cache)


class Tracker:
    """The tests' model of every session: its sequence S (committed tokens + the pending one), checked after each call.

    Feeding tokens T at position p makes S = S[:p] + T; the outputs must be
    the reference target-only continuation of that S.
    """

    def __init__(self, executor, oracle: Oracle) -> None:
        self.executor, self.oracle = executor, oracle
        self.seq: dict[int, list[int]] = {}
        self.pending: dict[int, bool] = {}
        self.sampling: dict[int, Sampling] = {}

    def open(self) -> int:
        s = self.executor.open_session()
        self.seq[s], self.pending[s], self.sampling[s] = [], False, Sampling()
        return s

    def close(self, s: int) -> None:
        self.executor.close_session(s)
        self.forget(s)

    def forget(self, s: int) -> None:
        """Stop modelling ``s`` (poisoned: its state is unknown by definition)."""
        del self.seq[s], self.pending[s], self.sampling[s]

    def frontier(self, s: int) -> int:
        return len(self.seq[s]) - self.pending[s]

    def clone(self, s: int, upto: int) -> int:
        new = self.executor.clone(s, upto)
        keep_pending = upto == self.frontier(s) and self.pending[s]
        self.seq[new] = self.seq[s][: upto + keep_pending]
        self.pending[new], self.sampling[new] = keep_pending, self.sampling[s]
        return new

    def set_sampling(self, s: int, sampling: Sampling) -> None:
        self.executor.set_sampling(s, sampling.temperature, sampling.top_k, sampling.top_p, sampling.seed)
        self.sampling[s] = sampling

    def execute(self, inputs: list[tuple]) -> list[list[int]]:
        """inputs: (session, tokens, position or None, produce_output)."""
        from dflash_trt.runtime.sessions import Input

        batch = [Input(s, list(tokens), position=position, produce_output=produce) for s, tokens, position, produce in inputs]
        outputs = self.executor.execute(batch)
        for (s, tokens, position, produce), out in zip(inputs, outputs):
            p = self.frontier(s) if position is None else position
            fed = self.seq[s][:p] + list(tokens)
            assert (len(out) >= 1) == produce, (s, out)
            expected = self.oracle.continuation(fed, self.sampling[s])[: len(out)]
            assert out == expected, f"session {s} fed {len(fed)} tokens: got {out}, reference {expected}"
            self.seq[s], self.pending[s] = fed + out, bool(out)
        self.check_state()
        return outputs

    def decode_inputs(self, sessions) -> list[tuple]:
        return [(s, [self.seq[s][-1]], None, True) for s in sessions]

    def check_state(self) -> None:
        for s in self.seq:
            view = self.executor.session(s)
            assert view.frontier == self.frontier(s), (s, view.frontier, self.frontier(s))
            assert view.pending == (self.seq[s][-1] if self.pending[s] else None), (s, view.pending)


def tiny_models_and_dims(tiny_pair):
    target, draft = pair(*tiny_pair)
    return target, draft, tiny_dims(target, draft)


def make_backend(tiny, max_sessions: int) -> Backend:
    target, draft, dims = tiny
    return LocalGraphBackend(target, draft, dims, max_sessions)
