"""Shared helpers of the executor tests (no tests here): tiny pair, dims, backends, reference outputs."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch

from dflash_trt.export import contract as c
from dflash_trt.export.contract import Dims
from dflash_trt.export.exporter import ExportOptions, contract_dims
from dflash_trt.export.pair import load_pair
from dflash_trt.export.reference import ReferenceDecoder
from dflash_trt.export.sampling import Sampling
from dflash_trt.runtime.backends.base import Backend

def single_thread():
    """Generator for an autouse fixture: tiny models run fastest on one thread (2 spin-waiting
    threads on a loaded 2-core machine are ~40x slower); restores the previous count after."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def tiny_dims(target, draft, max_context: int = 64, max_chunk: int = 8, max_owners: int = 4) -> Dims:
    """Contract dims for the torch backend (no export needed): small chunks to exercise chunking."""
    options = ExportOptions(
        max_owners=max_owners, max_context=max_context, max_chunk=max_chunk, proposals=draft.config.block_size - 1, dtype="fp32"
    )
    return contract_dims(target, draft, options)


@lru_cache(maxsize=4)
def pair(target_dir: Path, draft_dir: Path):
    return load_pair(target_dir, draft_dir)


# Requests the serving loop serves at once, in process or across the front's pipe: (prompt, max_new_tokens,
# sampling) for the tiny pair's 4 rows and 64-token context: greedy and seeded, short and long, one that
# runs into the context end and one that ends at its first token.
SERVING_REQUESTS = [
    ([5, 6, 7], 20, Sampling()),
    (list(range(10, 40)), 12, Sampling(0.9, 10, 1.0, 11)),
    ([9] * 12, 25, Sampling()),
    ([44], 8, Sampling(1.2, 0, 0.8, 3)),
    (list(range(60, 50, -1)), 30, Sampling(0.7, 0, 1.0, 5)),
    ([1, 2], 16, Sampling()),
    (list(range(3, 58)), 20, Sampling()),  # runs into the context end (64)
    ([17, 18, 19, 20], 1, Sampling()),
]


class CharTokenizer:
    """One token per character (the tiny pair has no tokenizer): ids 3..92 are ' '..'y'."""

    stop_ids = (0,)

    def encode(self, text: str) -> list[int]:
        return [ord(ch) - 29 for ch in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i + 29) for i in ids)


class Tiny:
    """The exported tiny pair (conftest ``exported_pair``): models, dims, and backends over it."""

    def __init__(self, exported_pair, rows: int = 16) -> None:
        from dflash_trt.runtime.backends.ort_backend import OrtBackend

        self.export_dir, self.prompts = exported_pair.out, exported_pair.prompts
        self.target, self.draft = pair(Path(exported_pair.target_dir), Path(exported_pair.draft_dir))
        self.dims, self.rows = exported_pair.manifest.dims(), rows
        # One ONNX Runtime backend shared by every executor of a module: a fresh executor must never
        # read what an earlier one left in the pools (stale slots are masked by length).
        self.ort = OrtBackend.from_export(self.export_dir, max_sessions=rows, verify="none", threads=1)

    def torch_backend(self, dims: Dims, rows: int, kernels: str = "auto"):
        """The reference modules ("auto" on the CPU), or the fast path's twin ("fast": row-indexed programs)."""
        from dflash_trt.runtime.backends.torch_backend import TorchBackend

        return TorchBackend(self.target, self.draft, dims, rows, kernels=kernels)

    def close(self) -> None:
        self.ort.close()


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
    ``fail_on`` = (graph kind, k): raise on the k-th call of that kind (before it runs, or
    after it wrote its caches with ``fail_after``).
    """

    name = "recording"

    def __init__(self, inner: Backend) -> None:
        self.inner, self.device, self.dims = inner, inner.device, inner.dims
        self.max_sessions, self.pools, self.stream = inner.max_sessions, inner.pools, inner.stream
        self.row_indexed = inner.row_indexed
        self.drafts: list[tuple[int, int, int, list[int]]] = []  # (row, start, anchor, real proposals)
        self.truth: dict[int, list[int]] = {}
        self.fail_on: tuple[str, int] | None = None
        self.fail_after = False  # fail after the graph ran (caches written) instead of before
        self.counts: dict[str, int] = {}

    @property
    def graph_names(self):
        return self.inner.graph_names

    def run(self, graph, feeds, first_row):
        return self._recorded(graph, feeds, lambda: self.inner.run(graph, feeds, first_row), None, first_row)

    def run_at(self, graph, feeds, slots):
        return self._recorded(graph, feeds, lambda: self.inner.run_at(graph, feeds, slots), slots.tolist(), None)

    def prefill_many(self, *args):
        return self.inner.prefill_many(*args)

    def draft_context_many(self, *args):
        self.inner.draft_context_many(*args)

    def _recorded(self, graph, feeds, run, rows, first_row):
        """Count, maybe fail, run; record a draft call's proposals per owner row (padded lanes at the scratch row: not)."""
        kind, n = c.parse_graph_name(graph)
        self.counts[kind] = self.counts.get(kind, 0) + 1
        failing = self.fail_on is not None and self.fail_on == (kind, self.counts[kind])
        if failing and not self.fail_after:
            raise RuntimeError(f"injected failure in {graph}")
        out = run()
        if failing:  # the graph ran: its cache rows were written
            raise RuntimeError(f"injected failure after {graph}")
        if kind != c.DRAFT:
            return out
        rows = rows if rows is not None else [first_row + i for i in range(n)]
        starts = (feeds[c.CTX_START] + feeds[c.CTX_COUNT]).tolist()
        proposals = out[c.PROPOSALS].clone()
        for i, (row, start, anchor) in enumerate(zip(rows, starts, feeds[c.ANCHOR].tolist())):
            if row == self.max_sessions:
                continue  # the scratch row of a padded lane
            self.drafts.append((row, start, anchor, proposals[i].tolist()))
            if row in self.truth:
                proposals[i] = torch.tensor(self._oracle(self.truth[row], start, proposals.shape[1]))
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

    def ownership(self):
        return self.inner.ownership()  # the wrapped backend's rows and call guard


