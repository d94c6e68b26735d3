"""The executor against the reference decoder: lossless, batch-independent, refusing, poisoning, counting."""

from __future__ import annotations

import copy
import gc
import itertools

import numpy as np
import polars as pl
import pytest
import torch

from dflash_trt.errors import InputError, PoisonedError, SamplingError, SessionError
from dflash_trt.export import contract as c
from dflash_trt.export.reference import ReferenceDecoder
from dflash_trt.export.sampling import Sampling
from dflash_trt.runtime.executor import Admission, Executor, Input
from dflash_trt.runtime.stats import CYCLE_SCHEMA, EXECUTE_SCHEMA, stats_paths
from executor_fixtures import RecordingBackend, DraftReference, Tiny, Tracker, assert_context, tiny_dims

SAMPLED = Sampling(temperature=0.8, top_k=20, top_p=0.9, seed=1234)


def new_executor(
    tiny: Tiny, max_sessions: int = 16, backend: str = "onnxruntime", rounds: int = 1
) -> tuple[Executor, RecordingBackend]:
    """An executor over the shared ONNX Runtime backend, or over a torch backend with small chunks;
    ``-cuda`` variants run the same graphs on the GPU (torch with CUDA graphs, ORT's CUDA provider);
    ``-rounds`` variants launch up to 3 rounds at once (``launch_rounds``), ``-lag2`` variants keep two
    launches queued beyond the one read (``lag``)."""
    lag = 2 if backend.endswith("-lag2") else 1
    backend = backend.removesuffix("-lag2")
    rounds = 3 if backend.endswith("-rounds") else rounds
    backend = backend.removesuffix("-rounds")
    if backend == "onnxruntime":
        return Executor(recording := RecordingBackend(tiny.ort), tiny.dims, max_sessions, launch_rounds=rounds, lag=lag), recording
    if backend == "onnxruntime-cuda":
        from dflash_trt.runtime.backends.ort_backend import OrtBackend

        if "CUDAExecutionProvider" not in __import__("onnxruntime").get_available_providers():
            pytest.skip("onnxruntime-gpu is not installed")
        ort = OrtBackend.from_export(tiny.export_dir, max_sessions=max_sessions, device="cuda")
        return Executor(recording := RecordingBackend(ort), tiny.dims, max_sessions), recording
    dims = tiny_dims(tiny.target, tiny.draft, tiny.dims.max_context)
    if backend == "torch-cuda":
        from dflash_trt.runtime.backends.torch_backend import TorchBackend

        # The backend moves its modules to the GPU: give it copies, the CPU oracle keeps the originals.
        torch_cuda = TorchBackend(copy.deepcopy(tiny.target), copy.deepcopy(tiny.draft), dims, max_sessions, device="cuda")
        return Executor(recording := RecordingBackend(torch_cuda), dims, max_sessions, launch_rounds=rounds), recording
    kernels = "fast" if backend == "torch-fast" else "auto"  # fast: the kernels' CPU twin, row-indexed programs
    recording = RecordingBackend(tiny.torch_backend(dims, max_sessions, kernels))
    return Executor(recording, dims, max_sessions, launch_rounds=rounds, lag=lag), recording


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, 90, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def check_proposals(tiny, tracker: Tracker, backend: RecordingBackend, seen: int) -> int:
    """Every draft call's real proposals equal the reference draft's for that sequence and anchor (but a
    call past the tokens returned: a round of a launch whose earlier round finished its lane, discarded)."""
    rows = {tracker.executor.session(s).row: s for s in tracker.seq}
    references: dict[int, DraftReference] = {}
    for row, start, anchor, proposals in backend.drafts[seen:]:
        sequence = tracker.seq[rows[row]]
        if start >= len(sequence):
            continue
        assert sequence[start] == anchor
        if row not in references:
            references[row] = DraftReference(tiny.target, tiny.draft, sequence)
        expected = references[row].proposals(start, tracker.executor.dims.proposals)
        assert proposals == expected, (row, start)
    return len(backend.drafts)


def checked(tiny, tracker: Tracker, backend: RecordingBackend):
    """tracker.execute, then check the draft calls it made against the reference draft."""
    seen = [0]

    def execute(inputs):
        outputs = tracker.execute(inputs)
        seen[0] = check_proposals(tiny, tracker, backend, seen[0])
        return outputs

    return execute


@pytest.mark.parametrize(
    "backend",
    ["onnxruntime", "torch", "torch-fast", pytest.param("torch-cuda", marks=pytest.mark.gpu),
     pytest.param("onnxruntime-cuda", marks=pytest.mark.gpu)],
)
def test_lossless_sixteen_sessions_with_clones_rewinds_joins_and_leaves(tiny, oracle, backend):
    """Guards against any cache/context bookkeeping bug that changes output, and against a choice made
    differently after a prompt or replay than in a cycle: greedy and sampled output (untruncated T = 1,
    and top-k/top-p) must equal target-only output, and every draft call must see exactly the reference
    draft's context, through prompts (chunked on the torch backend's 8-token chunks), dynamic drains,
    packing, clones, rewinds, replays, joins, leaves and plain decode."""
    executor, backend = new_executor(tiny, backend=backend)
    t = Tracker(executor, oracle)
    execute = checked(tiny, t, backend)
    lengths = [1, 2, 3, 5, 8, 9, 13, 16, 17, 24, 31, 40]
    sessions = [t.open() for _ in lengths]
    # Sampled sessions that get cloned (2, 5, 9), rewound and replayed (4, 7) or just decode (10).
    for index, seed in ((2, 11), (4, 12), (5, 13), (7, 14), (9, 15)):
        t.set_sampling(sessions[index], Sampling(temperature=1.0, seed=seed))
    t.set_sampling(sessions[10], SAMPLED)
    execute([(s, prompt(n, s), None, True) for s, n in zip(sessions, lengths)])
    for _ in range(2):
        execute(t.decode_inputs(sessions))
    a, b, cc, d = sessions[2], sessions[5], sessions[9], sessions[11]
    clones = [t.clone(a, t.frontier(a)), t.clone(b, t.frontier(b) - 3), t.clone(cc, lengths[9]), t.clone(d, 0)]
    assert len(executor.sessions()) == 16
    e, f = sessions[4], sessions[7]
    p_e, p_f = t.frontier(e) - 4, t.frontier(f) - 6
    inputs = t.decode_inputs([a, sessions[0], clones[0]])
    inputs += [(clones[1], [t.seq[clones[1]][-1]], t.frontier(clones[1]) - 1, True)]  # replay one token
    inputs += [(clones[2], [t.seq[clones[2]][-1]], t.frontier(clones[2]) - 1, True)]
    inputs += [(clones[3], prompt(11, 99), 0, True)]
    inputs += [(e, t.seq[e][p_e : p_e + 3], p_e, True), (f, [5, 6, 7], p_f, True)]  # same tokens / diverging
    execute(inputs)
    for s in (sessions[1], sessions[3], sessions[6], sessions[8]):  # leave
        t.close(s)
    running = list(t.seq)
    for step in range(12):
        joined = [t.open() for _ in range(2)] if step == 1 else []
        live = [s for s in running if t.pending[s] and t.frontier(s) + 1 <= executor.dims.max_context]
        if not live and not joined:
            break
        execute(t.decode_inputs(live) + [(s, prompt(7 + s, s), None, True) for s in joined])
        running += joined
    assert int(executor.execute_stats()["hidden_bytes_d2h"].sum()) == 0  # taps never visit the host
    modes = set(executor.cycle_stats()["mode"])
    owners = set(executor.cycle_stats()["owners"])
    assert modes == {"static", "dynamic", "target"} and max(owners) == executor.dims.max_owners


