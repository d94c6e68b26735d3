"""DFlash generation driven ONLY by ONNX Runtime sessions over the exported graphs.

A small test driver (not the runtime: its own routing of run graphs onto
the exported model networks) keeps one numpy cache pool per model
([rows, kv_heads, max_context, head_dim] per layer), binds each call's owners
as a view of consecutive rows with ``past_*`` and ``present_*`` on the SAME
memory (in place, as the engines are meant to be bound), and runs the cycle
of docs/design.md §1 for several sessions at once: prefill in chunks, drain
long contexts with ``draft_context``, then ``draft_n`` -> ``target_verify_n``
-> ``verify_argmax_n`` / ``verify_sample_n`` over runs of consecutive active
rows, and plain decode with ``target_prefill`` once a block no longer fits.
The token after a prefill or plain decode step comes from the ``sample`` graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnxruntime as ort
import pytest

from dflash_trt.export import contract
from dflash_trt.export.pair import load_pair
from dflash_trt.export.reference import ReferenceDecoder
from dflash_trt.export.sampling import Sampling
from dflash_trt.runtime.cycles import sampling_rows
from test_export_graphs import routed

PREFILL_CHUNK = 16
NUMPY = {"float32": np.float32, "float16": np.float16, "int64": np.int64}


class Graphs:
    """ORT sessions by exported graph; ``run`` runs a run graph on the graph that computes it
    (the contract's feeding rules) with its caches bound in place on a row range of a pool."""

    def __init__(self, directory, manifest) -> None:
        options = ort.SessionOptions()
        options.log_severity_level = 3
        options.intra_op_num_threads = 1  # idle ORT threads spin and starve PyTorch on 2-core CI
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.dims = manifest.dims()
        self.specs = contract.graph_specs(self.dims)
        self.sessions = {
            name: ort.InferenceSession(str(directory / g.file), options, providers=["CPUExecutionProvider"])
            for name, g in manifest.graphs.items()
        }

    def run(self, name: str, feeds: dict[str, np.ndarray], pool: dict[str, np.ndarray] | None = None, first_row: int = 0):
        """Outputs other than caches, by name; ``pool`` rows first_row.. are updated in place."""
        spec = self.specs[name]
        exported, inputs = routed(spec, self.dims, feeds)
        graph = self.sessions[exported]
        binding, views = graph.io_binding(), {}
        for s in spec.cache_inputs:
            view = pool[s.name][first_row : first_row + s.shape[0]]
            assert view.flags.c_contiguous
            views[contract.present_of(s.name)] = view
            binding.bind_input(s.name, "cpu", 0, NUMPY[s.dtype], list(s.shape), view.ctypes.data)
        dtypes = {i.name: i.type for i in graph.get_inputs()}
        for key, value in inputs.items():
            binding.bind_cpu_input(key, np.ascontiguousarray(value, dtype=np.int64 if dtypes[key] == "tensor(int64)" else None))
        names = [o.name for o in graph.get_outputs()]
        for out in names:  # presents on the past's memory: in place
            if out in views:
                view = views[out]
                binding.bind_output(out, "cpu", 0, view.dtype, list(view.shape), view.ctypes.data)
            else:
                binding.bind_output(out, "cpu")
        graph.run_with_iobinding(binding)
        outputs = dict(zip(names, binding.copy_outputs_to_cpu()))
        return {s.name: outputs[s.name].reshape(s.resolve({})) if s.name == contract.LOGITS else outputs[s.name] for s in spec.outputs if s.name not in views}


def pools(spec: contract.GraphSpec, rows: int) -> dict[str, np.ndarray]:
    return {s.name: np.zeros((rows, *s.shape[1:]), NUMPY[s.dtype]) for s in spec.cache_inputs}


@dataclass
class Session:
    prompt: list[int]
    max_new: int
    sampling: Sampling
    tokens: list[int] = field(default_factory=list)
    context: np.ndarray | None = None  # taps not yet in the draft cache [c, W]
    frontier: int = 0  # target cache holds positions 0..frontier-1
    draft_position: int = 0  # draft cache holds positions 0..draft_position-1
    accepted: list[int] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return len(self.tokens) >= self.max_new

    def emit(self, tokens: list[int]) -> None:
        self.tokens += tokens[: self.max_new - len(self.tokens)]


class Driver:
    """The cycle of docs/design.md §1 for many sessions, every model call an ONNX Runtime graph."""

    def __init__(self, graphs: Graphs, sessions: list[Session]) -> None:
        self.g, self.sessions, dims = graphs, sessions, graphs.dims
        self.B, self.P, self.L = dims.block_size, dims.proposals, dims.max_context
        self.target = pools(graphs.specs[contract.TARGET_PREFILL], len(sessions))
        self.draft = pools(graphs.specs[contract.DRAFT_CONTEXT], len(sessions))
        self.calls: list[str] = []

    def call(self, name, feeds, pool, row):
        self.calls.append(name)
        return self.g.run(name, feeds, pool, row)

    def prefill(self, row: int) -> None:
        s, taps = self.sessions[row], []
        for start in range(0, len(s.prompt), PREFILL_CHUNK):
            chunk = s.prompt[start : start + PREFILL_CHUNK]
            out = self.call(contract.TARGET_PREFILL, {"tokens": np.array([chunk]), "start": np.array([start])}, self.target, row)
            taps.append(out["taps"][0])
        s.context, s.frontier = np.concatenate(taps), len(s.prompt)
        s.emit(self.choose(s, out["logits"], s.frontier))

    def plain_decode(self, row: int) -> None:
        s = self.sessions[row]
        feeds = {"tokens": np.array([[s.tokens[-1]]]), "start": np.array([s.frontier])}
        out = self.call(contract.TARGET_PREFILL, feeds, self.target, row)
        s.context = np.concatenate([s.context, out["taps"][0]])
        s.frontier += 1
        s.emit(self.choose(s, out["logits"], s.frontier))

    def choose(self, s: Session, logits: np.ndarray, position: int) -> list[int]:
        """The token AT ``position`` from logits [1, V]: the ``sample`` graph."""
        feeds = {"logits": logits} | sampling_rows([s.sampling], [position])
        return self.call(contract.SAMPLE, feeds, None, 0)["token"].tolist()

    def drain(self, row: int) -> None:
        """Context beyond one block goes to the draft cache through the dynamic graph."""
        s = self.sessions[row]
        extra = len(s.context) - self.B
        if extra > 0:
            feeds = {"taps": s.context[None, :extra], "start": np.array([s.draft_position])}
            self.call(contract.DRAFT_CONTEXT, feeds, self.draft, row)
            s.context, s.draft_position = s.context[extra:], s.draft_position + extra

    def cycle(self, first: int, n: int) -> None:
        """draft_n -> target_verify_n -> verify_n for the owners in rows first..first+n-1."""
        owners = self.sessions[first : first + n]
        ctx = np.zeros((n, self.B, owners[0].context.shape[1]), owners[0].context.dtype)
        for i, s in enumerate(owners):
            ctx[i, : len(s.context)] = s.context
        anchors = np.array([s.tokens[-1] for s in owners])
        starts = np.array([s.frontier for s in owners])
        draft = {
            "ctx_taps": ctx,
            "ctx_start": np.array([s.draft_position for s in owners]),
            "ctx_count": np.array([len(s.context) for s in owners]),
            "anchor": anchors,
        }
        proposals = self.call(f"draft_{n}", draft, self.draft, first)["proposals"]
        candidates = np.concatenate([anchors[:, None], proposals], axis=1)
        target = self.call(f"target_verify_{n}", {"tokens": candidates, "start": starts}, self.target, first)
        verdict = self.call(self.verifier(owners, n), self.verifier_feeds(owners, target["logits"], candidates, starts), None, 0)
        for i, s in enumerate(owners):
            a = int(verdict["accepted"][i])
            s.emit([*proposals[i, :a].tolist(), int(verdict["next_token"][i])])
            s.context, s.draft_position, s.frontier = target["taps"][i, : a + 1], s.frontier, s.frontier + a + 1
            s.accepted.append(a)

    def verifier(self, owners, n) -> str:
        greedy = all(s.sampling.temperature == 0 for s in owners)
        return f"verify_argmax_{n}" if greedy else f"verify_sample_{n}"

    def verifier_feeds(self, owners, logits, candidates, starts) -> dict[str, np.ndarray]:
        feeds = {"logits": logits, "candidates": candidates}
        if self.verifier(owners, len(owners)).startswith("verify_sample"):
            # Row j of an owner chooses the token AT start + 1 + j.
            feeds |= sampling_rows([s.sampling for s in owners], [p + 1 for p in starts])
        return feeds

    def generate(self) -> list[list[int]]:
        for row in range(len(self.sessions)):
            self.prefill(row)
        while not all(s.done for s in self.sessions):
            drafting = []
            for row, s in enumerate(self.sessions):
                if s.done:
                    continue
                if s.frontier + self.B > self.L:
                    self.plain_decode(row)
                else:
                    self.drain(row)
                    drafting.append(row)
            for first, n in consecutive_runs(drafting, self.g.dims.max_owners):
                self.cycle(first, n)
        return [s.tokens for s in self.sessions]


def consecutive_runs(rows: list[int], max_owners: int) -> list[tuple[int, int]]:
    """[0, 1, 2, 4] -> [(0, 3), (4, 1)] with runs of at most max_owners rows."""
    runs: list[tuple[int, int]] = []
    for row in rows:
        if runs and runs[-1][0] + runs[-1][1] == row and runs[-1][1] < max_owners:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((row, 1))
    return runs


@pytest.fixture(scope="module")
def reference(exported_pair):
    target, draft = load_pair(exported_pair.target_dir, exported_pair.draft_dir)
    return ReferenceDecoder(target, draft, max_context=exported_pair.manifest.max_context)


@pytest.fixture(scope="module")
def graphs(exported_pair):
    return Graphs(exported_pair.out, exported_pair.manifest)


def _generate(graphs, exported_pair, samplings):
    sessions = [Session(p, n, s) for p, n, s in zip(exported_pair.prompts, exported_pair.new_tokens, samplings)]
    driver = Driver(graphs, sessions)
    return driver.generate(), sessions, driver.calls


def test_onnx_runtime_generation_equals_reference_greedy(exported_pair, graphs, reference):
    """Guards against any graph, binding or cache-discipline bug that changes tokens: three
    sessions sharing draft_3 / target_verify_3 / verify_argmax_3 calls (then smaller runs, a
    drained long context, chunked prefill, plain decode at the end of the cache) emit exactly the
    reference decoder's greedy DFlash tokens (and the same accepted counts per cycle)."""
    prompts = exported_pair.prompts
    tokens, sessions, calls = _generate(graphs, exported_pair, [Sampling()] * len(prompts))
    for prompt, session, got in zip(prompts, sessions, tokens):
        want = reference.generate_dflash(prompt, session.max_new)
        assert got == want.tokens
        assert session.accepted == want.accepted
    accepted = [a for s in sessions for a in s.accepted]
    assert 0 in accepted and graphs.dims.proposals in accepted, "the tuned draft should sometimes miss and sometimes hit all"
    assert {"draft_3", "target_verify_3", "verify_argmax_3", "draft_context"} <= set(calls)
    assert any(c == contract.TARGET_PREFILL for c in calls[len(prompts) * 3 :]), "plain decode at the cache's end"


def test_onnx_runtime_generation_equals_reference_sampled(exported_pair, graphs, reference):
    """Guards against the sampling graphs diverging from the reference (temperature, top-k, top-p,
    noise of (seed, position, token), verdict): per-session sampling parameters and seeds in one
    verify_sample_3 call, and the sample graph after each prefill, reproduce the reference
    decoder's sampled tokens exactly, untruncated T = 1 included."""
    prompts = exported_pair.prompts
    samplings = [Sampling(1.0, 0, 1.0, seed=1), Sampling(1.2, 20, 0.9, seed=2), Sampling(0.6, 5, 0.7, seed=3)]
    tokens, sessions, calls = _generate(graphs, exported_pair, samplings)
    for prompt, sampling, session, got in zip(prompts, samplings, sessions, tokens):
        assert got == reference.generate_dflash(prompt, session.max_new, sampling).tokens
    assert "verify_sample_3" in calls and contract.SAMPLE in calls


def test_in_place_binding_changes_only_the_owner_rows_and_slots(exported_pair, graphs):
    """Guards against a graph or binding that writes outside the bound owners' rows or their
    slots (another session's cache corrupted): rows 1-2 of a 4-row pool bound in place to
    target_verify_2 and draft_2 change only at the written positions; rows 0 and 3 stay bitwise."""
    dims, rng = graphs.dims, np.random.default_rng(5)
    B, P = dims.block_size, dims.proposals
    for name, pool_of, feeds, written in (
        ("target_verify_2", contract.TARGET_PREFILL, {"tokens": rng.integers(0, 90, (2, P + 1)), "start": np.array([3, 40])}, [(3, 3 + P + 1), (40, 40 + P + 1)]),
        (
            "draft_2",
            contract.DRAFT_CONTEXT,
            {
                "ctx_taps": rng.standard_normal((2, B, dims.tap_width)).astype(np.float32),
                "ctx_start": np.array([0, 30]),
                "ctx_count": np.array([B, 2]),
                "anchor": np.array([5, 6]),
            },
            [(0, 2 * B), (30, 32 + B)],
        ),
    ):
        pool = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in pools(graphs.specs[pool_of], 4).items()}
        before = {k: v.copy() for k, v in pool.items()}
        graphs.run(name, feeds, pool, first_row=1)
        for key, after in pool.items():
            assert np.array_equal(after[[0, 3]], before[key][[0, 3]]), f"{name} touched another session's row"
            for owner, (lo, hi) in enumerate(written):
                row = 1 + owner
                changed = np.any(after[row] != before[key][row], axis=(0, 2))  # per slot
                assert changed[lo:hi].all() and not changed[:lo].any() and not changed[hi:].any(), (name, key, owner)