class DraftReference:
    """The reference draft's proposals for any block of one sequence.

    A pure function of the sequence: taps are causal, so the draft cache for
    positions < start is the same however the cycles fell. The target runs
    once over the whole sequence; each block then only replays the draft.
    """

    def __init__(self, target, draft, sequence: list[int]) -> None:
        self.decoder = ReferenceDecoder(target, draft)
        self.draft, self.sequence = draft, sequence
        self.length = len(sequence) + draft.config.block_size
        with torch.no_grad():
            _, self.taps = self.decoder._target(sequence, 0, target.new_cache(1, self.length))

    def proposals(self, start: int, proposals: int) -> list[int]:
        row = torch.zeros(1, dtype=torch.int64)
        d_cache = self.draft.new_cache(1, self.length)
        with torch.no_grad():
            if start:
                self.draft.write_context(self.taps[None, :start], torch.tensor([0]), row, *d_cache)
            return self.decoder._propose(self.sequence[start], start, proposals, d_cache)


def assert_context(tiny, executor, backend, view, sequence: list[int]) -> None:
    """A session's draft context is the reference's for ``sequence``: its draft cache at the positions drained
    (< its draft position) holds the reference draft's context K/V, and its pending rows (at most B) the
    target's taps of the positions after (the proposals of this fixture's draft barely depend on its context:
    they cannot show a lost or misplaced row)."""
    draft, frontier = view.draft_position, view.frontier
    assert 0 <= frontier - draft <= executor.dims.block_size, (draft, frontier)
    reference = DraftReference(tiny.target, tiny.draft, sequence)
    keys, values = tiny.draft.new_cache(1, reference.length)
    with torch.no_grad():
        tiny.draft.write_context(reference.taps[None, :draft], torch.tensor([0]), torch.zeros(1, dtype=torch.int64), keys, values)
    pool, close = backend.pools["draft"], dict(rtol=1e-3, atol=1e-4)  # fp32 (on a GPU too: other kernels, other roundings)
    for layer in range(len(keys)):
        for got, want in ((pool.keys[layer], keys[layer]), (pool.values[layer], values[layer])):
            torch.testing.assert_close(got[view.row, :, :draft].cpu(), want[0, :, :draft], **close)
    pending = executor.context.rows(view.row, frontier - draft).cpu()
    torch.testing.assert_close(pending, reference.taps[draft:frontier].to(pending.dtype), **close)


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

    def open(self, speculate: bool | None = None) -> int:
        s = self.executor.open_session(speculate)
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
        """inputs: (session, tokens, position or None, produce_output[, {max_new_tokens, stop}])."""
        from dflash_trt.runtime.sessions import Input

        extras = [item[4] if len(item) > 4 else {} for item in inputs]
        inputs = [item[:4] for item in inputs]
        batch = [Input(s, list(tokens), position=position, produce_output=produce, **extra) for (s, tokens, position, produce), extra in zip(inputs, extras)]
        outputs = self.executor.execute(batch)
        for (s, tokens, position, produce), out, extra in zip(inputs, outputs, extras):
            room, stop = extra.get("max_new_tokens"), set(extra.get("stop", ()))
            assert room is None or len(out) <= room, (s, out, room)
            assert not stop & set(out[:-1]), f"session {s} returned tokens past a stop token: {out}"
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