def test_oracle_proposals_accept_many_and_stay_lossless(tiny, oracle):
    """Guards against wrong commits when a > 0 (emitted = d_1..d_a + y_a, frontier = start + a + 1,
    context = taps of rows 0..a): an oracle draft is accepted 0..P tokens per cycle, output must still
    be the reference's and the real draft's proposals must still match the reference draft's."""
    executor, backend = new_executor(tiny, 8)
    t = Tracker(executor, oracle)
    sessions = [t.open() for _ in range(5)]
    prompts = [prompt(n, 50 + n) for n in (4, 9, 12, 20, 3)]
    for s, p in zip(sessions, prompts):
        backend.truth[executor.session(s).row] = p + oracle.continuation(p)
    execute = checked(tiny, t, backend)
    execute([(s, p, None, True) for s, p in zip(sessions, prompts)])
    while live := [s for s in sessions if t.frontier(s) + 1 <= executor.dims.max_context]:
        execute(t.decode_inputs(live))
    spec = executor.cycle_stats().filter(pl.col("mode") != "target")
    assert {0, executor.dims.proposals} <= set(spec["accepted"]) and len(set(spec["accepted"])) >= 5
    assert spec["emitted"].mean() > 2


@pytest.mark.parametrize("with_oracle", [False, True])
def test_sampled_session_is_batch_independent(tiny, oracle, with_oracle):
    """Guards against batch-dependent randomness or cross-row leakage: a sampled session's tokens for a
    fixed seed are the same alone and packed with three others, and equal the reference's sampled
    target-only output."""
    base = prompt(10, 7)

    def run(neighbours: int) -> tuple[list[int], pl.DataFrame]:
        executor, backend = new_executor(tiny, 4)
        t = Tracker(executor, oracle)
        others = [t.open() for _ in range(neighbours // 2)]
        s = t.open()
        others += [t.open() for _ in range(neighbours - neighbours // 2)]
        t.set_sampling(s, SAMPLED)
        for k, o in enumerate(others):
            t.set_sampling(o, Sampling(temperature=[0.0, 1.3, 0.5][k], top_k=[0, 5, 0][k], seed=k))
        if with_oracle:
            backend.truth[executor.session(s).row] = base + oracle.continuation(base, SAMPLED)
        t.execute([(o, prompt(5 + 3 * o, o), None, True) for o in others] + [(s, base, None, True)])
        for _ in range(8):
            t.execute(t.decode_inputs([s, *others]))
        return t.seq[s][len(base) :], executor.cycle_stats().filter(pl.col("session") == s)

    alone, alone_stats = run(0)
    packed, packed_stats = run(3)
    assert packed == alone
    assert alone == oracle.continuation(base, SAMPLED)[: len(alone)]
    assert packed_stats["owners"].max() == tiny.dims.max_owners and set(alone_stats["owners"]) == {1}


class GreedyOnly(RecordingBackend):
    """A backend whose artifacts lack the sampled verifiers (a greedy-only engine set)."""

    @property
    def graph_names(self):
        return tuple(g for g in self.inner.graph_names if not c.sampled_only(g))


def test_greedy_only_artifacts_refuse_sampled_sessions_and_serve_greedy_ones(tiny, oracle):
    """Guards against a sampled session reaching a verify_sample_n the engine set does not have
    (a failed run that poisons every session of the batch): set_sampling refuses it up front,
    naming the missing graphs and the value, and changes nothing; greedy sessions on the same
    backend still give the reference's tokens."""
    executor = Executor(GreedyOnly(tiny.ort), tiny.dims, 4)
    t = Tracker(executor, oracle)
    s = t.open()
    with pytest.raises(SamplingError, match=r"set_sampling.temperature: .*greedy sessions only.*'verify_sample_1'.*got temperature 0.8"):
        executor.set_sampling(s, temperature=0.8, seed=1)
    assert executor.session(s).sampling == Sampling()
    t.set_sampling(s, Sampling(temperature=0.0, seed=5))
    t.execute([(s, prompt(9, 4), None, True)])
    for _ in range(3):
        t.execute(t.decode_inputs([s]))
    assert len(t.seq[s]) > 9 + 3


def test_sampled_sessions_do_not_rebuild_the_graph_list_per_request(tiny, oracle, monkeypatch):
    """Guards against each sampled session's check for the sampled verifiers asking the backend for its list of
    every graph name once per verifier it wants (max_owners x verify lengths lists, each rebuilt: 0.2 s per
    sampled request at 64 owners, on the serving thread): once the executor is built it never asks again, and
    sampled sessions, set one by one or admitted into a running call, still give the reference's tokens."""
    executor, _ = new_executor(tiny, 4, "torch-fast")
    asked = []
    monkeypatch.setattr(RecordingBackend, "graph_names", property(lambda self: asked.append(1) or self.inner.graph_names))
    t = Tracker(executor, oracle)
    sessions = [t.open() for _ in range(2)]
    for i, s in enumerate(sessions):
        t.set_sampling(s, Sampling(temperature=0.8, top_k=20, seed=11 + i))
    t.execute([(s, prompt(7 + i, 5 + i), None, True) for i, s in enumerate(sessions)])
    t.execute(t.decode_inputs(sessions))
    joining = Sampling(temperature=0.7, seed=5)
    admitted = iter([[], [Admission(prompt(6, 3), 8, sampling=joining)]])
    outputs = executor.execute_outputs([Input(executor.open_session(), prompt(9, 8), max_new_tokens=12)], admit=lambda: next(admitted, []))
    got = outputs[1].tokens
    assert got and got == oracle.continuation(prompt(6, 3), joining)[: len(got)]
    assert not asked, f"the backend's graph list was asked for {len(asked)} times while serving"


@pytest.mark.parametrize("backend", ["onnxruntime", "torch-fast", pytest.param("torch-cuda", marks=pytest.mark.gpu)])
def test_a_drafting_session_decodes_to_the_contexts_end_in_one_call_and_drafts_again_after_a_rewind(tiny, oracle, backend):
    """Guards against a drafting session without a block's room decoding one step per call (the host
    committed each step's tap; a session that does not draft ran max_cycles steps there, and a serving
    loop's request spent its last tokens one execute each): one call with the room returns every token to
    the context's end, the reference's, whether the session cycled into the end or its prompt began there,
    whatever pending context it arrived with; and against the context rows drained on the way being lost
    or misplaced: rewound to where a block fits, every draft call sees the reference draft's context."""
    executor, recording = new_executor(tiny, 8, backend)
    L, B = executor.dims.max_context, executor.dims.block_size
    t = Tracker(executor, oracle)
    execute = checked(tiny, t, recording)
    lengths = [L - B - 9, L - B - 4, L - B - 1, L - B + 1, L - 3, L - B - 9]  # cycling into the end, or starting past where a block fits
    prompts = [prompt(n, 60 + k) for k, n in enumerate(lengths)]
    sessions = [t.open() for _ in lengths]
    # The last one's proposals are the target's own (all accepted): it reaches the end with its pending rows full.
    recording.truth[executor.session(sessions[-1]).row] = prompts[-1] + oracle.continuation(prompts[-1])
    outputs = execute([(s, p, None, True, {"max_new_tokens": L}) for s, p in zip(sessions, prompts)])
    # Tokens at positions n .. L: the last one can never be fed (its K/V would need slot L).
    assert [len(out) for out in outputs] == [L - n + 1 for n in lengths]
    for s in sessions:
        assert_context(tiny, executor, recording, executor.session(s), t.seq[s])
    drafted = len(recording.drafts)
    for k, s in enumerate(sessions):  # rewound to where a block fits: the rows drained at the end are its context again
        r = L - B - 1 - k
        execute([(s, [t.seq[s][r]], r, True, {"max_new_tokens": L})])
        assert t.frontier(s) == L
    assert len(recording.drafts) > drafted  # the rewound sessions drafted (each call checked against the reference)


def test_stats_count_every_token_and_tau_matches_reference(tiny, tmp_path):
    """Guards against dropped or duplicated stats rows and a τ that drifts from the reference's
    acceptance (including plain-decode steps near the context end, which must not count in τ)."""
    target, draft, dims = tiny.target, tiny.draft, tiny.dims
    executor, _ = new_executor(tiny, 2)
    p = prompt(21, 3)
    s = executor.open_session()
    returned = executor.execute([Input(s, np.array(p))])[0]  # numpy ids are accepted as plain ints
    wanted = dims.max_context - len(p)  # the reference's limit: prompt + new tokens <= max_context
    while len(returned) < wanted:
        returned += executor.execute([Input(s, [executor.session(s).pending])])[0]
    reference = ReferenceDecoder(target, draft, max_context=dims.max_context).generate_dflash(p, wanted)
    assert returned[:wanted] == reference.tokens
    cycles, executes = executor.cycle_stats(), executor.execute_stats()
    assert cycles.schema == pl.Schema(CYCLE_SCHEMA) and executes.schema == pl.Schema(EXECUTE_SCHEMA)
    assert cycles["emitted"].sum() == len(returned)
    spec = cycles.filter(pl.col("mode") != "target")
    assert spec["accepted"].to_list() == reference.accepted
    assert (spec["accepted"] + 1).mean() == pytest.approx(reference.tau)
    assert cycles.filter(pl.col("mode") == "target").height == 1 + reference.target_steps
    for counter, column in (("cycles", None), ("proposed", "proposed"), ("accepted", "accepted"), ("bonuses", "bonus")):
        assert executes[counter].sum() == (spec.height if column is None else spec[column].cast(pl.Int64).sum())
    assert executes["hidden_bytes_d2h"].sum() == 0 and executes["hidden_rows_d2d"].sum() > 0
    assert executes["ok"].all() and executes["pending_decode"].sum() == spec.height - 1
    paths = executor.write_stats(tmp_path / "run")
    assert paths == stats_paths(tmp_path / "run")
    assert pl.read_parquet(paths[0]).equals(cycles) and pl.read_parquet(paths[1]).equals(executes)


def default_pair_case():
    """The shipped default pair on the torch backend (CPU, fp32, no export): τ ≈ 3-6, so a session's
    last cycle often fills its budget while the next one is in flight. Prompts: held-out code."""
    import json

    from dflash_trt.export.exporter import ExportOptions, contract_dims
    from dflash_trt.export.pair import DEFAULT_PAIR_DIR, load_pair
    from dflash_trt.export.tokenizer import Tokenizer
    from dflash_trt.runtime.backends.torch_backend import TorchBackend

    dirs = DEFAULT_PAIR_DIR / "target", DEFAULT_PAIR_DIR / "draft"
    target, draft = load_pair(*dirs, dtype=torch.float32)
    dims = contract_dims(target, draft, ExportOptions(max_owners=1, max_context=256, dtype="fp32").resolve(*dirs))
    tokenizer = Tokenizer.from_dir(dirs[0])
    lines = (DEFAULT_PAIR_DIR / "prompts.jsonl").read_text().splitlines()[5:8]
    prompts = [tokenizer.encode(json.loads(line)["prompt"])[-100:] for line in lines]
    return target, draft, lambda: TorchBackend(target, draft, dims, 1), prompts, 64


def lagged_run(backend, prompt_ids: list[int], budget: int, lag: int, rounds: int = 1):
    """One session to ``budget`` tokens through budgeted executes (≤ 8 cycles each, ``rounds`` per launch at
    most): (tokens, cycles, executes, launches)."""
    with Executor(backend, max_sessions=1, max_cycles=8, lag=lag, launch_rounds=rounds) as executor:
        s = executor.open_session()
        returned = executor.execute([Input(s, prompt_ids, max_new_tokens=budget)])[0]
        while len(returned) < budget:
            returned += executor.execute([Input(s, [executor.session(s).pending], max_new_tokens=budget - len(returned))])[0]
        return returned, executor.cycle_stats(), executor.execute_stats(), executor.loop.timeline.launches


@pytest.mark.parametrize("case", ["default-pair-torch", "tiny-onnxruntime"])
def test_lag_on_and_off_log_the_same_rows_and_tau_as_the_reference(tiny, case):
    """Guards against a cycle launched ahead (the host one cycle behind, ``lag``) landing in the stats
    after its tokens were discarded: its session had filled its budget with the cycle before, so the
    caller never saw them (the default pair, 64 new tokens: 13 rows, 73 emitted for 64 returned). With
    lag on and off the cycle rows (timing aside) must be the same, Σ emitted the tokens returned, and the
    speculative rows' acceptances and τ the reference decoder's; lag on must really have launched more.
    And with three rounds per launch: the same rows (one per round read, none for rounds discarded
    after the budget was filled) from fewer launches; with two launches queued (lag 2): the same rows, and
    no fewer launches than lag 1."""
    if case == "default-pair-torch":
        target, draft, backend, prompts, budget = default_pair_case()
    else:  # seed 5, 10 tokens: a discarded read-ahead cycle on the tiny pair
        target, draft, backend, prompts, budget = tiny.target, tiny.draft, lambda: tiny.ort, [prompt(11, 5)], 10
    extra_launches = 0
    for p in prompts:
        reference = ReferenceDecoder(target, draft, max_context=256 if case.startswith("default") else tiny.dims.max_context)
        expected = reference.generate_dflash(p, budget)
        rows, launches = {}, {}
        for lag, rounds in ((True, 1), (False, 1), (True, 3), (2, 1)):
            returned, cycles, executes, launches[lag, rounds] = lagged_run(backend(), p, budget, lag, rounds)
            spec = cycles.filter(pl.col("mode") != "target")
            assert returned == expected.tokens
            assert cycles["emitted"].sum() == len(returned) == budget
            assert spec["accepted"].to_list() == expected.accepted
            assert (spec["accepted"] + 1).mean() == pytest.approx(expected.tau)
            assert executes["cycles"].sum() == spec.height and executes["accepted"].sum() == spec["accepted"].sum()
            rows[lag, rounds] = cycles.drop("draft_ms", "verify_ms", "host_ms", "end_ms")
        assert rows[True, 1].equals(rows[False, 1]) and rows[True, 3].equals(rows[False, 1]) and rows[2, 1].equals(rows[False, 1])
        extra_launches += launches[True, 1] - launches[False, 1]
        assert launches[2, 1] >= launches[True, 1]
        assert launches[True, 3] < launches[False, 1]  # rounds ran several to a launch
    assert extra_launches > 0  # the read-ahead cycle really ran, and was left out


@pytest.mark.parametrize("backend", ["onnxruntime", "torch", "torch-fast", "torch-fast-rounds", "onnxruntime-rounds", "torch-fast-lag2", "onnxruntime-lag2"])
def test_budgeted_executes_cut_rewind_and_continue_losslessly(tiny, oracle, backend):
    """Guards against a wrong rewind after a multi-cycle execute discards tokens past a stop token or
    max_new_tokens (a cycle in flight when the stop was read, or a later round of the same launch): the
    next calls must continue from the last returned token with the reference's output, for drafting and
    plain-decoding sessions sharing batches, greedy and sampled, through the context end (plain decode
    of a drafting session)."""
    executor, backend = new_executor(tiny, 6, backend)
    executor.max_cycles = 5
    t = Tracker(executor, oracle)
    drafting, plain = [t.open() for _ in range(3)], [t.open(speculate=False) for _ in range(2)]
    t.set_sampling(drafting[1], SAMPLED)
    t.set_sampling(plain[1], SAMPLED)
    sessions = drafting + plain
    execute = checked(tiny, t, backend)
    execute([(s, prompt(4 + 5 * s, s), None, True, {"max_new_tokens": 3 + s}) for s in sessions])
    for call in range(40):
        live = [s for s in sessions if t.frontier(s) + 1 <= executor.dims.max_context]
        if not live:
            break
        extra = [{"max_new_tokens": 1 + (call + s) % 9} for s in live]
        for s, e in zip(live, extra):  # a stop token a few tokens ahead, every other call
            ahead = oracle.continuation(t.seq[s], t.sampling[s])[1 : 2 + (call + s) % 4]
            if (call + s) % 2 and ahead:
                e["stop"] = [ahead[-1]]
        execute([item + (e,) for item, e in zip(t.decode_inputs(live), extra)])
    assert not live
    stats = executor.cycle_stats()
    plain_rows = stats.filter(pl.col("session").is_in(plain))
    assert set(plain_rows["mode"]) == {"target"} and set(stats.filter(pl.col("session").is_in(drafting))["mode"]) >= {"static", "target"}
    assert not [d for d in backend.drafts if d[0] in {executor.session(s).row for s in plain}]
    executes = executor.execute_stats()
    assert executes["loop_launches"].sum() == executor.loop.timeline.launches
    several = executes["loop_rounds"].sum() > executes["loop_launches"].sum()
    assert several == (executor.loop.most_rounds > 1)  # launches really ran several rounds where allowed, never otherwise


def test_lanes_near_their_end_share_the_others_launch_of_several_rounds(tiny):
    """Guards against lanes held to one round by their room alone (requests ending at different rounds,
    which under load is every round) splitting a round into a launch of several rounds and one of a
    single round for them: a launch and a read more per round, where the host's work follows its
    launches. They run in the others' launch, the rounds their room cannot use discarded: the same
    tokens and finishes as one round per launch, and the first launch carries every lane."""
    budgets = [40, 40, 2, 3]  # the last two: room for fewer than 3 rounds after their prompt's token
    outputs, launched = {}, {}
    for backend in ("torch-fast", "torch-fast-rounds"):
        executor, _ = new_executor(tiny, len(budgets), backend)
        launches, launch = [], executor.loop.launch

        def recorded(kind, sampled, rows, proposals=0, rounds=1, launch=launch, launches=launches):
            launches.append((kind, tuple(rows), rounds))
            return launch(kind, sampled, rows, proposals, rounds)

        executor.loop.launch = recorded
        sessions = [executor.open_session() for _ in budgets]
        out = executor.execute_outputs([Input(s, prompt(6 + i, 40 + i), max_new_tokens=b) for i, (s, b) in enumerate(zip(sessions, budgets))])
        outputs[backend] = [(o.tokens, o.finish) for o in out]
        launched[backend] = launches
        rows = {executor.session(s).row for s in sessions}
        executor.close()
    assert outputs["torch-fast"] == outputs["torch-fast-rounds"]
    assert [len(tokens) for tokens, _ in outputs["torch-fast"]][2:] == budgets[2:]  # the short ones ran to their budget
    first = launched["torch-fast-rounds"][0]
    assert set(first[1]) == rows and first[2] == 3, first  # every lane, three rounds
    assert len(launched["torch-fast-rounds"]) < len(launched["torch-fast"])


def test_several_rounds_per_launch_keep_one_rounds_stats(tiny, oracle):
    """Guards against the launch-wide read of several rounds (each lane's tokens of every round taken at
    once) miscounting a lane that finishes inside a launch: a cycle row or an acceptance for a round after
    its last kept token, its last round's emitted count not cut to the tokens it kept, or a row at another
    position. Lanes with budgets and stop tokens that end them mid-launch, drafting and plain sessions:
    the cycles table's rows per session and the per-owner counters equal one round per launch's."""
    budgets = [9, 2, 7, 13, 5]
    rows, counters = {}, {}
    per_owner = ["cycles", "proposed", "accepted", "bonuses", "rejected", "target_decode_steps", "policy_cycles"]
    for backend in ("torch-fast", "torch-fast-rounds"):
        executor, recording = new_executor(tiny, len(budgets), backend)
        sessions = [executor.open_session(speculate=i != 3) for i in range(len(budgets))]
        inputs = []
        for i, (s, budget) in enumerate(zip(sessions, budgets)):
            text = prompt(6 + 3 * i, 20 + i)
            if i % 2 == 0:  # an oracle draft: cycles accept many, so a lane's end cuts a cycle's tokens
                recording.truth[executor.session(s).row] = text + oracle.continuation(text)
            stop = oracle.continuation(text)[4:5] if i == 0 else []  # session 0 stops at its fifth token, inside a launch
            inputs.append(Input(s, text, max_new_tokens=budget, stop=stop))
        for _ in range(3):  # the first call, then two continuing ones
            outputs = executor.execute_outputs(inputs)
            inputs = [Input(s, [o.tokens[-1]], max_new_tokens=b) for s, o, b in zip(sessions, outputs, budgets) if o.tokens]
        # Not context_rows: a discarded round's draft consumed pending rows, so the rows the next cycle's draft
        # takes depend on how far the launches ran past a lane's end (its output does not).
        table = executor.cycle_stats().select("session", "position", "mode", "proposed", "accepted", "bonus", "emitted")
        rows[backend] = table.sort("session", "position").rows()
        executes = executor.execute_stats()
        counters[backend] = {name: int(executes[name].sum()) for name in per_owner}
        several = executes["loop_rounds"].sum() > executes["loop_launches"].sum()
        assert several == (backend == "torch-fast-rounds")
        executor.close()
    assert rows["torch-fast"] == rows["torch-fast-rounds"]
    assert counters["torch-fast"] == counters["torch-fast-rounds"]
    assert any(row[-1] < row[4] + 1 for row in rows["torch-fast"] if row[2] != "target")  # a cycle cut by its lane's end


def snapshot(executor: Executor) -> list:
    return [executor.session(s) for s in executor.sessions()]


@pytest.mark.parametrize(
    "make_batch, error, words",
    [
        (lambda s, v: [Input(s, [1, 2]), Input(999, [1])], SessionError, ["input[1].session", "999"]),
        (lambda s, v: [Input(s, [1, 97])], InputError, ["input[0].tokens[1]", "[0, 96]", "97"]),
        (lambda s, v: [Input(s, [1, -1])], InputError, ["input[0].tokens[1]", "-1"]),
        (lambda s, v: [Input(s, [1, 2], size=0)], InputError, ["input[0].size", "[1, 2]", "0"]),
        (lambda s, v: [Input(s, [1, 2], offset=3)], InputError, ["input[0].offset", "[0, 2]", "3"]),
        (lambda s, v: [Input(s, [1], position=v.frontier + 1)], InputError, ["input[0].position", "[0, ", "frontier"]),
        (lambda s, v: [Input(s, [1] * 60, position=10)], InputError, ["input[0].size", "max_context 64", "70"]),
        (lambda s, v: [Input(s, [1], position=2), Input(s, [1], position=2)], InputError, ["input[1].position", "continue at 3"]),
        (lambda s, v: [Input(s, [1], produce_output="yes")], InputError, ["input[0].produce_output"]),
        (lambda s, v: [Input(s, "abc")], InputError, ["input[0].tokens"]),
        (lambda s, v: [Input(s, np.array(5))], InputError, ["input[0].tokens", "1-D"]),
        (lambda s, v: [Input(s, torch.tensor([[1, 2]]))], InputError, ["input[0].tokens", "1-D", "[1, 2]"]),
        (lambda s, v: [Input(s, [1], position=-2)], InputError, ["input[0].position", ">= 0", "-2"]),
        (lambda s, v: [], InputError, ["non-empty"]),
        (lambda s, v: [{"session": s, "tokens": [1], "colour": 3}], InputError, ["input[0]", "colour"]),
        (lambda s, v: [Input(s, [1], max_new_tokens=0)], InputError, ["input[0].max_new_tokens", ">= 1", "0"]),
        (lambda s, v: [Input(s, [1], max_new_tokens=4, produce_output=False)], InputError, ["input[0].max_new_tokens", "produce_output"]),
        (lambda s, v: [Input(s, [1], max_new_tokens=4, stop=[3, 97])], InputError, ["input[0].stop[1]", "[0, 96]", "97"]),
    ],
)
def test_invalid_batches_are_refused_and_change_nothing(tiny, oracle, make_batch, error, words):
    """Guards against partial mutation on a bad batch (every input must be validated first) and
    against unhelpful errors: each names the field, the valid range and the value seen."""
    executor, _ = new_executor(tiny, 4)
    t = Tracker(executor, oracle)
    s, other = t.open(), t.open()
    t.execute([(s, prompt(12, 1), None, True), (other, prompt(5, 2), None, True)])
    before = snapshot(executor)
    with pytest.raises(error) as info:
        executor.execute(make_batch(s, executor.session(s)))
    assert all(word in str(info.value) for word in words), str(info.value)
    assert snapshot(executor) == before
    t.execute(t.decode_inputs([s, other]))  # and both continue exactly as before


def test_invalid_session_calls_are_refused(tiny, oracle):
    """Guards against set_sampling/clone/close accepting out-of-range values or unknown sessions."""
    executor, _ = new_executor(tiny, 2)
    s = executor.open_session()
    executor.execute([Input(s, [4, 5, 6])])
    before = snapshot(executor)
    for call, error, word in [
        (lambda: executor.set_sampling(s, temperature=float("nan")), SamplingError, "temperature"),
        (lambda: executor.set_sampling(s, temperature=-1.0), SamplingError, "temperature"),
        (lambda: executor.set_sampling(s, top_p=0.0), SamplingError, "top_p"),
        (lambda: executor.set_sampling(s, top_p=1.5), SamplingError, "top_p"),
        (lambda: executor.set_sampling(s, top_k=-2), SamplingError, "top_k"),
        (lambda: executor.set_sampling(s, seed=-1), SamplingError, "seed"),
        (lambda: executor.set_sampling(7, temperature=1.0), SessionError, "set_sampling.session"),
        (lambda: executor.clone(s, executor.session(s).frontier + 1), InputError, "clone.upto"),
        (lambda: executor.clone(s, -1), InputError, "clone.upto"),
        (lambda: executor.clone(9, 0), SessionError, "clone.session"),
        (lambda: executor.close_session(9), SessionError, "9"),
    ]:
        with pytest.raises(error, match=word):
            call()
        assert snapshot(executor) == before
    executor.open_session()
    with pytest.raises(SessionError, match="max_sessions is 2"):
        executor.open_session()
    with pytest.raises(SessionError, match="max_sessions is 2"):
        executor.clone(s, 1)


def test_failure_poisons_the_batch_sessions_only(tiny, oracle):
    """Guards against a mid-cycle failure leaving half-updated sessions usable, or touching a session
    outside the failed batch: those of the batch are poisoned and refused until closed, the others
    continue with the reference's tokens."""
    executor, backend = new_executor(tiny, 4)
    t = Tracker(executor, oracle)
    a, b, bystander = t.open(), t.open(), t.open()
    t.execute([(a, prompt(9, 1), None, True), (b, prompt(14, 2), None, True), (bystander, prompt(6, 3), None, True)])
    backend.fail_on = ("target_verify", backend.counts["target_verify"] + 1)
    with pytest.raises(PoisonedError, match=r"sessions \[0, 1\].*injected failure"):
        executor.execute([Input(a, [t.seq[a][-1]]), Input(b, [t.seq[b][-1]])])
    assert executor.session(a).poisoned and executor.session(b).poisoned
    last = {s: t.seq[s][-1] for s in (a, b)}
    t.forget(a)
    t.forget(b)
    for call in (
        lambda: executor.execute([Input(a, [last[a]])]),
        lambda: executor.execute([Input(bystander, [t.seq[bystander][-1]]), Input(b, [1])]),
        lambda: executor.clone(a, 0),
        lambda: executor.set_sampling(b, 0.5),
    ):
        with pytest.raises(PoisonedError, match="poisoned"):
            call()
    assert executor.execute_stats()["failed_batches"].sum() == 1
    t.execute(t.decode_inputs([bystander]))
    executor.close_session(a)
    executor.close_session(b)
    fresh = t.open()  # reuses a poisoned row: must start clean
    t.execute([(fresh, prompt(10, 4), None, True)] + t.decode_inputs([bystander]))
    t.execute(t.decode_inputs([fresh, bystander]))


@pytest.mark.parametrize("backend", ["onnxruntime", "torch", "torch-fast", "torch-fast-rounds"])
def test_tokens_per_call_do_not_depend_on_batching(tiny, oracle, backend):
    """Guards against a lane's budget being cut by its neighbours: an execute stopped a group's cycles
    as soon as one lane was done, so a session given max_new_tokens=20 returned its 20 tokens alone but
    7 beside a one-step input on the next row. Each lane now launches until its own room, stop or
    max_cycles end it."""
    executor, _ = new_executor(tiny, 6, backend)
    assert executor.loop.row_indexed == backend.startswith("torch-fast")  # one program per padded count, any rows
    executor.max_cycles = 8
    text = prompt(9, 1)
    gc.collect()  # executors of earlier tests give their rows of the shared backend back: the next rows are neighbours
    a, one_step, short = executor.open_session(), executor.open_session(), executor.open_session()
    alone_session = executor.open_session()
    alone = executor.execute_outputs([Input(alone_session, text, max_new_tokens=20)])[0]
    executor.close_session(alone_session)
    rows = [executor.session(s).row for s in (a, one_step, short)]
    assert sorted(rows) == list(range(min(rows), min(rows) + 3))  # neighbours: one group on row-bound backends
    outputs = executor.execute_outputs(
        [Input(a, text, max_new_tokens=20), Input(one_step, prompt(5, 2)), Input(short, prompt(6, 3), max_new_tokens=2)]
    )
    assert outputs[0] == alone
    assert alone.tokens == oracle.continuation(text)[: len(alone.tokens)]
    assert len(alone.tokens) >= 1 + executor.max_cycles  # the prediction, then >= 1 token from each of max_cycles launches
    assert len(outputs[2].tokens) == 2 and outputs[2].finish == "length"


def test_outputs_say_why_they_ended(tiny, oracle):
    """Guards against callers re-deriving finish reasons (re-truncating and re-scanning stop tokens, asking
    the session's frontier): the executor reports LENGTH, STOP (the stop token kept) and CONTEXT itself."""
    executor, _ = new_executor(tiny, 6)
    L = executor.dims.max_context
    text = prompt(7, 4)
    expected = oracle.continuation(text)
    s1, s2, s4 = (executor.open_session() for _ in range(3))
    s3 = executor.open_session(speculate=False)  # decodes max_cycles steps per execute up to the end
    stop = expected[2]
    outputs = executor.execute_outputs(
        [
            Input(s1, text, max_new_tokens=3),
            Input(s2, text, max_new_tokens=30, stop=[stop]),
            Input(s3, prompt(L - 3, 5), max_new_tokens=10),
            Input(s4, text),
        ]
    )
    assert outputs[0].tokens == expected[:3] and outputs[0].finish == "length"
    cut = expected.index(stop) + 1
    assert outputs[1].tokens == expected[:cut] and outputs[1].finish == "stop"
    # Tokens at positions L-3 .. L: the last one can never be fed (its K/V would need slot L).
    assert len(outputs[2].tokens) == 4 and outputs[2].finish == "context"
    assert outputs[3].finish is None and outputs[3].tokens == expected[: len(outputs[3].tokens)]


def test_a_delivery_tick_holds_middle_tokens_and_loses_none(tiny, oracle, monkeypatch):
    """Guards against a serving loop paying a callback per lane per launch for tokens it only hands out
    every tick (the executor held nothing: three calls deep per lane and round on the serving thread),
    and against a tick that drops, repeats or reorders tokens: with ``stream_interval`` a prompt's first
    tokens and an input's last go out at once, a continuing input's first ones wait, every lane's held
    tokens go out together on each tick (one callback per lane per tick), and the streamed tokens followed
    by each output's unstreamed rest are the reference's. Time is a fake clock advanced by each graph run."""
    from types import SimpleNamespace

    from dflash_trt.runtime import executor as executor_module

    clock = [0.0]
    monkeypatch.setattr(executor_module, "time", SimpleNamespace(perf_counter=lambda: clock[0]))

    class Ticking(RecordingBackend):
        def run(self, graph, feeds, first_row):
            clock[0] += 1.0
            return super().run(graph, feeds, first_row)

    executor = Executor(Ticking(tiny.ort), tiny.dims, 3, max_cycles=12)
    with pytest.raises(InputError, match=r"stream_interval must be a number of seconds >= 0, got -1"):
        executor.execute_outputs([Input(executor.open_session(), [5])], lambda *a: None, stream_interval=-1)
    texts = [prompt(5, 31), prompt(9, 32)]
    sessions = [executor.open_session() for _ in texts]
    first = executor.execute_outputs([Input(s, t, max_new_tokens=4) for s, t in zip(sessions, texts)])
    calls: list[tuple[float, int, list[int], str | None]] = []
    started = clock[0]
    inputs = [Input(s, [out.tokens[-1]], max_new_tokens=5 + 3 * i) for i, (s, out) in enumerate(zip(sessions, first))]
    outputs = executor.execute_outputs(inputs, lambda i, tokens, finish: calls.append((clock[0], i, list(tokens), finish)), stream_interval=5.0)
    for i, (text, out) in enumerate(zip(texts, outputs)):
        streamed = [token for _, j, tokens, _ in calls if j == i for token in tokens]
        assert out.tokens[: len(streamed)] == streamed  # streamed ones first, then the rest in the output only
        assert first[i].tokens + out.tokens == oracle.continuation(text)[: 4 + len(out.tokens)]
        assert [finish for _, j, _, finish in calls if j == i][-1:] in ([], [None], [out.finish])
    times = sorted({t for t, _, _, finish in calls if finish is None})
    assert times and all(b - a >= 5.0 for a, b in itertools.pairwise(times))  # held tokens go out a tick apart at most once
    for t in times:
        lanes = [i for at, i, _, finish in calls if at == t and finish is None]
        assert len(lanes) == len(set(lanes))  # one callback per lane per tick
    assert times[0] >= started + 5.0  # continuing inputs' first tokens waited for the first tick
    assert [finish for *_, finish in calls if finish is not None] == ["length", "length"]  # each end at once, tick or not
    executor.close()


@pytest.mark.parametrize("pad", [False, True], ids=["exact-shape", "padded-shape"])
def test_joining_prompts_are_prefilled_together_losslessly(tiny, oracle, pad):
    """Guards against batched prefill (one ragged launch for every joining prompt, padded rows masked)
    writing padding into a cache, attending past a prompt's end or draining the wrong taps: outputs of
    prompts of mixed lengths, greedy and sampled, drafting and plain, must equal the reference's, with
    fewer target launches than prompts. Padded: the launch at its captured shape (owners padded to a
    bucket with scratch-row lanes, tokens to a power of two), as CUDA graphs replay it."""
    dims = tiny_dims(tiny.target, tiny.draft, tiny.dims.max_context, max_chunk=40)
    executor = Executor(tiny.torch_backend(dims, 8, kernels="fast"), dims, 8)
    executor.prefill.pad = pad
    t = Tracker(executor, oracle)
    sessions = [t.open() for _ in range(5)] + [t.open(speculate=False)]
    t.set_sampling(sessions[1], SAMPLED)
    lengths = [3, 30, 17, 1, 25, 9]  # drafting prompts longer than B drain through the batched draft_context
    t.execute([(s, prompt(n, 50 + s), None, True, {"max_new_tokens": 12}) for s, n in zip(sessions, lengths)])
    counters = executor.execute_stats()
    assert counters["target_preamble_calls"].sum() == len(sessions)
    assert counters["target_preamble_forwards"].sum() < len(sessions)
    for _ in range(3):
        t.execute([item + ({"max_new_tokens": 5},) for item in t.decode_inputs(sessions)])


@pytest.mark.parametrize("pad", [False, True], ids=["exact-shape", "padded-shape"])
def test_a_large_join_is_split_into_launches_that_fit(tiny, oracle, pad):
    """Guards against a large join (the requests that queued during one execute, joining at once) forming
    one prefill batch that cannot run as it should: more prompts than the ``sample`` graph's rows
    (max_owners · (P + 1) = 32 here: the execute failed and poisoned every joining session), or, padded,
    a shape never captured (it would run eagerly, a host-bound crawl that stalls every running stream on
    a GPU). 40 prompts of 64 padded tokens go as 32 + 8, each padded launch at a captured shape, and
    the outputs equal the reference."""
    from dflash_trt.runtime.prefill import CAPTURE_TOKENS

    dims = tiny_dims(tiny.target, tiny.draft, 256, max_chunk=64)
    executor = Executor(tiny.torch_backend(dims, 40, kernels="fast"), dims, 40)
    prefill = executor.prefill
    prefill.pad = pad  # padded: as where the shapes are captured (CUDA graphs)
    assert prefill.most == 32 and (40, 64) not in prefill.shapes and 40 * 64 > CAPTURE_TOKENS
    launched, launch = [], prefill.launch
    prefill.launch = lambda prompts, width, offset=0: launched.append(prefill._padded(len(prompts), width) if pad else (len(prompts), width)) or launch(prompts, width, offset)
    t = Tracker(executor, oracle)
    sessions = [t.open() for _ in range(40)]
    t.execute([(s, prompt(33 + s % 28, 80 + s), None, True, {"max_new_tokens": 3}) for s in sessions])
    assert sorted(n for n, _ in launched) == [8, 32], launched
    assert not pad or all(shape in prefill.shapes for shape in launched), launched


def test_a_joining_prompts_first_token_read_after_its_launch_ends_it_losslessly(tiny, oracle):
    """Guards against mishandling a batched prefill's token, which stays on the device as its row's anchor
    and reaches the host with the first verdict after the loop has launched: a prompt whose first token
    is a stop token, or whose room is one token, returns exactly that token (the cycle its lane launched
    meanwhile discarded, the session rewound) and its next calls continue as the reference does; the
    others' first tokens feed their cycles and stream before their cycles' tokens, each burst closed by
    ``on_streamed`` before the next (a server sending the first token only after the first cycle was read:
    one cycle more to every request's first token)."""
    dims = tiny_dims(tiny.target, tiny.draft, tiny.dims.max_context, max_chunk=64)  # every prompt one chunk: batched
    executor = Executor(tiny.torch_backend(dims, 6, kernels="fast"), dims, 6)
    assert executor.prefill is not None  # row-indexed: prompts are prefilled together, their tokens read late
    t = Tracker(executor, oracle)
    sessions = [t.open() for _ in range(4)] + [t.open(speculate=False)]
    t.set_sampling(sessions[2], SAMPLED)
    prompts = {s: prompt(9 + 7 * s, 300 + s) for s in sessions}
    first = {s: oracle.continuation(prompts[s], t.sampling[s])[0] for s in sessions}
    extras = {sessions[0]: {"max_new_tokens": 12, "stop": [first[sessions[0]]]}, sessions[1]: {"max_new_tokens": 1},
              sessions[2]: {"max_new_tokens": 12}, sessions[3]: {"max_new_tokens": 12},
              sessions[4]: {"max_new_tokens": 12, "stop": [first[sessions[4]]]}}
    out = t.execute([(s, prompts[s], None, True, extras[s]) for s in sessions])  # checked against the reference
    assert [len(o) for o in out[:2]] == [1, 1] and out[4] == [first[sessions[4]]], out
    assert all(len(o) > 1 for o in out[2:4]), out  # cycles ran on the device-side anchors
    for _ in range(3):  # the sessions cut at their first token go on from it
        t.execute([item + ({"max_new_tokens": 6},) for item in t.decode_inputs(sessions)])
    streamed: dict[int, list[list[int]]] = {}
    events: list[str] = []
    batch = [Input(t.open(), prompt(12, 9), max_new_tokens=20)]
    outputs = executor.execute_outputs(batch, on_tokens=lambda i, tokens, finish: (events.append("tokens"), streamed.setdefault(i, []).append(list(tokens))),
                                       on_streamed=lambda: events.append("streamed"))
    got = outputs[0].tokens
    assert len(got) > 2 and got == oracle.continuation(prompt(12, 9))[: len(got)], got
    assert streamed[0][0] == got[:1] and [token for chunk in streamed[0] for token in chunk] == got, streamed  # its first token alone, first
    assert events == ["tokens", "streamed"] * len(streamed[0]), events  # one burst per read here: each closed before the next


@pytest.mark.gpu
def test_joining_prompts_replay_prefill_programs_captured_at_start_up(tiny, oracle):
    """Guards against joining prompts being prefilled eagerly on CUDA (~100 kernel launches from Python
    per batch), against a capture or compile while serving, and against a replayed prefill that reads
    stale inputs or writes the wrong rows: every padded prefill shape is captured at start-up, batches
    of joining prompts replay them (no eager prefill program runs afterwards), and the outputs, greedy
    and sampled, drafting and plain, equal the reference's."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from dflash_trt.runtime.backends.torch_backend import TorchBackend

    dims = tiny_dims(tiny.target, tiny.draft, tiny.dims.max_context, max_chunk=40)  # prompts up to 40 batch
    backend = TorchBackend(copy.deepcopy(tiny.target), copy.deepcopy(tiny.draft), dims, 8, device="cuda")
    executor = Executor(backend, dims, 8)
    prefill = executor.prefill
    assert prefill is not None and len(prefill.captured) == len(prefill.shapes) > 1 and prefill.pad
    eager = []
    program = prefill._program
    prefill._program = lambda n, T, drafting: (eager.append((n, T)), program(n, T, drafting))
    t = Tracker(executor, oracle)
    sessions = [t.open() for _ in range(5)] + [t.open(speculate=False)]
    t.set_sampling(sessions[1], SAMPLED)
    for wave in (sessions[:3], sessions[3:]):  # two joins: 3 then 3 prompts (padded to 4 owners)
        t.execute([(s, prompt(n, 70 + s), None, True, {"max_new_tokens": 9}) for s, n in zip(wave, [3, 30, 17])])
    for _ in range(3):
        t.execute([item + ({"max_new_tokens": 5},) for item in t.decode_inputs(sessions)])
    assert eager == [] and prefill.fallback.failures == 0 and len(prefill.captured) == len(prefill.shapes)


@pytest.mark.gpu
def test_executor_calls_run_on_the_backends_stream_without_cross_stream_waits(tiny, oracle, monkeypatch):
    """Guards against every staging, prefill and launch of a serving round bracketing itself with two
    cross-stream waits (an event made, recorded and waited on each way: ~10% of the serving thread's
    host time at 16-64 streams): an executor call runs on the backend's stream, so no wait is made during
    prefills, cycles and decode steps, and the outputs, greedy and sampled, equal the reference's."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from dflash_trt.runtime.backends.torch_backend import TorchBackend

    dims = tiny_dims(tiny.target, tiny.draft, tiny.dims.max_context, max_chunk=40)
    backend = TorchBackend(copy.deepcopy(tiny.target), copy.deepcopy(tiny.draft), dims, 4, device="cuda")
    executor = Executor(backend, dims, 4)
    waits = []
    wait_stream = torch.cuda.Stream.wait_stream
    monkeypatch.setattr(torch.cuda.Stream, "wait_stream", lambda self, other: (waits.append(other), wait_stream(self, other))[1])
    t = Tracker(executor, oracle)
    sessions = [t.open() for _ in range(3)] + [t.open(speculate=False)]
    t.set_sampling(sessions[1], SAMPLED)
    t.execute([(s, prompt(n, 40 + s), None, True, {"max_new_tokens": 12}) for s, n in zip(sessions, [5, 21, 9, 13])])
    t.execute([item + ({"max_new_tokens": 7},) for item in t.decode_inputs(sessions)])
    assert waits == []
    assert torch.cuda.current_stream() != backend.stream.torch  # the caller's stream is its own again


def test_start_up_prefill_warm_up_touches_no_session_row(tiny, oracle):
    """Guards against the start-up warm-up of batched prefill shapes (run so no kernel compiles while
    serving) writing anywhere but the scratch row: a session opened before it keeps its caches and its
    output."""
    dims = tiny_dims(tiny.target, tiny.draft, tiny.dims.max_context, max_chunk=40)
    executor = Executor(tiny.torch_backend(dims, 4, kernels="fast"), dims, 4)
    t = Tracker(executor, oracle)
    s = t.open()
    t.execute([(s, prompt(12, 7), None, True, {"max_new_tokens": 4})])
    backend = executor.backend
    before = {name: [x[: backend.max_sessions].clone() for x in pool.keys + pool.values] for name, pool in backend.pools.items()}
    assert len(executor.prefill.shapes) > 1
    for n, T in executor.prefill.shapes:
        executor.prefill.warm(n, T)
    for name, pool in backend.pools.items():
        for old, new in zip(before[name], pool.keys + pool.values):
            assert torch.equal(old, new[: backend.max_sessions]), name
    t.execute([item + ({"max_new_tokens": 6},) for item in t.decode_inputs([s])])  # still the reference's tokens


@pytest.mark.parametrize("backend", ["onnxruntime", "torch-fast"])
def test_an_execute_asked_to_yield_ends_after_one_round_and_loses_nothing(tiny, oracle, backend):
    """Guards against a server's waiting request sitting out a whole execute (up to max_cycles rounds) when
    the call was asked to end early, and against an early end that changes the tokens: each yielding call
    runs one round per lane (a prompt's prediction, then one launch) and the calls together return the
    reference continuation, exactly as one long call does."""
    executor, _ = new_executor(tiny, 4, backend)
    executor.max_cycles = 8
    text = prompt(11, 6)
    session = executor.open_session()
    asked = []

    def should_yield(finished: int) -> bool:
        asked.append(finished)
        return True

    tokens = executor.execute_outputs([Input(session, text, max_new_tokens=40)], should_yield=should_yield)[0].tokens
    assert asked and set(asked) == {0} and 2 <= len(tokens) <= 1 + executor.dims.block_size  # the prediction + one cycle's tokens
    calls = 1
    while len(tokens) < 40:
        out = executor.execute_outputs([Input(session, [tokens[-1]], max_new_tokens=40 - len(tokens))], should_yield=lambda finished: True)[0]
        assert 1 <= len(out.tokens) <= executor.dims.block_size  # one round: one cycle (or decode step)
        tokens += out.tokens
        calls += 1
    assert tokens == oracle.continuation(text)[:40]
    per_call = executor.execute_stats()["cycles"].to_list()
    assert len(per_call) == calls and max(per_call) == 1  # one launch per yielding call
    executor.clear_stats()
    other = executor.open_session()
    whole = executor.execute_outputs([Input(other, text, max_new_tokens=40)])[0].tokens
    assert whole == tokens[: len(whole)]
    assert executor.execute_stats()["cycles"].to_list()[0] > 1  # not asked to yield: the call runs several rounds


def test_early_join_cuts_a_large_batch_only_for_one_in_eight_sessions(tiny):
    """Guards against ending a large batch's execute for every request that arrives or finishes (at many
    sessions every execute would shrink to one round and pay its host work per round), against a lone
    queued request waiting for a large batch without bound, and against making a queued request wait
    when a small batch frees a session: the batcher asks for an early end once one in eight of its
    running requests' worth of queued requests could take sessions at the gap (at least one), or one
    could that waited JOIN_WAIT_S, never with no request waiting or no session to hand out."""
    from dflash_trt.runtime.serving.batcher import JOIN_WAIT_S, Batcher, Request

    executor = Executor(tiny.ort, tiny.dims, 12)
    full = Batcher(executor, 10)
    for key in range(10):
        full.join(key, Request(prompt(5, key), 8))
    assert full.room == 0
    assert [full.should_yield(2, finished) for finished in (0, 1, 2, 3)] == [False, False, True, True]  # ceil(10 / 8) = 2
    assert not full.should_yield(1, 3)  # one request waiting: below the share
    assert full.should_yield(1, 1, JOIN_WAIT_S) and not full.should_yield(1, 1, JOIN_WAIT_S / 2)  # ... until it waited
    assert not full.should_yield(1, 0, 10 * JOIN_WAIT_S)  # no session to hand it
    assert not full.should_yield(0, 10, 10 * JOIN_WAIT_S)  # nobody waiting
    full.close()
    small = Batcher(executor, 4)
    small.join("a", Request(prompt(5, 50), 8))
    small.join("b", Request(prompt(5, 51), 8))
    assert small.should_yield(1, 0) and not small.should_yield(0, 0)  # two sessions free
    small.join("c", Request(prompt(5, 52), 8))
    small.join("d", Request(prompt(5, 53), 8))
    assert not small.should_yield(1, 0) and small.should_yield(1, 1)  # full: one finishing request suffices
    small.close()


def test_a_changed_sampling_reaches_the_row_indexed_loop_between_executes(tiny, oracle):
    """Guards against the device loop's staged sampling going stale (``DeviceLoop.stage`` rebuilds a row's
    sampling columns only when its ``Sampling`` differs from the one staged there): a session switched from
    greedy to sampled (and to another seed) between executes, and a closed session's row taken by a new
    sampled session, go on exactly as the reference does with their new sampling."""
    executor, _ = new_executor(tiny, 4, "torch-fast")
    t = Tracker(executor, oracle)
    a, b = t.open(), t.open()
    t.execute([(a, prompt(9, 1), None, True), (b, prompt(7, 2), None, True)])
    t.execute(t.decode_inputs([a, b]))  # a's row staged greedy
    t.set_sampling(a, SAMPLED)
    t.execute(t.decode_inputs([a, b]))
    t.set_sampling(a, Sampling(temperature=1.1, top_k=7, seed=99))
    t.execute(t.decode_inputs([a, b]))
    row = executor.session(b).row
    t.close(b)
    c = t.open()
    assert executor.session(c).row == row  # the freed row, staged for b's greedy sampling
    t.set_sampling(c, Sampling(temperature=0.9, seed=5))
    t.execute([(c, prompt(6, 3), None, True)] + t.decode_inputs([a]))
    t.execute(t.decode_inputs([a, c]))


@pytest.mark.parametrize("backend", ["torch-fast", "onnxruntime", "torch-fast-lag2", pytest.param("torch-cuda", marks=pytest.mark.gpu)])
def test_requests_admitted_into_a_running_execute_decode_as_alone(tiny, oracle, backend):
    """Guards against a request that arrives while an execute runs having to wait for its end (a server's
    joining request: an execute boundary each time, the device idle through it), and against admission
    that changes any output: prompts admitted at later rounds (greedy and sampled, drafting and plain,
    two at once) return the reference's continuation, as do the running ones; their outputs follow the
    batch's in admission order, name the sessions opened for them and stream under those indices; a
    refused admission (a bad token, no session left) opens nothing, changes nothing and says why; the
    call ends within max_cycles rounds; the next call goes on from the admitted sessions' tokens.
    Row-bound backends prefill each admitted prompt alone, with the same outputs; with two launches
    queued per lane (lag 2) the admitted lanes join the running ones' rounds with the same outputs."""
    if backend == "torch-cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    executor, _ = new_executor(tiny, 5, backend)
    executor.max_cycles = 10
    assert executor.admits_cheaply == (backend != "onnxruntime")  # CUDA: captured prefill, staged rows, no host wait
    running = [executor.open_session() for _ in range(2)]
    prompts = [prompt(6 + 3 * i, 700 + i) for i in range(5)]  # the running two, then the admitted three
    samplings = [Sampling(), Sampling(), Sampling(), SAMPLED, Sampling()]
    waves = {2: [Admission(prompts[2], 30), Admission(prompts[3], 30, sampling=SAMPLED)],
             5: [Admission([5, 10**9], 30),  # bad token: refused
                 Admission(prompts[4], 30, speculate=False),
                 Admission(prompts[0], 30)]}  # the fifth session: none left
    asked, streamed = [0], {}

    def admit():
        asked[0] += 1
        return waves.get(asked[0], [])

    batch = [Input(s, prompts[i], max_new_tokens=60) for i, s in enumerate(running)]
    outputs = executor.execute_outputs(batch, lambda i, tokens, finish: streamed.setdefault(i, []).extend(tokens), admit=admit)
    order = [0, 1, 2, 3, None, 4, None]  # output -> prompt (None: refused)
    assert len(outputs) == len(order)
    assert isinstance(outputs[4].error, InputError) and "admit[4]" in str(outputs[4].error) and outputs[4].tokens == []
    assert isinstance(outputs[6].error, SessionError) and "admit[6]" in str(outputs[6].error) and outputs[6].session is None
    opened = [outputs[i].session for i in (2, 3, 5)]
    assert executor.sessions() == sorted(running + opened)  # the refused left nothing open
    assert not executor.session(opened[2]).speculate and executor.session(opened[1]).sampling == SAMPLED
    for i, p in enumerate(order):
        if p is None:
            continue
        got = outputs[i].tokens
        assert 1 <= len(got) and got == oracle.continuation(prompts[p], samplings[p])[: len(got)], (i, got)
        assert streamed[i] == got
    assert len(outputs[2].tokens) > 1 and len(outputs[5].tokens) > 1  # admitted lanes ran rounds in the call
    # A row per launch of a session, and one for its prompt's token (the plain session's decode steps are target rows too).
    launches = {s: n - 1 for s, n in executor.cycle_stats().group_by("session").len().iter_rows()}
    assert max(launches.values()) <= executor.max_cycles
    assert launches[opened[0]] <= executor.max_cycles - 1 and launches[opened[2]] <= executor.max_cycles - 2  # joined late
    assert executor.refused_calls().get("execute.admit") == 2
    sessions = running + opened
    nxt = executor.execute_outputs([Input(s, [outputs[i].tokens[-1]], max_new_tokens=12) for s, i in zip(sessions, (0, 1, 2, 3, 5))])
    for p, i, out in zip((0, 1, 2, 3, 4), (0, 1, 2, 3, 5), nxt):
        whole = outputs[i].tokens + out.tokens
        assert whole == oracle.continuation(prompts[p], samplings[p])[: len(whole)], (i, whole)


def test_a_failed_execute_closes_the_sessions_its_admissions_opened(tiny):
    """Guards against a failure after an admission leaking the session opened for it (the caller never
    learned its id, so nobody could close it: a cache row lost per failure): the call's own sessions
    are poisoned as ever, the admitted one is closed."""
    executor, recording = new_executor(tiny, 4, "torch-fast")
    executor.max_cycles = 10
    session = executor.open_session()
    admitted = iter([[], [Admission(prompt(7, 3), 20)]])
    recording.fail_on = (c.DRAFT, 4)  # after the admission (asked before the 2nd and 3rd launches)
    with pytest.raises(PoisonedError):
        executor.execute_outputs([Input(session, prompt(9, 2), max_new_tokens=40)], admit=lambda: next(admitted, []))
    assert executor.sessions() == [session] and executor.session(session).poisoned


def test_an_admitted_prompt_near_the_contexts_end_decodes_to_its_room(tiny, oracle):
    """Guards against an admitted drafting session without a block's room being charged the call's rounds
    before its first step (it returned only its prompt's prediction, however early it joined) and against
    such a session decoding one step per call: it gets the prediction and decode steps up to its
    max_new_tokens, the reference's, like the same prompt in a batch of its own."""
    executor, _ = new_executor(tiny, 4, "torch-fast")
    executor.max_cycles = 10
    B, L = executor.dims.block_size, executor.dims.max_context
    session = executor.open_session()
    near_end = prompt(L - B + 1, 31)  # frontier + B > max_context: no block fits
    admitted = iter([[], [Admission(near_end, 5)]])
    outputs = executor.execute_outputs([Input(session, prompt(9, 30), max_new_tokens=40)], admit=lambda: next(admitted, []))
    alone = executor.execute_outputs([Input(executor.open_session(), near_end, max_new_tokens=5)])[0].tokens
    assert len(alone) == 5 and outputs[1].tokens == alone == oracle.continuation(near_end)[:5], (outputs[1], alone)
