"""The device loop's glue in three Triton kernels: gather, the cycle's commit, the decode step's commit.

Around its graphs a program of ``runtime.device_loop`` reads its owners' state by slot and writes the
results back. As torch ops that is ~25 launches per cycle and ~20 per decode step (index_select,
index_copy_, copies, the verdict's seven ops, the sampling feeds' gathers); at the default pair's size a
launch inside a CUDA graph costs ~2-3 µs whatever it does, and a cycle is ~130 launches. Here:

- ``gather``: slots [n] -> anchor, start (the frontier), draft position and pending count [n]; for a cycle the
  owners' context taps [n, B, W]; for a sampled program the choice's feeds per choice row (owner i's row j
  chooses the token at start + 1 + j: ``export.graph_modules.VerifySample``'s rows);
- ``commit_cycle``: the verdict from the target's choices [n, k+1] (``export.sampling.verdict``: the longest
  prefix of proposals equal to the choices, then the choice after it), the record, the verify's taps into
  rows 0..k of the owners' context rows, draft position = start, frontier = start + accepted + 1, anchor;
- ``commit_decode``: the record, the tap into the owner's pending context row while one is free
  (``DeviceLoop._keep_tap``), frontier = start + 1, anchor.

Integers are copied and compared exactly and taps copied bit for bit, so the loop's state after a program
is the same as with its torch glue (``tests/loop_checks.py``, through Triton's interpreter on the CPU).
Padded lanes' slot is the scratch row (the last): they read it and write its context and record rows, never its
positions or anchor, so its frontier stays 0 and nothing resets it (the torch glue resets it after each round).
One program per owner (and per context row for the taps): every write has one writer, except the
scratch row's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_W = 512  # tap features per step of a row copy


@triton.jit
def _copy_row(src, dst, W, BLOCK: tl.constexpr):
    for w0 in range(0, W, BLOCK):
        w = w0 + tl.arange(0, BLOCK)
        tl.store(dst + w, tl.load(src + w, mask=w < W), mask=w < W)


# ``S`` (the state's row stride: the padded owner count, even) is not specialized on: one compiled kernel
# serves every owner bucket.
@triton.jit(do_not_specialize=["S"])
def _gather_kernel(
    slots, ints, R, floats, seeds, pool, W, context, state, S, temperature, top_k, top_p, seed, position,
    B: tl.constexpr, ROWS: tl.constexpr, ROWS_P2: tl.constexpr, BLOCK: tl.constexpr, CONTEXT: tl.constexpr, SAMPLED: tl.constexpr,
):
    """Program (i, b): owner i's context row b (CONTEXT); (i, 0) also its scalars and sampling feeds.
    ints [4, R] (anchor, frontier, draft, top_k), floats [2, R] (temperature, top_p), seeds [R, 3],
    pool [R, B, W]; state [4, n] int64 rows S apart (anchor, start, draft, start - draft)."""
    i = tl.program_id(0)
    b = tl.program_id(1)
    s = tl.load(slots + i)
    if CONTEXT:
        _copy_row(pool + (s * B + b) * W, context + (i * B + b) * W, W, BLOCK)
    if b == 0:
        start = tl.load(ints + R + s)
        draft = tl.load(ints + 2 * R + s)
        tl.store(state + i, tl.load(ints + s))
        tl.store(state + S + i, start)
        tl.store(state + 2 * S + i, draft)
        tl.store(state + 3 * S + i, start - draft)
        if SAMPLED:
            j = tl.arange(0, ROWS_P2)
            ok = j < ROWS
            at = i * ROWS + j
            zero = tl.zeros([ROWS_P2], dtype=tl.int64)
            tl.store(temperature + at, tl.load(floats + s) + zero.to(tl.float32), mask=ok)
            tl.store(top_p + at, tl.load(floats + R + s) + zero.to(tl.float32), mask=ok)
            tl.store(top_k + at, tl.load(ints + 3 * R + s) + zero, mask=ok)
            tl.store(position + at, start + 1 + j, mask=ok)
            for part in tl.static_range(3):
                tl.store(seed + at * 3 + part, tl.load(seeds + s * 3 + part) + zero, mask=ok)


@triton.jit(do_not_specialize=["S"])
def _commit_cycle_kernel(
    slots, scratch, ints, R, pool, W, taps, state, S, choices, choices_stride, proposals, proposals_stride, record, record_stride,
    K: tl.constexpr, P: tl.constexpr, K_P2: tl.constexpr, P_P2: tl.constexpr, B: tl.constexpr, BLOCK: tl.constexpr,
):
    """Program (i, j): verify tap row j of owner i into its context row; (i, 0) also the verdict, the record
    [accepted, token, d_1..d_P] and the owner's draft position, frontier and anchor."""
    i = tl.program_id(0)
    j = tl.program_id(1)
    s = tl.load(slots + i)
    _copy_row(taps + (i * (K + 1) + j) * W, pool + (s * B + j) * W, W, BLOCK)
    if j == 0:
        r = tl.arange(0, K_P2)
        mine = tl.load(proposals + i * proposals_stride + r, mask=r < K, other=0)
        chosen = tl.load(choices + i * choices_stride + r, mask=r < K, other=0)
        accepted = tl.min(tl.where((r < K) & (mine == chosen), K, r), axis=0)  # first mismatch, else K
        token = tl.load(choices + i * choices_stride + accepted)
        start = tl.load(state + S + i)
        p = tl.arange(0, P_P2)
        tl.store(record + i * record_stride + 2 + p, tl.load(proposals + i * proposals_stride + p, mask=p < P), mask=p < P)
        tl.store(record + i * record_stride, accepted.to(tl.int64))
        tl.store(record + i * record_stride + 1, token)
        if s != scratch:  # padded lanes leave the scratch row's positions at 0: no reset needed
            tl.store(ints + 2 * R + s, start)
            tl.store(ints + R + s, start + accepted + 1)
            tl.store(ints + s, token)


