"""Checks of the device loop's Triton glue (``runtime/kernels/loop_ops.py``) against its torch glue.

Imported by tests/runtime/test_loop_glue.py: on CUDA (gpu tests) and, through Triton's interpreter
(``TRITON_INTERPRET=1``, set before import), on CPU tensors. The reference is the loop's own torch glue
(``DeviceLoop(glue="torch")``): index_select / index_copy_ and ``export.sampling.verdict`` over the
same graphs.

- ``check_programs``: every program kind (a cycle at each verify length, a decode step; greedy and
  sampled; padded owner counts; two rounds per launch) from one random state, through both glues: the
  records, the loop's int state, the context pool and the backend's caches, bit for bit
  (the scratch row aside: padded lanes' writes land there, in an order no one reads);
- ``check_verdict``: ``commit_cycle``'s verdict against ``export.sampling.verdict`` on choices drawn from two
  tokens (every prefix length, all accepted included) at every verify length, with its record and state;
- ``check_executor``: the default pair through ``Executor``, DFlash and plain decoding, greedy and sampled,
  more requests than sessions: every request's tokens are the same with either glue.
"""

from __future__ import annotations

import numpy as np
import torch

from dflash_trt.export.pair import DEFAULT_PAIR_DIR, load_pair
from dflash_trt.export.sampling import Sampling
from dflash_trt.runtime.backends.torch_backend import TorchBackend
from dflash_trt.runtime.device_loop import CYCLE, DECODE, DeviceLoop
from dflash_trt.runtime.sessions import ContextPool

SESSIONS = 4
MAX_CONTEXT = 256


def _backend(device: str, sessions: int = SESSIONS) -> TorchBackend:
    """The default pair, fp32, on the torch backend's row-indexed path (``kernels="fast"``: its pure-torch twin
    on the CPU, Triton on CUDA): the graphs the glue runs around."""
    from dflash_trt.export.exporter import ExportOptions, contract_dims

    target, draft = load_pair(DEFAULT_PAIR_DIR / "target", DEFAULT_PAIR_DIR / "draft", dtype=torch.float32)
    options = ExportOptions(max_owners=sessions, max_context=MAX_CONTEXT, max_chunk=64, proposals=draft.config.block_size - 1, dtype="fp32")
    dims = contract_dims(target, draft, options)
    return TorchBackend(target, draft, dims, sessions, device=device, kernels="fast")


def _state(backend: TorchBackend, generator: torch.Generator) -> dict:
    """A random state of every row: anchors, frontiers, pending counts 0..B (full included), sampling, context
    taps and caches (random values: the glue moves them, it never reads their meaning)."""
    dims, rows = backend.dims, SESSIONS
    B = dims.block_size
    pending = torch.randint(0, B + 1, (rows,), generator=generator)
    pending[0], pending[1] = 0, B  # an owner that does not draft, one whose pending rows are full
    frontiers = torch.randint(B + 2, MAX_CONTEXT - 3 * B, (rows,), generator=generator)
    samplings = [Sampling(0.0), Sampling(0.8, 5, 0.9, 7), Sampling(1.0, 0, 0.7, 11), Sampling(1.3, 40, 1.0, 3)]
    return {
        "anchors": torch.randint(0, dims.vocab_size, (rows,), generator=generator).tolist(),
        "frontiers": frontiers.tolist(),
        "drafts": (frontiers - pending).tolist(),
        "samplings": samplings,
        "taps": torch.randn((rows + 1, B, dims.tap_width), generator=generator),
        "caches": [torch.randn(t.shape, generator=generator) for pool in backend.pools.values() for t in pool.keys + pool.values],
    }


def _caches(backend: TorchBackend) -> list[torch.Tensor]:
    return [t for pool in backend.pools.values() for t in pool.keys + pool.values]


def _run(backend, glue: str, state: dict, kind: str, sampled: bool, rows: list[int], proposals: int, rounds: int) -> dict:
    """One launch from ``state`` through a fresh loop with ``glue``: what it leaves, off the scratch row."""
    device, dims = backend.device, backend.dims
    for cache, value in zip(_caches(backend), state["caches"]):
        cache.copy_(value.to(device))
    context = ContextPool(SESSIONS + 1, dims.block_size, dims.tap_width, torch.float32, device)
    context.taps.copy_(state["taps"].to(device))
    loop = DeviceLoop(backend, dims, context, SESSIONS, graphs=False, rounds=rounds, glue=glue)
    with loop.running():
        everyone = list(range(SESSIONS))
        loop.stage(everyone, state["anchors"], state["frontiers"], state["drafts"], state["samplings"])
        records, _ = loop.read(loop.launch(kind, sampled, rows, proposals, rounds))
    backend.synchronize()
    live = slice(0, SESSIONS)  # the scratch row (last) aside
    if glue == "triton" and len(rows) < 4:  # padded lanes never move the scratch row (nothing resets it)
        assert int(loop.ints.device[1, SESSIONS]) == 0 and int(loop.ints.device[2, SESSIONS]) == 0, loop.ints.device[:, SESSIONS]
    left = {
        "records": torch.from_numpy(np.ascontiguousarray(records)),
        "ints": loop.ints.device[:, live].cpu(),
        "context": context.taps[live].cpu(),
        "caches": [t[live].cpu() for t in _caches(backend)],
    }
    loop.close()
    return left


