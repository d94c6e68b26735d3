"""The price of exactness: the torch backend's "exact" kernels against its "fast" ones at the Qwen3-8B shape.

    python benchmarks/exact_kernels.py              # ~2 min on an H200
    python benchmarks/exact_kernels.py --sweep      # + the exact linear's tile sweep (exact_sweep.py), whose
                                                    #   winners then run the timings; ~5 min
    python benchmarks/exact_kernels.py --sections gemm   # the graph rows and one kernel section only
    python benchmarks/exact_kernels.py --pdl on      # every kernel's start overlapping its predecessor's end
    bash benchmarks/run_exact_sweep.sh              # the sweep run, then the gpu tests (one device call, <= 8 min)

Builds gpu_graphs.py's random bf16 pair on the device (target 36 layers, hidden 4096, 32/8 heads x 128,
FFN 12288, vocab 151936; draft 5 layers, block 16), then, for kernels = "fast" and "exact" (one
``TorchBackend`` each over the same weights, max_context 4096, context 2048):

- the AR step (``target_prefill`` at T = 1, one CUDA graph), ``target_verify_n``, ``draft_n`` and the
  cycle (draft -> verify -> verify_argmax -> verdict on the host) for n = 1 and 4 (gpu_graphs' rows);
- each GEMM of the step alone over the 36 layers' own weights (CUDA graph) at M = 1, 16 and 64;
- attention per layer at T = 1 / 16, n = 1 / 4 (``--contexts``: at each; what is fixed per launch and what
  grows with the keys); the exact one with its splits folded by a second launch or
  in the attention launch (``combine_in_kernel``), and whether both give the same bits; at tile heights
  (``block_q``) of 16, 32 and 64; at split windows and inner steps (``SPLITS``; ``--split-slots`` and
  ``--attention-block-n`` set the exact backend's own); with 1, 2, 4 and 8 warps per program (``warps``); with
  2, 3 and 4 loads in flight (``stages``), and whether those give the same bits;
- exactness at this shape: the verify rows of owner 0 (n = 1 and n = 4) against the AR step run at the
  same positions on the same cache: how many of the 16 rows have the same logits bits, the same argmax;
- ``profile``: each graph's kernels under torch.profiler: the per-layer block's kernels (µs each), what runs
  outside it, and the gaps between kernels (the graph's device time less its kernels' sum).

Prints a table and ends with one JSON line; rows are appended to ``--results`` (default
benchmarks/results.jsonl: the graph rows, then a row per section with its rows or its failure) and the whole
report is written to ``$OUT/exact_kernels.json`` when ``OUT`` is set;
with ``--sweep``, the chosen tilings also to ``$OUT/exact_tiles.json`` (and printed as ``plan.EXACT_TILES``
lines) as soon as the sweep ends. A failing section is recorded and the run goes on.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import exact_sweep  # noqa: E402  (the exact linear's tile sweep)
import gpu_graphs as gg  # noqa: E402  (the pair, feeds, AR step, cycle and timing helpers)

CONTEXT, MAX_CONTEXT, OWNER_COUNTS, ROWS = 2048, 4096, (1, 4), (1, 16, 64)
DRAFT_LABELS = {"model": "exact", "fp8": "exact_fp8_draft"}  # an exact backend's graph rows, by its draft's weights
WIDE_LABEL = "exact_wide"  # graph rows of ExactOps(wide_tiles=True) (--wide-tiles)
GRAPH_LABELS = ("fast", *DRAFT_LABELS.values(), WIDE_LABEL)  # every backend's graph rows, in the summary's order
SECTIONS = ("gemm", "attention", "combine", "tile", "split", "warps", "stages", "profile")  # the kernel sections after the graph rows


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--results", type=Path, default=gg.ROOT / "benchmarks" / "results.jsonl")
    parser.add_argument("--sweep", action="store_true", help="sweep the exact tilings per weight; the best run the timings")
    parser.add_argument("--sweep-seconds", type=float, default=240.0, help="the sweep stops measuring after this long")
    parser.add_argument("--split-slots", type=int, default=None, help="the exact attention's split window (ExactOps' default without)")
    parser.add_argument("--attention-block-n", type=int, default=None, help="the exact attention's inner step (ExactOps' default without)")
    parser.add_argument("--attention-stages", type=int, default=None, help="the exact attention's loads in flight (ExactOps' default without)")
    parser.add_argument("--pdl", choices=("auto", "off", "on"), default="auto",
                        help="programmatic dependent launch (auto: the ops' default: on where capable unless DFLASH_TRT_PDL=0)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[CONTEXT], help="the attention section's contexts (default 2048)")
    parser.add_argument("--draft-weights", choices=("model", "fp8"), nargs="+", default=["model"],
                        help="the exact backend's draft weights; each after the first adds a backend's graph rows (label exact_fp8_draft)")
    parser.add_argument("--wide-tiles", action="store_true",
                        help=f"also the exact kernels with one 64-row tile where four 16-row tiles run (ExactOps(wide_tiles=True)): graph rows and exactness, label {WIDE_LABEL}")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {','.join(SECTIONS)} (the graph rows always run)")
    args = parser.parse_args()
    unknown = set(args.sections.split(",")) - set(SECTIONS)
    if unknown:
        parser.error(f"--sections: {sorted(unknown)} not among {list(SECTIONS)}")
    return args


# ---------------------------------------------------------------------- sections


def gemm_times(backends: dict, reps: int) -> list[dict]:
    """µs per call of each GEMM (with its fused epilogue) over the 36 layers' own weights, per kernels and M."""
    import torch

    results = []
    stream = torch.cuda.Stream()
    for label, backend in backends.items():
        target = backend.modules["target_verify_1"].target
        weights = exact_sweep.weights_of(target)
        for name, (N, K, gated, *_) in gg.GEMMS.items():
            for M in ROWS:
                x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
                norm = torch.ones(K, dtype=torch.bfloat16, device="cuda") + 0.1
                residual = torch.randn(M, N, device="cuda").to(torch.bfloat16)
                calls = lambda: [gg._gemm_call(target.ops, name, x, w, norm, residual) for w in weights[name]]  # noqa: E731
                us = gg.graph_time(stream, calls, reps) / len(weights[name]) * 1e3
                moved = weights[name][0].numel() * 2
                results.append({"kernels": label, "gemm": name, "rows": M, "us": round(us, 2), "tbps": round(moved / us / 1e6, 3)})
                print(f"  {label:5s} {name:8s} M={M:3d}: {us:8.1f} us ({moved / us / 1e6:.2f} TB/s of weights)", flush=True)
    return results