@triton.jit(do_not_specialize=["S"])
def _commit_decode_kernel(slots, scratch, ints, R, pool, W, taps, taps_stride, state, S, token, record, record_stride,
                          B: tl.constexpr, BLOCK: tl.constexpr):
    """Program i: owner i's tap, while its pending rows are not full, into pending row start - draft of its
    context; the record [0, token] and its frontier and anchor."""
    i = tl.program_id(0)
    s = tl.load(slots + i)
    start = tl.load(state + S + i)
    pending = tl.load(state + 3 * S + i)
    chosen = tl.load(token + i)
    if pending < B:
        _copy_row(taps + i * taps_stride, pool + (s * B + pending) * W, W, BLOCK)
    tl.store(record + i * record_stride, 0)
    tl.store(record + i * record_stride + 1, chosen)
    if s != scratch:
        tl.store(ints + R + s, start + 1)
        tl.store(ints + s, chosen)


class LoopOps:
    """The glue kernels over one loop's state: ``ints`` [4, R] int64, ``floats`` [2, R] float32,
    ``seeds`` [R, 3] int64, the context pool ``taps`` [R, B, W]."""

    FEEDS = ("temperature", "top_k", "top_p", "seed", "position")  # a sampled gather's feeds: ``choose_op``'s arguments after the logits

    def __init__(self, ints: torch.Tensor, floats: torch.Tensor, seeds: torch.Tensor, pool: torch.Tensor) -> None:
        for name, tensor in (("ints", ints), ("floats", floats), ("seeds", seeds), ("pool", pool)):
            if not tensor.is_contiguous():
                raise ValueError(f"LoopOps: {name} must be contiguous")
        self.ints, self.floats, self.seeds, self.pool = ints, floats, seeds, pool
        self.R, self.B, self.W = ints.shape[1], pool.shape[1], pool.shape[2]
        self.scratch = self.R - 1  # the padded lanes' row: the last

    def gather(self, slots: torch.Tensor, context: bool, sampled_rows: int) -> dict[str, torch.Tensor]:
        """state [4, n] int64 and its rows anchor, start, draft, pending [n]; ``context``: the owners' context taps [n, B, W];
        ``sampled_rows`` > 0: temperature, top_k, top_p, seed, position of each owner's rows (owner-major,
        [n * rows], seed [n * rows, 3])."""
        n, device = slots.shape[0], slots.device
        # Rows 16 bytes apart (an even stride): each row is a feed of the graphs, aligned as a fresh tensor is.
        state = torch.empty((4, n + n % 2), dtype=torch.int64, device=device)[:, :n]
        taps = torch.empty((n, self.B, self.W), dtype=self.pool.dtype, device=device) if context else state
        rows = max(sampled_rows, 1)
        feeds = {}
        if sampled_rows:
            feeds = {
                "temperature": torch.empty(n * rows, dtype=torch.float32, device=device),
                "top_k": torch.empty(n * rows, dtype=torch.int64, device=device),
                "top_p": torch.empty(n * rows, dtype=torch.float32, device=device),
                "seed": torch.empty((n * rows, 3), dtype=torch.int64, device=device),
                "position": torch.empty(n * rows, dtype=torch.int64, device=device),
            }
        out = [feeds.get(name, state) for name in self.FEEDS]
        _gather_kernel[(n, self.B if context else 1)](
            slots, self.ints, self.R, self.floats, self.seeds, self.pool, self.W, taps, state, state.stride(0), *out,
            B=self.B, ROWS=rows, ROWS_P2=triton.next_power_of_2(rows), BLOCK=BLOCK_W, CONTEXT=context, SAMPLED=bool(sampled_rows),
        )
        names = ("anchor", "start", "draft", "pending")
        return {"state": state} | dict(zip(names, state)) | ({"context": taps} if context else {}) | feeds

    def commit_cycle(self, slots, state, taps, choices, proposals, record) -> None:
        """state: ``gather``'s [4, n]; taps [n, k+1, W] (contiguous), choices [n, k+1], proposals [n, P], record [n, P+2] (int64)."""
        n, rows = choices.shape
        P = proposals.shape[1]
        for name, tensor in (("choices", choices), ("proposals", proposals), ("record", record)):
            if tensor.stride(1) != 1:
                raise ValueError(f"commit_cycle: {name}'s rows must be adjacent values, got strides {tensor.stride()}")
        taps = taps.contiguous()  # a view of the verify's output: no copy
        _commit_cycle_kernel[(n, rows)](
            slots, self.scratch, self.ints, self.R, self.pool, self.W, taps, state, state.stride(0),
            choices, choices.stride(0), proposals, proposals.stride(0), record, record.stride(0),
            K=rows - 1, P=P, K_P2=triton.next_power_of_2(rows), P_P2=triton.next_power_of_2(P), B=self.B, BLOCK=BLOCK_W,
        )

    def commit_decode(self, slots, state, taps, token, record) -> None:
        """state: ``gather``'s [4, n]; taps [n, W] (rows contiguous), token [n], record [n, P+2] (int64)."""
        n = token.shape[0]
        if taps.stride(1) != 1:
            raise ValueError(f"commit_decode: a tap row's features must be adjacent, got strides {taps.stride()}")
        _commit_decode_kernel[(n,)](
            slots, self.scratch, self.ints, self.R, self.pool, self.W, taps, taps.stride(0), state, state.stride(0), token, record,
            record.stride(0), B=self.B, BLOCK=BLOCK_W,
        )
