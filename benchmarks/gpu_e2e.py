"""The product's own speedup on a GPU: plain decoding vs DFlash through Executor + generate.

    python benchmarks/gpu_e2e.py [--quick] [--out DIR] [--pairs default,8b]
    python benchmarks/gpu_e2e.py --device cpu --quick --new-tokens 16   # a smoke run of the script itself
    python benchmarks/gpu_e2e.py --pairs default --dtypes bf16 --kernels exact   # the exact kernels' identity
    python benchmarks/gpu_e2e.py --quick --dtypes bf16 --repeats 5     # the median of five timed passes per mode
    python benchmarks/gpu_e2e.py --quick --dtypes bf16 --lag 2         # two launches queued per session (``Executor(lag=)``)
    python benchmarks/gpu_e2e.py --quick --dtypes bf16 --launch-rounds 4   # up to four rounds per launch (``Executor(launch_rounds=)``)
    python benchmarks/gpu_e2e.py --quick --dtypes bf16 --loop-glue torch   # the device loop's torch glue (``Executor(loop_glue=)``)

For each case (pair, dtype, sessions, temperature) one torch backend on CUDA
serves the same prompts twice per mode, first to capture the CUDA graphs
(untimed), then timed with fresh stats: the AR mode (``Executor(...,
speculate=False)``: prefill, then ``target_decode_n`` steps) and DFlash
(cycles). Figures per mode: tokens/s (tokens returned / wall seconds of
``generate``), τ, device-busy seconds (every timed call: prefill and the
loop's launches), host overhead fraction = (wall − device busy) / wall, GPU
idle fraction between consecutive launches of one execute, device ms per
launch (a cycle or a decode step).

Pairs:

- ``default``: the shipped pair (export/default_pair), fp32 and bf16, its
  held-out prompts (last 192 tokens), 128 new tokens, its stop tokens;
- ``8b``: the Qwen3-8B shape (36 layers, hidden 4096, 32/8 heads, head dim
  128, FFN 12288, vocab 151936) with a 5-layer block-16 draft tapping layers
  1, 9, 17, 25, 33, random bf16 weights made on the device: τ is meaningless
  there (the draft is random), the cost of a cycle against a decode step is not.

Needs no Polars (the stats are read from the executor's column lists). Writes
one JSON line per case to OUT/gpu_e2e.jsonl as it goes (the keys of
benchmarks/results.jsonl), prints a table, and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch

from record import machine  # benchmarks/record.py (other benchmarks import it from here too)

from dflash_trt.export.contract import Dims
from dflash_trt.export.pair import DEFAULT_PAIR_DIR, load_pair
from dflash_trt.export.sampling import Sampling
from dflash_trt.runtime.backends.torch_backend import TorchBackend
from dflash_trt.runtime.device_loop import GLUES
from dflash_trt.runtime.executor import DEFAULT_MAX_CYCLES, Executor
from dflash_trt.runtime.generate import stream
from dflash_trt.runtime.policy import POLICIES
from dflash_trt.runtime.serving.batcher import Request

PROMPT_TOKENS, NEW_TOKENS = 192, 128
PROMPTS_PER_SESSION = {1: 6, 4: 4, 16: 3}  # prompts = sessions x this (continuous batching past 1)


# ---------------------------------------------------------------------- pairs


def default_pair(dtype: torch.dtype):
    """(target, draft, prompts, stop) of the shipped pair: held-out prompts, last PROMPT_TOKENS each."""
    from dflash_trt.export.tokenizer import Tokenizer

    target, draft = load_pair(DEFAULT_PAIR_DIR / "target", DEFAULT_PAIR_DIR / "draft", dtype=dtype)
    tokenizer = Tokenizer.from_dir(DEFAULT_PAIR_DIR / "target")
    rows = [json.loads(line) for line in (DEFAULT_PAIR_DIR / "prompts.jsonl").read_text().splitlines() if line.strip()]
    prompts = [(tokenizer.encode(r["prompt"]) if "prompt" in r else r["tokens"])[-PROMPT_TOKENS:] for r in rows]
    return target, draft, prompts, tuple(tokenizer.stop_ids)


def qwen3_8b_shape(dtype: torch.dtype):
    """Random Qwen3-8B-shaped target + 5-layer draft, built on the GPU (nothing to download)."""
    from dflash_trt.export.config import DraftConfig, RopeConfig, TargetConfig
    from dflash_trt.export.draft import DraftModel
    from dflash_trt.export.layers import Rotary, inverse_frequencies
    from dflash_trt.export.target import TargetModel

    common = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_heads=32, num_kv_heads=8, head_dim=128,
                  rms_norm_eps=1e-6, rope=RopeConfig(theta=1e6), attention_bias=False, mlp_bias=False, qk_norm=True)
    taps = (1, 9, 17, 25, 33)
    target_config = TargetConfig(num_layers=36, windows=(0,) * 36, max_position_embeddings=40960, **common)
    draft_config = DraftConfig(num_layers=5, windows=(0,) * 5, block_size=16, num_target_layers=36, target_layer_ids=taps,
                               mask_token_id=151669, **common)
    models = []
    generator = torch.Generator(device="cuda").manual_seed(0)
    for build in (lambda: TargetModel(target_config, taps), lambda: DraftModel(draft_config)):
        with torch.device("meta"):
            model = build()
        model = model.to_empty(device="cuda").to(dtype)
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                parameter.data.fill_(1.0)
            else:
                parameter.data.normal_(0.0, 0.02, generator=generator)
        for module in model.modules():
            if isinstance(module, Rotary):
                module.inv_freq = inverse_frequencies(module.rope, module.head_dim).cuda()
        models.append(model.eval())
    prompts = torch.randint(0, 151936, (64, PROMPT_TOKENS), generator=torch.Generator().manual_seed(1)).tolist()
    return models[0], models[1], prompts, ()


def dims_of(target, draft, owners: int, dtype: torch.dtype) -> Dims:
    """The export's dims (max_context: min(4096, the target's max positions), chunks of 512), ``owners`` per call."""
    from dflash_trt.export.exporter import ExportOptions, contract_dims

    max_context = min(4096, target.config.max_position_embeddings)
    label = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
    options = ExportOptions(max_owners=owners, max_context=max_context, max_chunk=512, proposals=draft.config.block_size - 1, dtype=label)
    return contract_dims(target, draft, options)


# ---------------------------------------------------------------------- one mode


def serve(executor: Executor, requests: list[Request], sessions: int) -> tuple[list[list[int]], float]:
    tokens = [[] for _ in requests]
    executor.backend.synchronize()
    started = time.perf_counter()
    for chunk in stream(executor, requests, sessions):
        tokens[chunk.index] += chunk.tokens
    return tokens, time.perf_counter() - started


def figures(executor: Executor, tokens: list[list[int]], seconds: float) -> dict:
    """The run's figures from the executor's stats columns (no Polars)."""
    columns = executor.log.cycles.columns
    speculative = [a + 1 for a, mode in zip(columns["accepted"], columns["mode"]) if mode != "target"]  # τ: accepted + 1
    per_call = {}
    for cycle, draft_ms, verify_ms in zip(columns["cycle_id"], columns["draft_ms"], columns["verify_ms"]):
        per_call[cycle] = draft_ms + verify_ms
    busy_s = sum(per_call.values()) / 1000
    timeline = executor.loop.timeline
    returned = sum(len(t) for t in tokens)
    return {
        "tokens": returned,
        "seconds": round(seconds, 4),
        "tokens_per_s": round(returned / seconds, 1),
        "tau": round(sum(speculative) / len(speculative), 3) if speculative else None,
        "launches": timeline.launches,
        "device_ms_per_launch": round(timeline.busy_ms / timeline.launches, 4) if timeline.launches else None,
        "wall_ms_per_launch": round(seconds * 1000 / timeline.launches, 4) if timeline.launches else None,
        "host_overhead_fraction": round(max(0.0, 1 - busy_s / seconds), 4),
        "gpu_idle_fraction": round(timeline.idle_ms / (timeline.busy_ms + timeline.idle_ms), 4) if timeline.launches else None,
        "captured_graphs": len(executor.loop.captured),
        # Rows of the cycle table by kind: cycles, and the target's own tokens (prompts' first tokens and, in DFlash
        # mode, the rounds the policy ran as plain decode steps).
        "cycle_rows": len(speculative),
        "target_rows": len(columns["mode"]) - len(speculative),
    }


def run_mode(
    backend, requests: list[Request], sessions: int, speculate: bool, max_cycles: int, policy: str = "always", repeats: int = 1,
    lag: int = 1, loop_glue: str = "auto", launch_rounds: int = 1,
) -> tuple[dict, list[list[int]]]:
    """One mode: a warm-up pass, then ``repeats`` timed passes with fresh stats; the figures (and tokens) of the
    median pass by tokens/s, with every pass's tokens/s (a default-pair pass at one session lasts ~0.1 s on an
    H200: one pass is a noisy figure)."""
    with Executor(backend, max_sessions=sessions, speculate=speculate, max_cycles=max_cycles, policy=policy, lag=lag,
                  loop_glue=loop_glue, launch_rounds=launch_rounds) as executor:
        serve(executor, requests, sessions)  # warm-up: every graph this workload needs is captured here
        passes = []
        for _ in range(repeats):
            executor.clear_stats()
            executor.loop.timeline.reset()
            tokens, seconds = serve(executor, requests, sessions)
            passes.append((figures(executor, tokens, seconds), tokens))
        result, tokens = sorted(passes, key=lambda p: p[0]["tokens_per_s"])[len(passes) // 2]
        return result | {"passes_tokens_per_s": [p[0]["tokens_per_s"] for p in passes]}, tokens


# ---------------------------------------------------------------------- cases


def case(name: str, models, dtype, sessions: int, options, write):
    target, draft, prompts, stop = models
    count = sessions * (options.rounds or PROMPTS_PER_SESSION.get(sessions, 2))
    dims = dims_of(target, draft, sessions, dtype)
    backend = TorchBackend(target, draft, dims, sessions, device=options.device, kernels=options.kernels,
                           draft_weights=options.draft_weights)
    temperatures, new_tokens, max_cycles = options.temperatures, options.new_tokens, options.max_cycles
    try:
        for temperature in temperatures:
            requests = [Request(p, new_tokens, stop, Sampling(temperature, 0, 1.0, i)) for i, p in enumerate(prompts[:count])]
            ar, ar_tokens = run_mode(backend, requests, sessions, False, max_cycles, repeats=options.repeats, lag=options.lag,
                                     loop_glue=options.loop_glue, launch_rounds=options.launch_rounds)
            dflash, dflash_tokens = run_mode(backend, requests, sessions, True, max_cycles, options.policy, options.repeats, options.lag,
                                             options.loop_glue, options.launch_rounds)
            identical = sum(a == b for a, b in zip(ar_tokens, dflash_tokens))
            write(row(name, sessions, temperature, ar, dflash, identical, count, max_cycles)
                  | {"kernels": backend.kernels, "policy": options.policy, "pdl": pdl_on(backend.device), "lag": options.lag,
                     "loop_glue": options.loop_glue, "launch_rounds": options.launch_rounds, "draft_weights": options.draft_weights})
    finally:
        backend.close()


def row(name, sessions, temperature, ar, dflash, identical, prompts, max_cycles) -> dict:
    return {
        "name": name,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "command": "python benchmarks/gpu_e2e.py " + " ".join(sys.argv[1:]),
        "sessions": sessions,
        "temperature": temperature,
        "tau": dflash["tau"],
        "ar_tokens_per_s": ar["tokens_per_s"],
        "dflash_tokens_per_s": dflash["tokens_per_s"],
        "speedup": round(dflash["tokens_per_s"] / ar["tokens_per_s"], 3),
        "host_overhead_fraction": dflash["host_overhead_fraction"],
        "gpu_idle_fraction": dflash["gpu_idle_fraction"],
        "ar_host_overhead_fraction": ar["host_overhead_fraction"],
        "ar_gpu_idle_fraction": ar["gpu_idle_fraction"],
        "ar_device_ms_per_step": ar["device_ms_per_launch"],
        "ar_wall_ms_per_token": round(1000 / ar["tokens_per_s"] * sessions, 4),
        "dflash_device_ms_per_cycle": dflash["device_ms_per_launch"],
        "dflash_wall_ms_per_cycle": dflash["wall_ms_per_launch"],
        "prompts": prompts,
        "identical_outputs": identical,
        "max_cycles": max_cycles,
        "ar": ar,
        "dflash": dflash,
    }


def pdl_on(device: torch.device) -> bool:
    """Whether the backend's kernels overlap their launches (programmatic dependent launch; CUDA only)."""
    if device.type != "cuda":
        return False
    from dflash_trt.runtime.kernels.triton_ops import pdl_default

    return pdl_default(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="default pair only, 1 and 16 sessions, T=0")
    parser.add_argument("--pairs", default="default,8b", help="comma-separated: default, 8b")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu_out")))
    parser.add_argument("--max-cycles", type=int, default=DEFAULT_MAX_CYCLES, help=f"rounds per execute (default {DEFAULT_MAX_CYCLES}, the executor's)")
    parser.add_argument("--policy", choices=POLICIES, default="adaptive",
                        help="the DFlash mode's speculation policy (runtime.policy; default adaptive, as dflash-trt serve)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--lag", type=int, default=1, help="the executor's launches queued per session beyond the one read (default 1)")
    parser.add_argument("--launch-rounds", type=int, default=1, help="the executor's most rounds per launch (default 1)")
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS, help="default pair (the 8B shape: half)")
    parser.add_argument("--loop-glue", choices=GLUES, default="auto",
                        help="the device loop's kernels around the graphs (Executor(loop_glue=); default auto: Triton on CUDA)")
    parser.add_argument("--rounds", type=int, help="prompts per session (default: 6 / 4 / 3 at 1 / 4 / 16 sessions)")
    parser.add_argument("--kernels", default="auto", help="the torch backend's kernels: auto, fast, exact (CUDA), reference")
    parser.add_argument("--dtypes", default="fp32,bf16", help="the default pair's dtypes, comma-separated: fp32, bf16")
    parser.add_argument("--draft-weights", choices=("model", "fp8"), default="model", help="the draft's weights (the torch backend's draft_weights)")
    parser.add_argument("--sessions", help="comma-separated session counts (default: 1,4,16; --quick: 1,16)")
    parser.add_argument("--also-max-cycles", type=int, help="the default pair at 1 session, T=0, once more with this max_cycles")
    parser.add_argument("--repeats", type=int, default=1, help="timed passes per mode; the median pass's figures (and every pass's tokens/s)")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []

    def write(result: dict) -> None:
        rows.append(result)
        with (args.out / "gpu_e2e.jsonl").open("a") as file:
            file.write(json.dumps(result) + "\n")
        print({k: result[k] for k in ("name", "sessions", "temperature", "tau", "ar_tokens_per_s", "dflash_tokens_per_s",
                                       "speedup", "host_overhead_fraction", "gpu_idle_fraction", "identical_outputs")}, flush=True)

    sessions_list, args.temperatures = ((1, 16), (0.0,)) if args.quick else ((1, 4, 16), (0.0, 1.0))
    sessions_list = tuple(int(n) for n in args.sessions.split(",")) if args.sessions else sessions_list
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    pairs = ["default"] if args.quick else args.pairs.split(",")
    if "default" in pairs:
        for dtype in (dtypes[name] for name in args.dtypes.split(",")):
            models = default_pair(dtype)
            label = "fp32" if dtype == torch.float32 else "bf16"
            for sessions in sessions_list:
                case(f"gpu_e2e default_pair {label}", models, dtype, sessions, args, write)
            if args.also_max_cycles:
                other = argparse.Namespace(**vars(args) | {"max_cycles": args.also_max_cycles, "temperatures": (0.0,)})
                case(f"gpu_e2e default_pair {label}", models, dtype, 1, other, write)
            del models
    if "8b" in pairs:
        models = qwen3_8b_shape(torch.bfloat16)
        args.new_tokens, args.rounds = args.new_tokens // 2, args.rounds or 1
        for sessions in sessions_list:
            case("gpu_e2e qwen3-8b-shape random bf16", models, torch.bfloat16, sessions, args, write)
    print(table(rows))
    print(json.dumps({"rows": len(rows), "speedups": [r["speedup"] for r in rows]}))


def table(rows: list[dict]) -> str:
    keys = ("name", "kernels", "sessions", "temperature", "tau", "ar_tokens_per_s", "dflash_tokens_per_s", "speedup",
            "ar_device_ms_per_step", "dflash_device_ms_per_cycle", "host_overhead_fraction", "gpu_idle_fraction")
    lines = ["| " + " | ".join(keys) + " |", "|" + " --- |" * len(keys)]
    lines += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