def combine_times(backend, reps: int) -> list[dict]:
    """The exact attention over the 36 layers' caches (context 2048) with its splits folded by a second launch or
    by each unit's last split (``combine_in_kernel``): µs per layer, and whether both give the same bits."""
    from dflash_trt.runtime.kernels.exact_ops import ExactOps

    variants = {"second launch": ExactOps(combine_in_kernel=False), "in kernel": ExactOps(combine_in_kernel=True)}
    return attention_variant_times(backend, reps, "combine", variants, compare=True)


def tile_times(backend, reps: int) -> list[dict]:
    """The exact attention at tile heights (``block_q``: query rows sharing one tile's key loads) of 16, 32 and 64:
    µs per layer (each height is its own exact kernel: their bits may differ from each other)."""
    from dflash_trt.runtime.kernels.exact_ops import ExactOps

    variants = {f"block_q {b}": ExactOps(block_q=b) for b in (16, 32, 64)}
    return attention_variant_times(backend, reps, "tile", variants, compare=False)


SPLITS = ((256, 64), (512, 64), (1024, 64), (128, 64), (128, 128), (64, 64))  # (split window, inner step) of the split section


def split_times(backend, reps: int) -> list[dict]:
    """The exact attention at split windows (``split_slots``) and inner steps (``block_n``) of ``SPLITS``: µs per
    layer (each pair is its own exact kernel: their bits may differ from each other). At one query the splits
    are the launch's only parallelism (8 kv heads x 8 splits of 256 at context 2048: 64 programs)."""
    from dflash_trt.runtime.kernels.exact_ops import ExactOps

    variants = {f"split {w} step {b}": ExactOps(split_slots=w, block_n=b) for w, b in SPLITS}
    return attention_variant_times(backend, reps, "split", variants, compare=False)