def _same(got, want, what: str) -> None:
    if isinstance(want, list):
        for i, (g, w) in enumerate(zip(got, want)):
            _same(g, w, f"{what}[{i}]")
        return
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape)
    bits = {torch.float32: torch.int32, torch.int64: torch.int64}[got.dtype]
    differ = got.view(bits) != want.view(bits)
    assert not bool(differ.any()), f"{what}: {int(differ.sum())} of {differ.numel()} values differ, first at {differ.nonzero()[:3].tolist()}"


def check_programs(device: str) -> None:
    backend = _backend(device)
    try:
        generator = torch.Generator().manual_seed(0)
        state = _state(backend, generator)
        dims = backend.dims
        cases = [(CYCLE, k) for k in dims.verify_proposals] + [(DECODE, 0)]
        for kind, proposals in cases:
            for sampled in (False, True):
                for rows, rounds in (([2, 0, 3], 1), ([1], 2), ([3, 1, 0, 2], 1)):  # three owners padded to 4, one owner for two rounds, all four
                    case = f"{kind} k={proposals} sampled={sampled} rows={rows} rounds={rounds}"
                    want = _run(backend, "torch", state, kind, sampled, rows, proposals, rounds)
                    got = _run(backend, "triton", state, kind, sampled, rows, proposals, rounds)
                    for name in want:
                        _same(got[name], want[name], f"{case}: {name}")
    finally:
        backend.close()


def check_verdict(device: str) -> None:
    from dflash_trt.export.sampling import verdict
    from dflash_trt.runtime.kernels.loop_ops import LoopOps

    generator = torch.Generator().manual_seed(1)
    R, B, W, P = 9, 16, 8, 15  # owners: every row but the last (the scratch row), in a random order
    for k in (1, 3, 7, 15):
        ints = torch.randint(0, 1000, (4, R), generator=generator).to(device)
        pool = torch.randn((R, B, W), generator=generator).to(device)
        ops = LoopOps(ints, torch.rand((2, R)).to(device), torch.zeros((R, 3), dtype=torch.int64, device=device), pool)
        slots = torch.randperm(R - 1, generator=generator).to(device)
        owners = R - 1
        proposals = torch.randint(0, 2, (owners, P), generator=generator).to(device)
        choices = torch.randint(0, 2, (owners, k + 1), generator=generator).to(device)
        choices[0, :k] = proposals[0, :k]  # all k accepted: the bonus token is the last choice
        choices[1, 0] = 1 - proposals[1, 0]  # none accepted
        before = ints.clone()
        for n in (1, 3):  # the state's rows are graph feeds: each 16-byte aligned, as a fresh tensor (one kernel variant)
            rows = ops.gather(slots[:n], context=False, sampled_rows=0)
            assert all(rows[name].data_ptr() % 16 == 0 for name in ("anchor", "start", "draft", "pending")), n
        got = ops.gather(slots, context=False, sampled_rows=0)
        taps = torch.randn((owners, k + 1, W), generator=generator).to(device)
        record = torch.full((owners, P + 2), -1, dtype=torch.int64, device=device)
        ops.commit_cycle(slots, got["state"], taps, choices, proposals, record)
        accepted, token = verdict(proposals[:, :k], choices)
        assert accepted[0] == k and accepted[1] == 0
        _same(record[:, 0].cpu(), accepted.cpu(), f"k={k} accepted")
        _same(record[:, 1].cpu(), token.cpu(), f"k={k} next token")
        _same(record[:, 2:].cpu(), proposals.cpu(), f"k={k} proposals")
        start = before[1, slots]
        _same(ints[0, slots].cpu(), token.cpu(), f"k={k} anchor")
        _same(ints[1, slots].cpu(), (start + accepted + 1).cpu(), f"k={k} frontier")
        _same(ints[2, slots].cpu(), start.cpu(), f"k={k} draft position")
        _same(pool[slots, : k + 1].cpu(), taps.cpu(), f"k={k} context rows")


def check_executor(device: str) -> None:
    import json

    from dflash_trt.export.tokenizer import Tokenizer
    from dflash_trt.runtime.executor import Executor
    from dflash_trt.runtime.generate import stream
    from dflash_trt.runtime.serving.batcher import Request

    backend = _backend(device, sessions=3)
    try:
        tokenizer = Tokenizer.from_dir(DEFAULT_PAIR_DIR / "target")
        lines = (DEFAULT_PAIR_DIR / "prompts.jsonl").read_text().splitlines()
        prompts = [tokenizer.encode(json.loads(line)["prompt"])[-48:] for line in lines[:5]]
        accepted = 0
        for temperature in (0.0, 1.0):
            requests = [Request(p, 24, tuple(tokenizer.stop_ids), Sampling(temperature, 0, 1.0, i)) for i, p in enumerate(prompts)]
            for speculate in (True, False):
                outputs = {}
                for glue in ("torch", "triton"):
                    with Executor(backend, max_sessions=3, speculate=speculate, policy="always", loop_glue=glue) as executor:
                        tokens = [[] for _ in requests]
                        for chunk in stream(executor, requests, 3):
                            tokens[chunk.index] += chunk.tokens
                        outputs[glue] = tokens
                        if speculate and glue == "triton":
                            accepted += sum(executor.log.cycles.columns["accepted"])
                assert outputs["triton"] == outputs["torch"], (temperature, speculate)
        assert accepted > 0, "no proposal was ever accepted: the verdict's accepting path went unchecked"
    finally:
        backend.close()
