"""Load on ``dflash-trt serve``: N concurrent streaming clients for a fixed time.

Starts the server as a subprocess on 127.0.0.1 (the embedded default pair,
exported to the cache as ``dflash-trt demo`` does, unless ``--artifacts``;
``--backend torch`` runs the checkpoints directly), then runs N clients (the
official openai client, asyncio, spread over ``--client-procs`` processes so
the clients' own parsing does not become the bottleneck) that each send
streaming completions back to back: a prompt from the default pair's held-out
code prompts, ``--max-tokens`` new tokens, greedy (``--temperature`` > 0: sampled). The clients first load the
server for ``--warmup-seconds`` (CUDA graph captures, allocator growth),
then the window of ``--seconds`` is measured. Requests still running when
the window ends are cancelled (disconnect): they do not count as requests,
but their tokens (the server's own output-token counter over the window) and
latencies do.

Per front (``--fronts``: ``process``, the default server with the HTTP front
in its own process; ``single``, ``--no-front-process``: HTTP and the serving
loop in one process), per mode (DFlash on, under ``--policy``, default adaptive;
always = DFlash with ``--policy always``; off = the server's ``--no-draft``,
plain target decoding through the same engine) and per client count (each on the same server) it
prints: requests/s and output tokens/s over the window, TTFT, inter-token
latency (ITL: the gap between two stream events of a request; a DFlash
cycle's accepted tokens, and an execute's cycles, arrive together) p50/p99,
time per output token (TPOT: per finished request, (last event − first
event) / (tokens − 1)) p50/p99, the server's own TTFT / ITL p99 (its
/metrics histograms between two scrapes that bound the window, interpolated
in their buckets: what the serving process measured, to set beside the
clients'), τ, the speculation policy's choices (drafting lanes' launches
run as cycles / decode steps in the window) and the device's busy share (its
loop launches' device time over the window) from the server's /metrics, and
whose CPU is the limit: the busiest process's CPU time over the window in %
of one core, for the HTTP fronts (the server's own process and, with
``serve --fronts N``, the others; with ``--fronts single`` everything), the
serving process and the client processes (Linux /proc; 100 = a process that
never waited), and the serving loop's thread's share of the window on a CPU and runnable but waiting for one
(``/proc/.../schedstat``: a wait share above a few % is its core taken by another thread or process). ``--profile-serving`` also samples the serving process with py-spy over each
window and prints its serving thread's functions by share of the samples (``thread_profile.py``);
``--profile-serving gil`` samples only the GIL's holder: each thread's share of it and where it goes.
A request that fails (an HTTP error, a broken stream) is counted (``errors``, with up to three examples
in the row) and the client goes on; after a server with failures stops, its log from its first warning
or error is printed.
``--repeats R`` runs every mode's windows R times, the modes interleaved, and ends with each drafting
mode's median tokens/s against ``off``'s and the spread of the per-repeat ratios (one window pair of a
build has differed from the next by up to a third on the H200). Each repeat starts its servers afresh;
``--keep-servers`` starts every mode's server once instead and, per client count, alternates their windows R
times (on, off, on, off, ...), the servers kept running: a slow stretch of the host falls on both modes' windows
alike, and no mode's server starts after the other's has served load (in two leases a DFlash server started after a
plain one ran slow at 64 streams). ``--client-cores N`` pins the client
processes to N whole physical cores and the server to the others (Linux): with the clients on the same
host, a client thread on the serving thread's core (or its hyperthread) measures their contention. A window whose
pinned clients used 90% of their cores or more is flagged under its row (``client_bound`` and ``client_load`` in its
figures; counted per side in the ratio table): the openai client spends ~2-5 ms of CPU per streamed request, so
four client cores held the load at ~850-1,700 requests/s in most 64-stream windows on a GPU host, and a window at
that cap measures the load generator's limit as much as the server's.

    python benchmarks/serve_load.py [--clients 8 [1 ...]] [--seconds 30] [--max-tokens 64] [--modes on off]
        [--artifacts DIR] [--backend onnxruntime|torch|tensorrt] [--device cuda] [--serve-args "--max-cycles 4"]
        [--policy adaptive|always|adaptive-stop] [--modes on always off]
        [--threads N] [--client-procs P] [--warmup-seconds S] [--server-logs DIR] [--fronts process single] [--profile-serving [thread|gil]] [--repeats R [--keep-servers]] [--client-cores N] [--record]

``--record`` appends one row per mode and client count to
benchmarks/results.jsonl. The last line printed is one JSON object with
every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

import record  # benchmarks/record.py: results.jsonl
import thread_profile  # benchmarks/thread_profile.py: py-spy samples of the serving thread
from dflash_trt.runtime.policy import POLICIES

# "on": DFlash under --policy; "always": DFlash cycling whenever a block fits; "off": plain target decoding through the same engine
MODES = {"on": [], "always": ["--policy", "always"], "off": ["--no-draft"]}
FRONTS = {"process": ["--front-process"], "single": ["--no-front-process"]}  # the HTTP front in its own process, or not
ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def cpu_cores() -> dict[int, tuple[int, int]]:
    """Logical CPU -> (package, core) from Linux sysfs, for the CPUs this process may run on; {} elsewhere."""
    cores = {}
    for cpu in sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores[cpu] = (int((topology / "physical_package_id").read_text()), int((topology / "core_id").read_text()))
        except (OSError, ValueError):
            return {}
    return cores


def split_cores(cores: dict[int, tuple[int, int]], client_cores: int) -> tuple[set[int], set[int]]:
    """(server CPUs, client CPUs): the last ``client_cores`` physical cores, every hyperthread of each, for
    the clients, the rest for the server, so no client shares a core with the server's serving thread.

    >>> cores = {0: (0, 0), 1: (0, 1), 2: (0, 2), 3: (0, 3), 4: (0, 0), 5: (0, 1), 6: (0, 2), 7: (0, 3)}  # 4 cores x 2 threads
    >>> split_cores(cores, 1)
    ({0, 1, 2, 4, 5, 6}, {3, 7})
    """
    physical = sorted(set(cores.values()))
    if not 1 <= client_cores < len(physical):
        raise SystemExit(f"--client-cores must be in [1, {len(physical) - 1}] on this machine ({len(physical)} cores), got {client_cores}")
    theirs = set(physical[-client_cores:])
    clients = {cpu for cpu, core in cores.items() if core in theirs}
    return set(cores) - clients, clients


def start_server(args, extra: list[str]) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    command = [sys.executable, "-m", "dflash_trt.cli", "serve", "--port", str(port), "--max-sessions", str(args.max_sessions),
               "--backend", args.backend, *extra, *shlex.split(args.serve_args)]
    if "--no-draft" not in extra and "--policy" not in extra:
        command += ["--policy", args.policy]
    if args.artifacts:
        command += ["--artifacts", str(args.artifacts)]
    if args.device:
        command += ["--device", args.device]
    if args.threads:
        command += ["--threads", str(args.threads)]
    args.server_logs.mkdir(parents=True, exist_ok=True)
    log = args.server_logs / f"serve_load_{port}.log"
    server_cpus = getattr(args, "server_cpus", None)  # --client-cores: its processes (fronts, serving) inherit it
    process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT,
                               preexec_fn=(lambda: os.sched_setaffinity(0, server_cpus)) if server_cpus else None)  # noqa: PLW1509  (no threads here)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"server exited: {log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as response:
                if response.status == 200:
                    return process, base, log
        except OSError:
            time.sleep(0.5)
    process.kill()
    raise SystemExit("server not ready after 900 s")


def server_metrics(base: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(base + "/metrics", timeout=30) as response:
        text = response.read().decode()
    return {s.name + "".join(f"[{s.labels[label]}]" for label in ("outcome", "quantile", "choice", "le") if label in s.labels): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def histogram_quantile(q: float, name: str, before: dict, after: dict) -> float | None:
    """The ``q`` quantile (0..1) of histogram ``name``'s samples between two scrapes, interpolated linearly
    inside its bucket (Prometheus' ``histogram_quantile``); None without samples in between.

    >>> a = {"h_bucket[0.01]": 0.0, "h_bucket[0.02]": 0.0, "h_bucket[+Inf]": 0.0}
    >>> b = {"h_bucket[0.01]": 50.0, "h_bucket[0.02]": 100.0, "h_bucket[+Inf]": 100.0}
    >>> round(histogram_quantile(0.99, "h", a, b), 4)
    0.0198
    """
    prefix = f"{name}_bucket["
    bounds = sorted((float(key[len(prefix) : -1]), after[key] - before.get(key, 0.0)) for key in after if key.startswith(prefix))
    total = bounds[-1][1] if bounds else 0.0
    if total <= 0:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for upper, count in bounds:
        if count >= rank:
            if upper == float("inf"):
                return lower  # past the last finite bound: its value, as Prometheus does
            return lower + (upper - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = upper, count
    return lower


async def client_loop(client, model: str, prompts: list[str], index: int, clients: int, args, window: tuple[float, float], record: dict) -> None:
    """Back-to-back streaming requests until the window ends; what falls inside the window is recorded.

    Times are ``time.time()`` (one clock for every client process).
    """
    import openai

    n, (window_start, stop_at) = index, window
    while time.time() < stop_at:
        prompt = prompts[n % len(prompts)]
        n += clients
        started, events, finished, usage = time.time(), [], False, None
        try:
            if args.max_tokens:
                stream = await client.completions.create(model=model, prompt=prompt, max_tokens=args.max_tokens, temperature=args.temperature,
                                                         stream=True, stream_options={"include_usage": True})
            else:  # to the context's end: a chat request without max_tokens (the server's default: all the context left)
                stream = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}], temperature=args.temperature,
                                                              stream=True, stream_options={"include_usage": True})
            try:
                async for event in stream:
                    if event.choices and (event.choices[0].delta.content if not args.max_tokens else event.choices[0].text):
                        events.append(time.time())
                    finished = finished or bool(event.choices and event.choices[0].finish_reason)
                    usage = event.usage or usage
                    if time.time() > stop_at:
                        break  # cut off by the window (the disconnect cancels it): latencies count, the request does not
            finally:
                await stream.close()
        except openai.APIError as error:  # counted, not fatal: one failed request must not end the run and its figures
            record["errors"] += 1
            if len(record["error_examples"]) < 3:
                record["error_examples"].append(f"{type(error).__name__}: {error}"[:300])
            await asyncio.sleep(0.05)  # a server refusing everything is not hammered in a tight loop
            continue
        inside = [t for t in events if t >= window_start]
        if events and started >= window_start:
            record["ttft"].append(events[0] - started)
        record["itl"].extend(np.diff(inside).tolist())
        record["events"] += len(inside)
        if finished and usage is not None and events and started >= window_start and events[-1] <= stop_at:
            record["requests"] += 1
            if usage.completion_tokens > 1 and len(events) > 1:
                record["tpot"].append((events[-1] - events[0]) / (usage.completion_tokens - 1))


async def clients_part(base: str, model: str, prompts: list[str], indices: list[int], clients: int, args, window: tuple[float, float]) -> dict:
    import openai

    record = {"requests": 0, "events": 0, "ttft": [], "itl": [], "tpot": [], "errors": 0, "error_examples": []}
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=600)
    try:
        await asyncio.gather(*(client_loop(client, model, prompts, i, clients, args, window, record) for i in indices))
    finally:
        await client.close()
    return record


def client_process(conn, base: str, model: str, prompts: list[str], indices: list[int], clients: int, args) -> None:
    """One client process: imports, says ready, gets the window, runs its share of the clients on one event loop."""
    import openai  # noqa: F401  (imported before "ready": the window starts with every process loaded)

    if getattr(args, "client_cpus", None):
        os.sched_setaffinity(0, args.client_cpus)

    conn.send("ready")
    window = conn.recv()
    conn.send(asyncio.run(clients_part(base, model, prompts, indices, clients, args, window)))
    conn.close()


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` (all its threads) so far; None where /proc has no such
    process (not Linux, or it exited)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14, 15)


def schedstat(pid: int, tid: int) -> tuple[int, int] | None:
    """(ns on a CPU, ns runnable but waiting for one) of thread ``tid`` of ``pid`` so far (Linux
    /proc/.../schedstat); None where unknown."""
    try:
        run, wait = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return int(run), int(wait)


def thread_stats(pid: int | None) -> dict[int, tuple[int, int]]:
    """``schedstat`` of every thread of ``pid`` now, by thread id ({} where unknown)."""
    try:
        tids = [int(task.name) for task in Path(f"/proc/{pid}/task").iterdir()] if pid is not None else []
    except OSError:
        return {}
    return {tid: stat for tid in tids if (stat := schedstat(pid, tid)) is not None}


def thread_shares(pid: int | None, before: dict[int, tuple[int, int]], seconds: float) -> dict[str, float | None]:
    """The busiest thread of ``pid`` over the window (in the serving process: the serving loop's): its share
    of the window on a CPU and runnable but waiting for one (%). A thread that should run all the time and
    waits instead lost its core to another thread or process."""
    after = thread_stats(pid)
    deltas = [(now[0] - before[tid][0], now[1] - before[tid][1]) for tid, now in after.items() if tid in before]
    if not deltas:
        return {"serving_thread_run_pct": None, "serving_thread_wait_pct": None}
    run, wait = max(deltas)
    return {"serving_thread_run_pct": round(100.0 * run / 1e9 / seconds, 1), "serving_thread_wait_pct": round(100.0 * wait / 1e9 / seconds, 1)}


def children(pid: int) -> list[int]:
    """The child processes of ``pid`` (Linux /proc; [] elsewhere)."""
    try:
        return [int(c) for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()]
    except OSError:
        return []


def cpu_shares(pids: dict[str, list[int]], before: dict[int, float | None], seconds: float) -> dict[str, float | None]:
    """Per role, the busiest process's CPU over the window in % of one core (100: a process that never
    waited), all the role's processes together (``_total``) and, where it has several, each one's, busiest
    first (``_each``: for the fronts, how evenly the work of the connections the kernel handed each one spread)."""
    shares = {}
    for role, members in pids.items():
        used = [(cpu_seconds(p) or 0.0) - before[p] for p in members if before.get(p) is not None]
        shares[f"{role}_cpu_pct"] = round(100.0 * max(used) / seconds, 1) if used else None
        shares[f"{role}_cpu_total_pct"] = round(100.0 * sum(used) / seconds, 1) if used else None
        if len(used) > 1:
            shares[f"{role}_cpu_each_pct"] = sorted((round(100.0 * u / seconds, 1) for u in used), reverse=True)
    return shares


def server_roles(server: int, log: Path) -> dict[str, list[int]]:
    """The server's processes by role: the serving process (named in its log) and the HTTP fronts (the
    server's own process and its other children: ``--fronts``)."""
    found = re.search(r"serving process (\d+) loaded", log.read_text())
    serving = [int(found.group(1))] if found else []
    return {"front": [server] + [p for p in children(server) if p not in serving], "serving": serving}


def load(base: str, args, prompts: list[str], clients: int, roles: dict[str, list[int]], profile: Path | None = None) -> dict:
    """``clients`` streaming clients: warm-up, then the measured window; the window's figures. ``profile``: a
    folder for py-spy's samples of the serving process over the window (its serving thread's profile joins
    the figures); None: not sampled."""
    import openai

    sync = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=600)
    model = sync.models.list().data[0].id
    sync.completions.create(model=model, prompt=prompts[0], max_tokens=8, temperature=0)  # first-call costs outside the window
    procs = max(1, min(args.client_procs, clients))
    context = multiprocessing.get_context("spawn")
    pipes, workers = [], []
    for i in range(procs):
        mine, theirs = context.Pipe()
        worker = context.Process(target=client_process, args=(theirs, base, model, prompts, list(range(i, clients, procs)), clients, args))
        worker.start()
        pipes.append(mine)
        workers.append(worker)
    for pipe in pipes:
        assert pipe.recv() == "ready"
    window_start = time.time() + args.warmup_seconds
    window = (window_start, window_start + args.seconds)
    for pipe in pipes:
        pipe.send(window)
    # Whose CPU is the limit: the server's process (the HTTP front), its children (the serving process), the clients.
    pids = roles | {"client": [w.pid for w in workers]}
    time.sleep(max(0.0, window_start - time.time()))
    before = server_metrics(base)
    cpu_before = {p: cpu_seconds(p) for members in pids.values() for p in members}
    serving_pid = roles["serving"][0] if roles["serving"] else None
    threads_before = thread_stats(serving_pid)
    spy = None
    if profile is not None and serving_pid is not None:  # the serving thread sampled over the window
        raw = profile / f"serving_profile_{serving_pid}_{clients}.raw"
        spy = (thread_profile.record(serving_pid, args.seconds, raw, gil=args.profile_serving == "gil"), raw)
    time.sleep(max(0.0, window[1] - time.time()))
    shares = cpu_shares(pids, cpu_before, args.seconds) | thread_shares(serving_pid, threads_before, args.seconds)
    after = server_metrics(base)
    records = [pipe.recv() for pipe in pipes]
    for worker in workers:
        worker.join(60)
    profiled = {} if spy is None else {"serving_profile": thread_profile.finish(*spy, top=40, gil=args.profile_serving == "gil")}
    return figures(records, before, after, window[1] - window[0]) | shares | profiled


