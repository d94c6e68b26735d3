"""``dflash-trt bench --serve URL``: load a running OpenAI-compatible server and measure it as a client.

    dflash-trt bench --serve http://127.0.0.1:8000 [--num-prompts 64] [--concurrency 8] [--max-new-tokens 128]
        [--prompts FILE.jsonl] [--model NAME] [--temperature 0] [--seed 0] [--out DIR]

Sends ``--num-prompts`` streaming completions (the prompts file's, in order,
cycled; default: the default pair's held-out code prompts), at most
``--concurrency`` at a time, with the official ``openai`` client (asyncio),
and times every stream event on the client's clock, as vLLM's ``bench serve``
does:

| figure | per request |
| --- | --- |
| TTFT | request sent → first event with text |
| TPOT | (last event − first event) / (output tokens − 1), for requests of 2+ tokens |
| ITL | gap between two events with text (a DFlash cycle's tokens arrive together) |
| E2E | request sent → stream end |

and, over the whole run: requests/s, output tokens/s, total (prompt +
output) tokens/s; output tokens are the server's ``usage`` counts. Prints a
table, then one JSON line with every figure; ``--out DIR`` also writes
``DIR/serve_bench.json`` with the per-request records. A request that fails
counts as failed (its error kept), never as a success.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from dflash_trt.errors import InputError, ServingError
from dflash_trt.export import DEFAULT_PAIR_DIR

PERCENTILES = (50, 90, 99)


@dataclass
class Record:
    """One request as the client saw it (seconds on the client's monotonic clock)."""

    prompt_tokens: int = 0
    output_tokens: int = 0
    sent: float = 0.0
    events: list[float] = field(default_factory=list)  # arrival of each event carrying text
    ended: float = 0.0
    finish: str | None = None
    error: str | None = None


def read_prompts(path: Path | None) -> list[str | list[int]]:
    """Prompts of a JSONL file (``prompt`` text or ``tokens`` ids per line); default: the default pair's."""
    if path is None:
        path = DEFAULT_PAIR_DIR / "prompts.jsonl"
    prompts = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip():
            row = json.loads(line)
            if not isinstance(row, dict) or ("prompt" in row) == ("tokens" in row):
                raise InputError(f"{path}:{number}: each line must be an object with exactly one of 'prompt' (text) or 'tokens' (ids)")
            prompts.append(row.get("prompt", row.get("tokens")))
    if not prompts:
        raise InputError(f"{path}: no prompts")
    return prompts


async def _one(client, model: str, prompt, args, seed: int) -> Record:
    import openai

    record = Record(sent=time.perf_counter())
    try:
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=args.max_new_tokens, temperature=args.temperature,
                                                 top_p=args.top_p, seed=seed, stream=True, stream_options={"include_usage": True})
        async for event in stream:
            if event.choices and event.choices[0].text:
                record.events.append(time.perf_counter())
            if event.choices and event.choices[0].finish_reason:
                record.finish = event.choices[0].finish_reason
            if event.usage is not None:
                record.prompt_tokens, record.output_tokens = event.usage.prompt_tokens, event.usage.completion_tokens
    except (openai.OpenAIError, OSError, ValueError) as error:  # the request failed (API, connection, a bad event); the run goes on
        record.error = f"{type(error).__name__}: {error}"[:300]
    record.ended = time.perf_counter()
    if record.error is None and record.finish is None:
        record.error = "the stream ended without a finish_reason"
    return record


async def _load(url: str, prompts: list, args) -> tuple[str, list[Record], float]:
    import openai

    client = openai.AsyncOpenAI(base_url=url.rstrip("/") + "/v1", api_key="unused", max_retries=0, timeout=args.request_timeout)
    try:
        model = args.model or (await client.models.list()).data[0].id
        gate = asyncio.Semaphore(args.concurrency)

        async def limited(i: int) -> Record:
            async with gate:
                return await _one(client, model, prompts[i % len(prompts)], args, args.seed + i)

        started = time.perf_counter()
        records = await asyncio.gather(*(limited(i) for i in range(args.num_prompts)))
        return model, list(records), time.perf_counter() - started
    finally:
        await client.close()


def figures(records: list[Record], seconds: float) -> dict:
    """The run's figures (ms for latencies) from the client's records."""
    ok = [r for r in records if r.error is None]
    ttft = [r.events[0] - r.sent for r in ok if r.events]
    tpot = [(r.events[-1] - r.events[0]) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1 and len(r.events) > 1]
    itl = [gap for r in ok for gap in np.diff(r.events).tolist()]
    e2e = [r.ended - r.sent for r in ok]
    prompt_tokens, output_tokens = sum(r.prompt_tokens for r in ok), sum(r.output_tokens for r in ok)
    result = {
        "requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "seconds": round(seconds, 3),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "requests_per_s": round(len(ok) / seconds, 3) if seconds > 0 else None,
        "output_tokens_per_s": round(output_tokens / seconds, 2) if seconds > 0 else None,
        "total_tokens_per_s": round((prompt_tokens + output_tokens) / seconds, 2) if seconds > 0 else None,
    }
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2e", e2e)):
        result[f"{name}_mean_ms"] = round(float(np.mean(values)) * 1000, 3) if values else None
        for q in PERCENTILES:
            result[f"{name}_p{q}_ms"] = round(float(np.percentile(values, q)) * 1000, 3) if values else None
    errors = sorted({r.error for r in records if r.error is not None})
    if errors:
        result["errors"] = errors[:5]
    return result


def table(result: dict) -> str:
    """A Markdown table: the run's totals, then one row per latency."""
    lines = ["| requests (ok / failed) | seconds | requests/s | output tokens/s | total tokens/s |", "| --- | --- | --- | --- | --- |",
             f"| {result['completed']} / {result['failed']} | {result['seconds']} | {result['requests_per_s']} | {result['output_tokens_per_s']} | {result['total_tokens_per_s']} |",
             "", "| latency (ms) | mean | p50 | p90 | p99 |", "| --- | --- | --- | --- | --- |"]
    for name in ("ttft", "tpot", "itl", "e2e"):
        cells = [result[f"{name}_mean_ms"], *(result[f"{name}_p{q}_ms"] for q in PERCENTILES)]
        lines.append(f"| {name.upper()} | " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def run(args) -> int:
    """``dflash-trt bench --serve URL``: see the module docstring."""
    try:
        import openai  # noqa: F401
    except ModuleNotFoundError as error:
        raise ServingError("dflash-trt bench --serve needs the openai client: pip install openai") from error
    if args.concurrency < 1 or args.num_prompts < 1:
        raise InputError(f"--concurrency and --num-prompts must be >= 1, got {args.concurrency} and {args.num_prompts}")
    prompts = read_prompts(args.prompts)
    model, records, seconds = asyncio.run(_load(args.serve, prompts, args))
    result = {"url": args.serve, "model": model, "concurrency": args.concurrency, "max_tokens": args.max_new_tokens,
              "temperature": args.temperature, **figures(records, seconds)}
    print(table(result))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "serve_bench.json").write_text(json.dumps({**result, "records": [asdict(r) for r in records]}))
    print(json.dumps(result))
    return 0 if result["completed"] else 1
