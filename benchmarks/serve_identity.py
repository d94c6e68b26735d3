"""Identity under serving: ``dflash-trt serve``'s completions with DFlash against ``--no-draft``, and each request
alone against the same request among many (issue 23's serve goals).

For each mode (``on``: the server as ``--serve-args`` configure it; ``off``: the same with ``--no-draft``) one
fresh server (``serve_adversarial.Server``) gets the default pair's ``--prompts`` held-out prompts, first one at
a time, then ``--concurrency`` at once, non-streaming: greedy, and with ``--sampled`` once more at temperature 1
with a seed per prompt (the same seeds in every pass). Completions are compared as the server's text (its own
detokenization of the tokens): each mode alone against itself together (batching), and on against off, alone and
together (speculation). Prints a table of identical completions per comparison (with the first differing prompts and the
character where they part) and ends with one JSON line; ``--record`` appends it to benchmarks/results.jsonl.

    python benchmarks/serve_identity.py [--prompts 64] [--concurrency 64] [--max-tokens 64] [--sampled]
        [--serve-args "--backend torch --device cuda --max-sessions 64"] [--record]
    python benchmarks/serve_identity.py --prompts 8 --concurrency 8 --max-tokens 16   # the CPU, ONNX Runtime fp32
"""

from __future__ import annotations

import argparse
import http.client
import json
import shlex
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import record  # noqa: E402  (benchmarks/record.py: results.jsonl)
import serve_adversarial as sa  # noqa: E402  (the server subprocess, the prompts, machine and commit)

MODES = {"on": (), "off": ("--no-draft",)}


def complete(port: int, prompt: str, max_tokens: int, temperature: float, seed: int | None, timeout: float = 600) -> str:
    """One non-streaming completion's text (an HTTP error raises: a refused request is no completion)."""
    body = {"model": sa.MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature}
    if seed is not None:
        body["seed"] = seed
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        payload = response.read()
    finally:
        conn.close()
    if response.status != 200:
        raise RuntimeError(f"completion failed with HTTP {response.status}: {payload[:300]!r}")
    return json.loads(payload)["choices"][0]["text"]


def passes(args, flags: tuple[str, ...]) -> dict[str, list[str]]:
    """One server in a mode: every sampling's completions alone, then ``--concurrency`` at once."""
    prompts = sa.prompts()[: args.prompts]
    samplings = {"greedy": (0.0, None)} | ({"sampled": (1.0, 1000)} if args.sampled else {})
    server = sa.Server(args, *flags)
    try:
        out = {}
        for name, (temperature, seed0) in samplings.items():
            def one(i: int, temperature=temperature, seed0=seed0) -> str:
                return complete(server.port, prompts[i], args.max_tokens, temperature, None if seed0 is None else seed0 + i)

            out[f"{name} alone"] = [one(i) for i in range(len(prompts))]
            with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
                out[f"{name} together"] = list(pool.map(one, range(len(prompts))))
        return out
    finally:
        server.stop()


def compare(left: list[str], right: list[str]) -> dict:
    """How many completions are identical; the first differing prompts (index, first differing character)."""
    differing = []
    for i, (a, b) in enumerate(zip(left, right, strict=True)):
        if a != b:
            differing.append((i, next((c for c, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))))
    return {"identical": len(left) - len(differing), "of": len(left), "differing": differing[:8]}


def comparisons(results: dict[str, dict[str, list[str]]]) -> dict[str, dict]:
    """Batching (each mode alone vs together) and speculation (on vs off, alone and together), per sampling."""
    rows = {}
    for sampling in sorted({key.split()[0] for key in next(iter(results.values()))}):  # every mode ran the same samplings
        for mode in results:
            rows[f"{mode}: alone vs together ({sampling})"] = compare(results[mode][f"{sampling} alone"], results[mode][f"{sampling} together"])
        if {"on", "off"} <= results.keys():
            for how in ("alone", "together"):
                rows[f"on vs off, {how} ({sampling})"] = compare(results["on"][f"{sampling} {how}"], results["off"][f"{sampling} {how}"])
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64, help="held-out prompts of the default pair (at most 64)")
    parser.add_argument("--concurrency", type=int, default=64, help="requests in flight in the 'together' pass")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--sampled", action="store_true", help="also at temperature 1, a seed per prompt")
    parser.add_argument("--modes", nargs="+", choices=tuple(MODES), default=list(MODES))
    parser.add_argument("--serve-args", default="", help="more dflash-trt serve flags, one string")
    parser.add_argument("--record", action="store_true", help="append the JSON line to benchmarks/results.jsonl")
    args = parser.parse_args()
    if not 1 <= args.prompts <= len(sa.prompts()):
        parser.error(f"--prompts must be in [1, {len(sa.prompts())}], got {args.prompts}")
    started = time.perf_counter()
    results = {mode: passes(args, MODES[mode]) for mode in args.modes}
    rows = comparisons(results)
    print("| comparison | identical | first differing (prompt, character) |\n| --- | --- | --- |")
    for name, row in rows.items():
        print(f"| {name} | {row['identical']} / {row['of']} | {row['differing'] or '-'} |")
    summary = {"name": "serve_identity", "date": time.strftime("%Y-%m-%d"), "commit": sa.commit(), "machine": sa.machine(),
               "command": shlex.join(["python", "benchmarks/serve_identity.py", *sys.argv[1:]]), "prompts": args.prompts,
               "concurrency": args.concurrency, "max_tokens": args.max_tokens, "seconds": round(time.perf_counter() - started, 1),
               "comparisons": rows}
    return record.finish(summary, args.record)


if __name__ == "__main__":
    sys.exit(main())