def figures(records: list[dict], before: dict, after: dict, seconds: float) -> dict:
    merged = {key: sum((r[key] for r in records), [] if key not in ("requests", "events") else 0) for key in ("requests", "events", "ttft", "itl", "tpot")}
    cycles = after["dflash_trt_cycles_total"] - before["dflash_trt_cycles_total"]
    tokens = after["dflash_trt_output_tokens_total"] - before["dflash_trt_output_tokens_total"]  # partial requests too
    return {
        "requests": merged["requests"],
        "errors": sum(r["errors"] for r in records),  # requests that failed (an HTTP error or a broken stream), any time in the run
        "error_examples": [example for r in records for example in r["error_examples"]][:3],
        "events": merged["events"],  # stream events with text the clients received inside the window
        "output_tokens": int(tokens),
        "seconds": round(seconds, 3),
        "requests_per_s": round(merged["requests"] / seconds, 3),
        "output_tokens_per_s": round(tokens / seconds, 2),
        "ttft_p50_ms": _ms(merged["ttft"], 50),
        "ttft_p99_ms": _ms(merged["ttft"], 99),
        "itl_p50_ms": _ms(merged["itl"], 50),
        "itl_p99_ms": _ms(merged["itl"], 99),
        "tpot_p50_ms": _ms(merged["tpot"], 50),
        "tpot_p99_ms": _ms(merged["tpot"], 99),
        # The server's own view (its histograms between the window's two scrapes; buckets ~25-33% apart):
        **{f"server_{key}_p99_ms": _bucket_ms(0.99, f"dflash_trt_{metric}", before, after)
           for key, metric in (("ttft", "time_to_first_token_seconds"), ("itl", "inter_token_latency_seconds"))},
        "executes": int(after["dflash_trt_executes_total"] - before["dflash_trt_executes_total"]),
        "cycles": int(cycles),
        "tau": round(after["dflash_trt_acceptance_length"], 3) if cycles else None,  # since the server started (warm-up included)
        **{f"policy_{kind}s": int(after.get(f"dflash_trt_policy_choices_total[{kind}]", 0) - before.get(f"dflash_trt_policy_choices_total[{kind}]", 0))
           for kind in ("cycle", "decode")},
        # The device's busy share: its loop launches' device time over the window (counted as each execute ends).
        "device_busy_pct": round(100.0 * (after["dflash_trt_device_seconds_total"] - before["dflash_trt_device_seconds_total"]) / seconds, 1)
        if "dflash_trt_device_seconds_total" in after else None,
        **launch_shape(before, after, seconds),
    }