def warps_times(backend, reps: int) -> list[dict]:
    """The exact attention with 1, 2, 4 and 8 warps per program (``attention_warps``): µs per layer (each count is
    its own exact kernel: the warps share a tile's score rows, so their bits may differ from each other)."""
    from dflash_trt.runtime.kernels.exact_ops import ExactOps

    variants = {f"warps {w}": ExactOps(attention_warps=w) for w in (1, 2, 4, 8)}
    return attention_variant_times(backend, reps, "warps", variants, compare=False)


def stages_times(backend, reps: int) -> list[dict]:
    """The exact attention with 2, 3 and 4 key / value loads in flight per program (``attention_stages``, uncapped
    registers) and as the product launches it (``plan.exact_attention_launch``: a crowded launch at two steps and 128
    registers): µs per layer, and whether all give the same bits (they should: the depth and the cap move loads and
    registers, not sums)."""
    from dflash_trt.runtime.kernels.exact_ops import ExactOps

    variants = {"product": ExactOps()} | {f"stages {s}": ExactOps(attention_stages=s) for s in (2, 3, 4)}
    return attention_variant_times(backend, reps, "stages", variants, compare=True)


def attention_variant_times(backend, reps: int, field: str, variants: dict, compare: bool) -> list[dict]:
    """µs per layer of each variant's exact attention over the 36 layers' caches at T = 1 / 16 and n = 1 / 4 (CUDA
    graph); ``compare``: whether the variants give the same bits (on layer 0's cache)."""
    import torch

    results, stream, pool = [], backend.stream.torch, backend.pools["target"]
    for tokens, owners in ((1, 1), (1, 4), (gg.BLOCK, 1), (gg.BLOCK, 4)):
        keys, values = pool.rows(0, owners)
        q = torch.randn(owners, tokens, 32, 128, device="cuda").to(torch.bfloat16).transpose(1, 2)
        start = torch.full((owners,), CONTEXT, device="cuda")
        positions, kv_len = start[:, None] + torch.arange(tokens, device="cuda"), start + tokens
        outputs = {}
        for label, ops in variants.items():
            call = lambda: [ops.attention(q, k, v, None, positions, kv_len, True, 0) for k, v in zip(keys, values)]  # noqa: E731
            us = gg.graph_time(stream, call, reps) / len(keys) * 1e3
            with torch.cuda.stream(stream):
                outputs[label] = ops.attention(q, keys[0], values[0], None, positions, kv_len, True, 0)
            stream.synchronize()
            results.append({field: label, "tokens": tokens, "owners": owners, "us_per_layer": round(us, 2)})
            print(f"  exact attention, {field} {label:13s} T={tokens:2d} n={owners}: {us:6.1f} us/layer", flush=True)
        if compare:
            same = all(torch.equal(o.view(torch.int16), outputs[label].view(torch.int16)) for o in outputs.values())
            results[-1]["same_bits"] = same
            print(f"    same bits: {same}", flush=True)
    return results


def profile_times(backends: dict, dims, reps: int) -> list[dict]:
    """Where each graph's device time goes, per kernels: the AR step, ``target_verify_n`` and ``draft_n`` (n = 1, 4)
    replayed as CUDA graphs under torch.profiler. Per graph: its kernels per replay, their summed µs, the graph's own
    device µs (CUDA events around the call) and the difference (the gaps between kernels; for ``backend.run`` also
    its host work between the first event and the replay), and the repeated per-layer block (found from the kernel
    names' period) with each slot's median µs over layers and replays."""
    import torch

    from dflash_trt.export import contract as c

    results = []
    for label, backend in backends.items():
        stream = backend.stream.torch
        ar = gg.ArStep(backend, gg.Feeds(dims, 1, CONTEXT))
        ar.at(CONTEXT)
        calls = {"ar_step": ar}
        for n in OWNER_COUNTS:
            feeds = gg.Feeds(dims, n, CONTEXT, seed=n)
            calls[f"verify_{n}"] = lambda n=n, feeds=feeds: backend.run(c.graph_name(c.TARGET_VERIFY, n), feeds.verify, 0)
            calls[f"draft_{n}"] = lambda n=n, feeds=feeds: backend.run(c.graph_name(c.DRAFT, n), feeds.draft, 0)
        with torch.cuda.stream(stream):
            for graph, call in calls.items():
                device_ms, _ = gg.time_calls(stream, call, reps)
                names, medians = _kernel_sequence(call, stream, reps)
                results.append(_profile_row(label, graph, device_ms, names, medians))
                print(_format_profile(results[-1]), flush=True)
    return results


