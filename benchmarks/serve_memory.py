"""What each process of ``dflash-trt serve --fronts N`` holds in memory, and which of them load torch.

A server with N HTTP fronts is N + 1 processes (and multiprocessing's resource tracker): the first front
(the command's own process, which also starts the others), the serving process (the runtime, the backend,
the caches) and N − 1 extra fronts, each of which only parses HTTP, (de)tokenizes and streams. This starts
one such server (serve_load's ``start_server``: any backend, device or serve flags), sends ``--requests``
completions so every process has served, then reads each process's resident memory (``VmRSS``) and whether
torch's libraries are mapped in it (``/proc/PID/maps``), and stops the server with SIGINT.

    python benchmarks/serve_memory.py [--fronts 4] [--backend onnxruntime] [--device cuda] [--serve-args "..."]
        [--requests 16] [--record]

Prints a table and ends with one JSON line; ``--record`` appends it to benchmarks/results.jsonl. Linux only
(``/proc``).
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import signal
import sys
import tempfile
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import record  # benchmarks/record.py: results.jsonl
import serve_load  # start_server

MODEL = "dflash-trt-default-pair"


def rss_mib(pid: int) -> float:
    """A process's resident memory (``VmRSS``) in MiB."""
    kib = re.search(r"^VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.M)
    return round(int(kib.group(1)) / 1024, 1)


def loads_torch(pid: int) -> bool:
    """Whether torch's shared libraries are mapped in the process (it imported torch)."""
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def processes(server_pid: int, log: str) -> list[tuple[str, int]]:
    """(role, pid) of the server's processes, from its log lines."""
    serving = re.search(r"serving process (\d+) loaded", log)
    roles = [("first front", server_pid)] + ([("serving process", int(serving.group(1)))] if serving else [])
    extra = sorted((int(index), int(pid)) for index, pid in re.findall(r"HTTP front (\d+) \(pid (\d+)\) serving", log))
    return roles + [(f"front {index}", pid) for index, pid in extra]


def complete(base: str, index: int) -> int:
    """One short greedy completion on a connection of its own: its HTTP status."""
    body = json.dumps({"model": MODEL, "prompt": f"def f{index}(x):", "max_tokens": 8, "temperature": 0}).encode()
    request = urllib.request.Request(base + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return response.status


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fronts", type=int, default=4, help="serve --fronts (default 4)")
    parser.add_argument("--backend", default="onnxruntime")
    parser.add_argument("--device", help="serve --device")
    parser.add_argument("--max-sessions", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="serve --threads")
    parser.add_argument("--serve-args", default="", help="more dflash-trt serve flags, one string")
    parser.add_argument("--requests", type=int, default=16, help="completions sent before measuring (spread over the fronts)")
    parser.add_argument("--record", action="store_true", help="append the JSON line to benchmarks/results.jsonl")
    args = parser.parse_args()
    server_args = argparse.Namespace(max_sessions=args.max_sessions, backend=args.backend, serve_args=args.serve_args,
                                     policy="adaptive", artifacts=None, device=args.device, threads=args.threads,
                                     server_logs=Path(tempfile.mkdtemp(prefix="serve_memory_")))
    process, base, log = serve_load.start_server(server_args, ["--fronts", str(args.fronts)])
    try:
        with ThreadPoolExecutor(8) as pool:
            statuses = list(pool.map(lambda i: complete(base, i), range(args.requests)))
        rows = [(role, pid, rss_mib(pid), loads_torch(pid)) for role, pid in processes(process.pid, log.read_text())]
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(60)

    print("| process | pid | RSS MiB | torch loaded |\n| --- | --- | --- | --- |")
    for role, pid, rss, torch in rows:
        print(f"| {role} | {pid} | {rss} | {'yes' if torch else 'no'} |")
    extra = [row for row in rows if row[0].startswith("front ")]
    summary = {
        "name": "serve_memory", "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "command": "python benchmarks/serve_memory.py " + " ".join(sys.argv[1:]), "fronts": args.fronts,
        "backend": args.backend, "requests_ok": statuses.count(200), "requests": args.requests,
        "rss_mib": {role: rss for role, _, rss, _ in rows},
        "extra_front_rss_mib_mean": round(sum(r[2] for r in extra) / len(extra), 1) if extra else None,
        "torch_loaded": {role: torch for role, _, _, torch in rows},
    }
    return record.finish(summary, args.record)


if __name__ == "__main__":
    sys.exit(main())