def _bucket_ms(q: float, name: str, before: dict, after: dict) -> float | None:
    seconds = histogram_quantile(q, name, before, after)
    return None if seconds is None else round(seconds * 1000.0, 2)


def launch_shape(before: dict, after: dict, seconds: float) -> dict:
    """The engine's loop launches in the window (two /metrics scrapes): per second, rounds per launch, lanes per
    round (None for a server without these counters)."""
    if "dflash_trt_loop_launches_total" not in after:
        return {"launches_per_s": None, "rounds_per_launch": None, "lanes_per_round": None}
    launches, rounds, lanes = (after[f"dflash_trt_{name}_total"] - before.get(f"dflash_trt_{name}_total", 0.0)
                               for name in ("loop_launches", "loop_rounds", "lane_rounds"))
    return {"launches_per_s": round(launches / seconds, 1), "rounds_per_launch": round(rounds / launches, 2) if launches else None,
            "lanes_per_round": round(lanes / rounds, 2) if rounds else None}


def _ms(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)) * 1000.0, 2) if values else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[8], help="concurrent clients; several counts run one after the other on each server")
    parser.add_argument("--seconds", type=float, default=30.0, help="measured window per client count")
    parser.add_argument("--warmup-seconds", type=float, default=5.0, help="full load before each window (not measured)")
    parser.add_argument("--max-tokens", type=int, default=64,
                        help="tokens asked per request (0: none asked, each request a chat request running to the context's end unless it stops)")
    parser.add_argument("--temperature", type=float, default=0.0, help="the requests' temperature (default 0: greedy; > 0 samples)")
    parser.add_argument("--max-sessions", type=int, default=16)
    parser.add_argument("--modes", nargs="+", choices=tuple(MODES), default=["on", "off"])
    parser.add_argument("--policy", choices=POLICIES, default="adaptive", help="the server's --policy in mode on (default adaptive)")
    parser.add_argument("--artifacts", type=Path, help="serve this export/engine dir (default: the embedded pair)")
    parser.add_argument("--backend", default="onnxruntime")
    parser.add_argument("--device", help="the server's --device (cpu, cuda)")
    parser.add_argument("--serve-args", default="", help="more dflash-trt serve flags, one string")
    parser.add_argument("--threads", type=int, help="server CPU threads (ONNX Runtime / torch)")
    parser.add_argument("--client-procs", type=int, default=1, help="client processes (each an event loop over its share of clients)")
    parser.add_argument("--prompt-chars", type=int, default=600, help="keep the last N characters of each prompt")
    parser.add_argument("--server-logs", type=Path, default=Path(tempfile.gettempdir()), help="where each server's output goes (serve_load_PORT.log)")
    parser.add_argument("--fronts", nargs="+", choices=tuple(FRONTS), default=["process"],
                        help="process: the HTTP front in its own process (serve's default); single: --no-front-process "
                             "(serve's --fronts N, several front processes, goes in --serve-args)")
    parser.add_argument("--profile-serving", nargs="?", const="thread", choices=("thread", "gil"),
                        help="sample the serving process with py-spy over each window; print its serving thread's profile "
                             "(thread, the default) or every thread's share of the GIL and where it goes (gil)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run every mode's windows this many times, the modes interleaved (on, off, on, off, ...; each "
                             "repeat restarts the servers): windows of one build differ by up to a third, so a ratio from one "
                             "window pair decides little; the summary gives the medians and the spread of each repeat's ratio")
    parser.add_argument("--keep-servers", action="store_true",
                        help="start every mode's server once and alternate the modes' windows per client count --repeats times "
                             "(servers kept running between windows) instead of restarting the servers for each repeat")
    parser.add_argument("--client-cores", type=int,
                        help="pin the client processes to this many whole physical cores (Linux) and the server to the others: "
                             "on one host, a client on the serving thread's core measures their contention, not the server")
    parser.add_argument("--record", action="store_true", help="append rows to benchmarks/results.jsonl")
    args = parser.parse_args()
    args.server_cpus, args.client_cpus = split_cores(cpu_cores(), args.client_cores) if args.client_cores else (None, None)
    rows = [json.loads(line) for line in (ROOT / "export" / "default_pair" / "prompts.jsonl").read_text().splitlines() if line.strip()]
    prompts = [row["prompt"][-args.prompt_chars :] for row in rows]
    results = {}
    print("| front | mode | clients | requests/s | output tokens/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | TPOT p50 / p99 ms | server TTFT / ITL p99 ms | τ | policy cycles / decodes | device busy % | launches/s / rounds per launch / lanes per round | CPU % front / serving / client "
          "| serving thread run / wait % |\n" + "|" + " --- |" * 15, flush=True)
    if args.keep_servers:
        servers: dict[tuple[str, str], Server] = {}
        try:
            for front, mode in ((front, mode) for front in args.fronts for mode in args.modes):
                servers[front, mode] = Server(*start_server(args, [*FRONTS[front], *MODES[mode]]))
            for clients in args.clients:
                for repeat in range(1, args.repeats + 1):
                    for (front, mode), server in servers.items():
                        window(args, prompts, results, server, front, mode, clients, repeat)
        finally:
            for server in servers.values():
                server.stop()
    else:
        for repeat, front, mode in ((r, front, mode) for r in range(1, args.repeats + 1) for front in args.fronts for mode in args.modes):
            server = Server(*start_server(args, [*FRONTS[front], *MODES[mode]]))
            try:
                for clients in args.clients:
                    window(args, prompts, results, server, front, mode, clients, repeat)
            finally:
                server.stop()
    ratios = ratio_rows(list(results.values()))
    if ratios:
        print("\n| front | mode | clients | windows | median tok/s | off median tok/s | median / off median | per-repeat ratio min – max "
              "| client-bound windows (mode / off) |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for row in ratios:
            print(f"| {row['front']} | {row['mode']} | {row['clients']} | {row['windows']} | {row['median']} | {row['off_median']} "
                  f"| {row['ratio']}× | {row['ratio_min']}× – {row['ratio_max']}× | {row['client_bound'][0]} / {row['client_bound'][1]} |", flush=True)
    summary = {"name": "serve_load", "date": time.strftime("%Y-%m-%d"), "machine": machine(),
               "command": " ".join(["python", "benchmarks/serve_load.py", *sys.argv[1:]]), "seconds": args.seconds, "warmup_seconds": args.warmup_seconds,
               "max_tokens": args.max_tokens, "temperature": args.temperature, "max_sessions": args.max_sessions, "backend": args.backend, "device": args.device,
               "policy": args.policy, "repeats": args.repeats, "keep_servers": args.keep_servers, "client_cores": args.client_cores,
               "client_cpus": sorted(args.client_cpus) if args.client_cpus else None, "runs": results, "ratios": ratios}
    if args.record:
        record.append_rows({**{k: v for k, v in summary.items() if k != "runs"}, "name": f"serve_load_{figures['mode']}", **figures}
                           for figures in results.values())
    print(json.dumps(summary))
    return 0


class Server:
    """One running ``dflash-trt serve`` of the benchmark: its process, base URL and log, and its failed requests."""

    def __init__(self, process: subprocess.Popen, base: str, log: Path) -> None:
        self.process, self.base, self.log = process, base, log
        self.failed = 0

    def stop(self) -> None:
        """SIGINT, wait, then its log's serving line (and, after failed requests, its log from the first warning)."""
        self.process.send_signal(signal.SIGINT)
        self.process.wait(60)
        lines = self.log.read_text().splitlines()
        print(next((line for line in lines if " serving " in line), "no serving line in the log"), flush=True)
        if self.failed:
            first = next((i for i, line in enumerate(lines) if line.startswith(("WARNING", "ERROR"))), len(lines))
            shown = "\n".join(lines[first : first + 80]) or "(none)"
            print(f"the server's log from its first warning or error:\n{shown}", flush=True)


def window(args, prompts: list[str], results: dict, server: Server, front: str, mode: str, clients: int, repeat: int) -> None:
    """One measured window of ``clients`` on ``server``: its table row printed, its figures into ``results``."""
    figures = load(server.base, args, prompts, clients, server_roles(server.process.pid, server.log), args.server_logs if args.profile_serving else None)
    load_share = client_load(figures.get("client_cpu_total_pct"), args.client_cores)
    figures |= {"client_load": load_share, "client_bound": load_share is not None and load_share >= CLIENT_BOUND}
    key = f"{front}_{mode}_{clients}" + (f"_r{repeat}" if args.repeats > 1 else "")
    results[key] = {"front": front, "mode": mode, "clients": clients, "repeat": repeat, **figures}
    print(f"| {front} | {mode} | {clients} | {figures['requests_per_s']} | {figures['output_tokens_per_s']} | {figures['ttft_p50_ms']} / {figures['ttft_p99_ms']} "
          f"| {figures['itl_p50_ms']} / {figures['itl_p99_ms']} | {figures['tpot_p50_ms']} / {figures['tpot_p99_ms']} "
          f"| {figures['server_ttft_p99_ms']} / {figures['server_itl_p99_ms']} | {figures['tau']} "
          f"| {figures['policy_cycles']} / {figures['policy_decodes']} | {figures['device_busy_pct']} "
          f"| {figures['launches_per_s']} / {figures['rounds_per_launch']} / {figures['lanes_per_round']} "
          f"| {figures['front_cpu_pct']} / {figures['serving_cpu_pct']} / {figures['client_cpu_pct']} "
          f"| {figures['serving_thread_run_pct']} / {figures['serving_thread_wait_pct']} |", flush=True)
    if figures["client_bound"]:
        print(f"  the clients used {100 * load_share:.0f}% of their {args.client_cores} cores: this window measured the load generator's "
              "limit as much as the server's (more --client-cores)", flush=True)
    server.failed += figures["errors"]
    if figures["errors"]:
        print(f"  {figures['errors']} failed requests at {clients} clients, e.g. {figures['error_examples'][0]}", flush=True)
    if "serving_profile" in figures:
        print(f"\n{front} {mode} {clients} clients: " + thread_profile.table(figures["serving_profile"]) + "\n", flush=True)


CLIENT_BOUND = 0.9  # a window whose pinned clients used this share of their cores measured the load generator too


def client_load(client_cpu_total_pct: float | None, client_cores: int | None) -> float | None:
    """The client processes' CPU over a window (% of one CPU, all of them) as a share of the physical cores they were
    pinned to (``--client-cores``; a core's hyperthreads count as that core: the share may pass 1 on such hosts); None
    when they were not pinned (they then share the host with the server: no capacity of their own to compare with).

    >>> client_load(387.4, 4), client_load(230.0, 4), client_load(230.0, None)
    (0.968, 0.575, None)
    """
    if not client_cores or client_cpu_total_pct is None:
        return None
    return round(client_cpu_total_pct / (100.0 * client_cores), 3)


def ratio_rows(runs: list[dict]) -> list[dict]:
    """Each drafting mode's windows against mode ``off``'s, per (front, clients): the median tokens/s of each,
    the ratio of the medians, and the smallest and largest ratio of one repeat's two windows.

    >>> runs = [dict(front="p", mode=m, clients=4, repeat=r, output_tokens_per_s=t)
    ...         for m, r, t in [("on", 1, 30.0), ("off", 1, 20.0), ("on", 2, 33.0), ("off", 2, 30.0), ("on", 3, 36.0), ("off", 3, 24.0)]]
    >>> ratio_rows(runs)
    [{'front': 'p', 'mode': 'on', 'clients': 4, 'windows': 3, 'median': 33.0, 'off_median': 24.0, 'ratio': 1.375, 'ratio_min': 1.1, 'ratio_max': 1.5, 'client_bound': [0, 0]}]

    ``client_bound``: how many of those windows, the mode's and ``off``'s, had their clients at ``CLIENT_BOUND``
    of their CPUs or more (their ratio measures the load generator's limit as much as the server's).
    """
    rate = {(r["front"], r["mode"], r["clients"], r["repeat"]): r["output_tokens_per_s"] for r in runs}
    bound = {(r["front"], r["mode"], r["clients"], r["repeat"]): r.get("client_bound") for r in runs}
    rows = []
    for front, mode, clients in sorted({(f, m, c) for f, m, c, _ in rate if m != "off"}, key=lambda key: (key[0], key[1], key[2])):
        repeats = sorted(r for f, m, c, r in rate if (f, m, c) == (front, mode, clients) and (front, "off", clients, r) in rate)
        if not repeats:
            continue
        mine = [rate[front, mode, clients, r] for r in repeats]
        off = [rate[front, "off", clients, r] for r in repeats]
        each = [a / b for a, b in zip(mine, off)]
        rows.append({"front": front, "mode": mode, "clients": clients, "windows": len(repeats), "median": float(np.median(mine)),
                     "off_median": float(np.median(off)), "ratio": round(float(np.median(mine) / np.median(off)), 3),
                     "ratio_min": round(min(each), 3), "ratio_max": round(max(each), 3),
                     "client_bound": [sum(bool(bound[front, m, clients, r]) for r in repeats) for m in (mode, "off")]})
    return rows


def machine() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.get_device_name(0)}, {os.cpu_count()} CPUs, torch {torch.__version__}"
    except ImportError:
        pass
    return f"{platform.machine()} {os.cpu_count()} CPUs"


if __name__ == "__main__":
    sys.exit(main())
