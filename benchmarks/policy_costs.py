"""What a launch costs the speculation policy: wall time per launch (its measure) against device time.

Runs a serving loop in this process (``runtime.serving.loop.ServingLoop``, the
server's engine without HTTP) over the embedded default pair, or
``--artifacts``, with ``--requests`` greedy requests of ``--max-tokens``
tokens from the pair's held-out prompts, ``--max-sessions`` at once, under
a policy forced to alternate decode steps and cycles (``--policy
alternate``: both kinds measured at every owner count), ``adaptive`` or
``always``. Per round kind and padded lane count it prints: launches
charged to such rounds (a decode round's drain cycles included), the
policy's measured cost (wall ms per launch: the launch call, the wait for
its verdict, and the host work turning it into tokens, stats and
deliveries), tokens per launch and the policy's rate (tokens per wall
second); per launch kind, the device ms of the launches (``runtime.timing``:
CUDA events, or host time around the synchronous launch on CPU). Then the
ratio the policy estimates (cycle rounds' rate over decode rounds') against
the one device time gives (τ · device ms of a decode step / of a cycle),
and, last, one JSON line.

    python benchmarks/policy_costs.py [--backend onnxruntime|torch] [--device cuda] [--max-sessions 4]
        [--requests 32] [--max-tokens 64] [--policy alternate|adaptive|always] [--record]

``--record`` appends the JSON line to benchmarks/results.jsonl.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import platform
import sys
import time
from pathlib import Path

import polars as pl

from dflash_trt.runtime import command
from dflash_trt.runtime.device_loop import padded
from dflash_trt.runtime.executor import Executor
from dflash_trt.runtime.policy import CYCLE, DECODE, EXPLORE, AdaptivePolicy, AlwaysCycle, Choice, cycle_ratio
from dflash_trt.runtime.serving.loop import ServingLoop

import record  # benchmarks/record.py: results.jsonl

ROOT = Path(__file__).resolve().parent.parent


class Recorded:
    """A policy whose observations are kept, launch by launch: (round kind, owners, seconds, tokens)."""

    def __init__(self, inner) -> None:
        self.inner, self.samples = inner, []

    def choose(self, owners: int) -> Choice:
        return self.inner.choose(owners)

    def observe(self, kind: str, owners: int, seconds: float, tokens: int, *rest) -> None:
        self.samples.append((kind, owners, seconds, tokens))
        self.inner.observe(kind, owners, seconds, tokens, *rest)


class Alternate(AdaptivePolicy):
    """Decode, decode, cycle, ...: both kinds measured at every owner count (a lane with a cycle in
    flight is deferred on a decode choice and offered again: the second decode runs it)."""

    def __init__(self) -> None:
        super().__init__()
        self.pattern = itertools.cycle((DECODE, DECODE, CYCLE))

    def choose(self, owners: int) -> Choice:
        kind = next(self.pattern)
        return Choice(kind, EXPLORE, math.nan, kind, owners)


POLICIES = {"alternate": Alternate, "adaptive": AdaptivePolicy, "always": AlwaysCycle}


def costs(samples: list[tuple[str, int, float, int]], cycles: pl.DataFrame, max_owners: int) -> pl.DataFrame:
    """Per (kind, owners): launches charged to rounds of that kind, wall ms and tokens per launch, the
    rate (tokens per wall second), and the device ms of the loop's launches of that kind."""
    schema = {"kind": pl.Utf8, "owners": pl.Int64, "seconds": pl.Float64, "tokens": pl.Int64}
    wall = pl.DataFrame(samples, schema=schema, orient="row").group_by("kind", "owners").agg(
        pl.len().alias("launches"), (pl.col("seconds").mean() * 1000).alias("wall_ms"), pl.col("tokens").mean().alias("tokens"),
        (pl.col("tokens").sum() / pl.col("seconds").sum()).alias("tokens_per_s"))
    loop = cycles.filter(pl.col("verify_ms") > 0).unique("cycle_id")  # one row per launch
    loop = loop.filter((pl.col("mode") != "target") | (pl.col("policy") != "fixed"))  # the drafting lanes' launches
    loop = loop.with_columns(pl.when(pl.col("mode") == "target").then(pl.lit(DECODE)).otherwise(pl.lit(CYCLE)).alias("kind"),
                             pl.col("owners").map_elements(lambda n: padded(min(n, max_owners), max_owners), return_dtype=pl.Int64))
    device = loop.group_by("kind", "owners").agg(pl.col("verify_ms").mean().alias("device_ms"))
    return wall.join(device, on=["kind", "owners"], how="left").sort("owners", "kind")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    command.add_arguments(parser, out_required=False)
    parser.set_defaults(policy="alternate")
    parser._option_string_actions["--policy"].choices = tuple(POLICIES)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--record", action="store_true", help="append the JSON line to benchmarks/results.jsonl")
    args = parser.parse_args()
    args.max_new_tokens = args.max_new_tokens if "--max-new-tokens" in sys.argv else 64
    command.check_flags(args)
    command.prepare_artifacts(args)
    tokenizer = command.load_tokenizer(args.tokenizer, args.artifacts, args.target)
    prompts = command.read_prompts(args.prompts, tokenizer, None)
    with command.open_backend(args) as backend:
        sessions = args.max_sessions or backend.dims.max_owners
        policy = Recorded(POLICIES[args.policy]())
        executor = Executor(backend, max_sessions=sessions, policy=policy, max_cycles=args.max_cycles, stats_rows=None)
        serving = ServingLoop(executor, tokenizer)
        started = time.perf_counter()
        handles = [serving.submit(list(prompts[i % len(prompts)].tokens[-200:]), args.max_new_tokens, temperature=0.0)
                   for i in range(args.requests)]
        tokens = sum(len(h.result(3600).tokens) for h in handles)
        seconds = time.perf_counter() - started
        serving.close()
        cycles = executor.cycle_stats()
        table = costs(policy.samples, cycles, backend.dims.max_owners)
        spec = cycles.filter(pl.col("mode") != "target")
        tau = float((spec["accepted"] + 1).mean()) if spec.height else None
        executor.close()
    print(table)
    ratios = {}
    for owners in sorted(set(table["owners"])):
        row = {r["kind"]: r for r in table.filter(pl.col("owners") == owners).iter_rows(named=True)}
        if tau is not None and CYCLE in row and DECODE in row and row[CYCLE]["device_ms"] and row[DECODE]["device_ms"]:
            ratios[owners] = {"wall": round(cycle_ratio(row[CYCLE]["tokens_per_s"], row[DECODE]["tokens_per_s"]), 3),
                              "device": round(tau * row[DECODE]["device_ms"] / row[CYCLE]["device_ms"], 3)}
            print(f"owners {owners}: ratio from wall rates {ratios[owners]['wall']}, from device time {ratios[owners]['device']} (τ {tau:.3f})")
    summary = {"name": "policy_costs", "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()} {os.cpu_count()} CPUs",
               "command": " ".join(["python", "benchmarks/policy_costs.py", *sys.argv[1:]]), "policy": args.policy, "sessions": sessions,
               "requests": args.requests, "tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 2),
               "tau": None if tau is None else round(tau, 3), "ratios": ratios,
               "costs": [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()} for r in table.iter_rows(named=True)]}
    return record.finish(summary, args.record)


if __name__ == "__main__":
    sys.exit(main())