def _kernel_sequence(call, stream, reps: int) -> tuple[list[str], list[float]]:
    """The device activities of one call in order (names) and each one's median µs over ``reps`` calls."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            call()
            stream.synchronize()
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda e: e.time_range.start)
    per = len(events) // reps
    if per == 0 or per * reps != len(events):
        raise RuntimeError(f"{len(events)} device activities over {reps} replays: not one sequence per replay")
    names = [e.name for e in events[:per]]
    durations = [[events[r * per + i].time_range.elapsed_us() for r in range(reps)] for i in range(per)]
    return names, [statistics.median(d) for d in durations]


def layer_block(names: list[str], least: int = 4) -> tuple[int, int, int]:
    """(start, length, repeats) of the block of names repeated back to back at least ``least`` times that covers
    the most names, starting among the first 64 (a draft's layers follow its context projections).

    >>> layer_block(["embed"] + ["norm", "linear", "attention"] * 5 + ["head"])
    (1, 3, 5)
    """
    best = (0, 0, 0)
    for start in range(min(64, len(names))):
        for length in range(1, 48):
            repeats = 1
            while names[start + repeats * length : start + (repeats + 1) * length] == names[start : start + length] \
                    and start + (repeats + 1) * length <= len(names):
                repeats += 1
            if repeats >= least and repeats * length > best[1] * best[2]:
                best = (start, length, repeats)
    return best


def _profile_row(label: str, graph: str, device_ms: float, names: list[str], medians: list[float]) -> dict:
    start, length, repeats = layer_block(names)
    block = [
        {"kernel": names[start + i][:60], "us": round(statistics.median(medians[start + r * length + i] for r in range(repeats)), 2)}
        for i in range(length)
    ]
    outside = [(n[:60], round(m, 2)) for k, (n, m) in enumerate(zip(names, medians)) if not start <= k < start + repeats * length]
    kernel_us = sum(medians)
    return {
        "kernels": label, "graph": graph, "device_us": round(device_ms * 1e3, 1), "kernel_us": round(kernel_us, 1),
        "gap_us": round(device_ms * 1e3 - kernel_us, 1), "activities": len(names), "layers": repeats, "block": block,
        "block_us": round(sum(b["us"] for b in block), 2), "outside": outside,
    }


def _format_profile(r: dict) -> str:
    block = ", ".join(f"{b['kernel'].lstrip('_')[:22]} {b['us']:.1f}" for b in r["block"])
    outside = ", ".join(f"{n.lstrip('_')[:22]} {u:.1f}" for n, u in r["outside"])
    return (f"  {r['kernels']:5s} {r['graph']:9s}: graph {r['device_us']:7.1f} us, kernels {r['kernel_us']:7.1f} "
            f"({r['activities']}), gaps {r['gap_us']:6.1f}; {r['layers']} x [{block}] = {r['block_us']:.1f} per layer; "
            f"else [{outside}]")


def exactness(backend, dims) -> dict:
    """Owner 0's 16 verify rows (in a launch of n owners) against the AR step at the same 16 positions.

    The verify writes K/V at slots 2048..2063 of row 0; each AR step rewrites its own slot first, so both
    read the same cache when the kernels are exact. Counts rows with bit-identical logits and equal argmax.
    """
    import torch

    from dflash_trt.export import contract as c

    result = {}
    ar = gg.ArStep(backend, gg.Feeds(dims, 1, CONTEXT))
    for n in OWNER_COUNTS:
        gg.fill_pools(backend)
        feeds = gg.Feeds(dims, n, CONTEXT, seed=50)
        tokens = feeds.verify[c.TOKENS]
        with torch.cuda.stream(backend.stream.torch):
            verify = backend.run(c.graph_name(c.TARGET_VERIFY, n), feeds.verify, 0)[c.LOGITS][0].clone()  # [16, V]
            same = argmax = 0
            for t in range(tokens.shape[1]):
                ar.tokens.fill_(int(tokens[0, t]))
                ar.at(CONTEXT + t)
                ar()
                logits = ar.outputs[0][0]  # [V]
                same += bool(torch.equal(logits.view(torch.int32), verify[t].view(torch.int32)))
                argmax += int(logits.argmax()) == int(verify[t].argmax())
            backend.synchronize()
        result[f"n{n}"] = {"rows": tokens.shape[1], "identical_logits": same, "same_argmax": argmax}
        print(f"  verify_{n} owner 0 vs AR step: {same}/{tokens.shape[1]} rows bit-identical, {argmax} same argmax", flush=True)
    return result


# ---------------------------------------------------------------------- main


def table(data: dict) -> str:
    by = {(r["kernels"], r["owners"]): r for r in data.get("graph_rows") or []}
    lines = ["| kernels | owners | AR step ms | verify ms | draft ms | cycle ms (wall) | cycle / AR |", "|" + " --- |" * 7]
    for (label, n), r in sorted(by.items()):
        lines.append(f"| {label} | {n} | {r['ar_step_ms']} | {r['verify_ms']} | {r['draft_ms']} | {r['cycle_ms']} | {r['cycle_cost_ratio']} |")
    gemms = {(r["gemm"], r["rows"], r["kernels"]): r["us"] for r in data.get("gemm_us") or []}
    if gemms:
        lines += ["", "| GEMM | M | fast µs | exact µs |", "| --- | --- | --- | --- |"]
        for name in gg.GEMMS:
            for M in ROWS:
                lines.append(f"| {name} | {M} | {gemms.get((name, M, 'fast'))} | {gemms.get((name, M, 'exact'))} |")
    return "\n".join(lines)


def summary(data: dict) -> dict:
    by = {(r["kernels"], r["owners"]): r for r in data.get("graph_rows") or []}
    out = {}
    for label in GRAPH_LABELS:
        if (label, 1) in by:
            out[f"{label}_ar_step_ms"] = by[(label, 1)]["ar_step_ms"]
            out[f"{label}_ar_roofline_fraction"] = by[(label, 1)]["ar_roofline_fraction"]
        for n in OWNER_COUNTS:
            if (label, n) in by:
                out[f"{label}_cycle_cost_ratio_n{n}"] = by[(label, n)]["cycle_cost_ratio"]
    if data.get("exact_tiles"):
        out["exact_tiles"] = data["exact_tiles"]
    for label in GRAPH_LABELS:
        if data.get(f"{label}_exactness"):
            out[f"{label}_identical_rows"] = {k: v["identical_logits"] for k, v in data[f"{label}_exactness"].items()}
    return out


def measure(report, label: str, kernels, target, draft, dims, reps: int, draft_weights: str = "model"):
    """One backend: its graph rows, its exactness rows; returns it (open) for the GEMM section."""
    from dflash_trt.runtime.backends import TorchBackend

    backend = TorchBackend(target, draft, dims, max(OWNER_COUNTS), device="cuda", kernels=kernels, draft_weights=draft_weights)
    gg.fill_pools(backend)
    ar = report.section(f"{label}_ar_capture", lambda: gg.ArStep(backend, gg.Feeds(dims, 1, CONTEXT)), keep=False)
    rows = report.section(f"{label}_rows", lambda: gg.graph_rows(backend, dims, [CONTEXT], OWNER_COUNTS, reps, label, ar))
    report.data.setdefault("graph_rows", []).extend(rows or [])
    report.section(f"{label}_exactness", lambda: exactness(backend, dims))
    return backend


def run_sweep(report, fast_backend, args, out_dir, attention: dict):
    """The sweep (exact_sweep.py) over the fast backend's weights; its table saved at once; an ExactOps using it."""
    import torch

    from dflash_trt.runtime.kernels.exact_ops import ExactOps

    rows, best, errors = exact_sweep.sweep(fast_backend.modules["target_verify_1"].target, args.reps, args.sweep_seconds)
    processors = torch.cuda.get_device_properties(0).multi_processor_count
    tiles = exact_sweep.table(best, processors)
    report.data |= {"sweep": rows, "sweep_errors": errors, "exact_tiles": tiles}
    if out_dir is not None:
        (out_dir / "exact_tiles.json").write_text(json.dumps({"machine": report.data["machine"], "table": tiles}, indent=1))
    print("plan.EXACT_TILES lines (fields: block_n, block_n_rows, block_k, warps, splits, stages, fixup, tiles):")
    print(exact_sweep.python_table(best, processors), flush=True)
    return ExactOps(linear_plans=best, **attention)


def result_rows(data: dict, sections: list[str], stamp: dict) -> list[dict]:
    """The run's results.jsonl rows: one per graph row (``exact_kernels``), then one per section asked for
    (``exact_kernels_<section>``: its rows under ``rows``, or the end of its traceback under ``failure``), each
    with ``stamp`` (date, machine, command, pdl); tests/runtime/test_exact_kernels.py runs it on a ``Report``."""
    rows = [{"name": "exact_kernels", **stamp, **r} for r in data.get("graph_rows") or []]
    failures = data.get("failures") or {}
    for name in sections:
        key = f"{name}_us"
        if key in failures:
            rows.append({"name": f"exact_kernels_{name}", **stamp, "failure": failures[key].strip().splitlines()[-1]})
        elif data.get(key) is not None:
            rows.append({"name": f"exact_kernels_{name}", **stamp, "rows": data[key]})
    return rows


def main() -> int:
    args = arguments()
    import torch

    from dflash_trt.runtime.kernels.exact_ops import ExactOps

    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    report = gg.Report(out_dir / "exact_kernels.json" if out_dir else None)
    from dflash_trt.runtime.kernels.triton_ops import TritonOps, pdl_default

    machine = f"{torch.cuda.get_device_name()} (torch {torch.__version__}, triton {__import__('triton').__version__})"
    command = "python benchmarks/exact_kernels.py " + " ".join(sys.argv[1:])
    chosen = {"auto": None, "off": False, "on": True}[args.pdl]
    pdl = pdl_default(torch.device("cuda")) if chosen is None else chosen
    report.data |= {"machine": machine, "command": command, "pdl": pdl}
    print(f"programmatic dependent launch: {'on' if pdl else 'off'}", flush=True)
    began = time.perf_counter()
    target, draft = gg.build_pair(torch.device("cuda"))
    dims = gg.make_dims(target, draft, MAX_CONTEXT)
    report.data["build_s"] = round(time.perf_counter() - began, 1)
    backends = {"fast": measure(report, "fast", TritonOps(pdl=chosen), target, draft, dims, args.reps)}
    attention = {k: v for k, v in (("split_slots", args.split_slots), ("block_n", args.attention_block_n),
                                   ("attention_stages", args.attention_stages)) if v is not None}
    attention["pdl"] = chosen
    exact = ExactOps(**attention)
    if args.sweep:
        exact = report.section("sweep", lambda: run_sweep(report, backends["fast"], args, out_dir, attention), keep=False) or exact
    first, *others = args.draft_weights
    backends["exact"] = measure(report, DRAFT_LABELS[first], exact, target, draft, dims, args.reps, first)
    for weights in others:  # the draft's weights another way: graph rows only (the sections run on the first)
        measure(report, DRAFT_LABELS[weights], ExactOps(**attention), target, draft, dims, args.reps, weights).close()
    if args.wide_tiles:
        measure(report, WIDE_LABEL, ExactOps(**attention, wide_tiles=True), target, draft, dims, args.reps).close()
    sections = {
        "gemm": lambda: gemm_times(backends, args.reps),
        "attention": lambda: gg.attention_times(backends, args.contexts, args.reps),
        "combine": lambda: combine_times(backends["exact"], args.reps),
        "tile": lambda: tile_times(backends["exact"], args.reps),
        "split": lambda: split_times(backends["exact"], args.reps),
        "warps": lambda: warps_times(backends["exact"], args.reps),
        "stages": lambda: stages_times(backends["exact"], args.reps),
        "profile": lambda: profile_times(backends, dims, args.reps),
    }
    for name in args.sections.split(","):
        report.section(f"{name}_us", sections[name])
    for backend in backends.values():
        backend.close()
    report.data["summary"] = summary(report.data)
    report.data["seconds"] = round(time.perf_counter() - began, 1)
    stamp = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "machine": machine, "command": command, "pdl": pdl}
    with args.results.open("a") as f:
        for r in result_rows(report.data, args.sections.split(","), stamp):
            f.write(json.dumps(r, default=str) + "\n")
    if report.path is not None:
        report.path.write_text(json.dumps(report.data, indent=1, default=str))
    print("\n" + table(report.data))
    print(json.dumps({"summary": report.data["summary"], "seconds": report.data["seconds"], "failures": sorted(report.data["failures"])}))
    return 1 if report.data["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
