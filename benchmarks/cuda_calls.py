"""Host µs per call of the device layer's CUDA calls (runtime/device.py) against their driver-API and torch twins.

    python benchmarks/cuda_calls.py [--calls 20000] [--busy] [--record]

The serving thread makes a few CUDA calls per launch (the staging upload, the verdicts' download into pinned
memory, event records and queries); a py-spy profile of the serving process at 64 streams on the H200 showed
~24% of the serving thread inside ``device.cuda_call``. This times each call alone, on a non-blocking stream:
``cudaMemcpyAsync`` (cudaMemcpyDefault: the kind looked up from the pointers) host -> device and device -> host of
4 KiB through ``cuda_call`` and raw, the driver's ``cuMemcpyHtoDAsync`` / ``cuMemcpyDtoHAsync``, event record
and query (runtime and driver), and torch's ``copy_(non_blocking=True)`` from pinned memory. ``--busy``: with a
~1 ms kernel queued on the stream before every three calls (they enqueue behind work, as a launch's do).
Prints a table and ends with one JSON line; ``--record`` appends it to benchmarks/results.jsonl.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import record  # noqa: E402  (benchmarks/record.py: results.jsonl)

NBYTES = 4096


def per_call_us(call, calls: int, stream, busy: bool) -> float:
    """Host µs per call: the median over 5 batches of ``calls // 5`` calls (the stream drained between batches);
    ``busy``: the median over ``calls // 20`` rounds of a ~1 ms kernel queued, then 3 calls timed one by one (as
    a launch's copies and records follow its replay; a batch behind one long kernel would time the queue's limit)."""
    import torch

    if busy:
        times = []
        for _ in range(calls // 20):
            torch.cuda._sleep(2_000_000)  # ~1 ms of spinning queued ahead of the calls (the caller's current stream is ``stream``)
            for _ in range(3):
                began = time.perf_counter()
                call()
                times.append((time.perf_counter() - began) * 1e6)
            stream.synchronize()
        return statistics.median(times)
    batches = []
    for _ in range(5):
        began = time.perf_counter()
        for _ in range(calls // 5):
            call()
        batches.append((time.perf_counter() - began) / (calls // 5) * 1e6)
        stream.synchronize()
    return statistics.median(batches)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--busy", action="store_true", help="each call behind a ~1 ms kernel queued on the stream")
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()
    import torch

    from dflash_trt.runtime import device
    from dflash_trt.runtime.device import PinnedBuffer, _bindings, cuda_call

    runtime, driver = _bindings()
    torch.cuda.init()
    stream, event = device.Stream(), device.Event(timing=False)
    pinned = PinnedBuffer((NBYTES,), torch.uint8)
    target = torch.zeros(NBYTES, dtype=torch.uint8, device="cuda")
    host = pinned.as_tensor()
    dst, src = target.data_ptr(), pinned.ptr
    default = runtime.cudaMemcpyKind.cudaMemcpyDefault
    cu_stream, cu_event = driver.CUstream(stream.ptr), driver.CUevent(int(event.handle))
    cu_dst = driver.CUdeviceptr(dst)
    torch_stream = torch.cuda.ExternalStream(stream.ptr)
    calls = {
        "cuda_call cudaMemcpyAsync H2D": lambda: cuda_call("cudaMemcpyAsync", dst, src, NBYTES, default, stream.handle),
        "cuda_call cudaMemcpyAsync D2H": lambda: cuda_call("cudaMemcpyAsync", src, dst, NBYTES, default, stream.handle),
        "raw cudaMemcpyAsync H2D": lambda: runtime.cudaMemcpyAsync(dst, src, NBYTES, default, stream.handle),
        "raw cuMemcpyHtoDAsync": lambda: driver.cuMemcpyHtoDAsync(cu_dst, src, NBYTES, cu_stream),
        "raw cuMemcpyDtoHAsync": lambda: driver.cuMemcpyDtoHAsync(src, cu_dst, NBYTES, cu_stream),
        "raw cuMemcpyAsync": lambda: driver.cuMemcpyAsync(dst, src, NBYTES, cu_stream),
        "cuda_call cudaEventRecord": lambda: cuda_call("cudaEventRecord", event.handle, stream.handle),
        "raw cuEventRecord": lambda: driver.cuEventRecord(cu_event, cu_stream),
        "cuda_call cudaEventQuery": lambda: cuda_call("cudaEventQuery", event.handle, accept=("cudaErrorNotReady",)),
        "raw cuEventQuery": lambda: driver.cuEventQuery(cu_event),
        "torch copy_ non_blocking H2D": lambda: target.copy_(host, non_blocking=True),
    }
    rows = []
    with torch.cuda.stream(torch_stream):
        for name, call in calls.items():
            call()
            stream.synchronize()
            us = per_call_us(call, args.calls, stream, args.busy)
            rows.append({"call": name, "us": round(us, 3)})
            print(f"| {name} | {us:.2f} |", flush=True)
    summary = {"name": "cuda_calls", "busy": args.busy, "calls": args.calls, "rows": rows,
               "machine": torch.cuda.get_device_name(), "torch": torch.__version__}
    return record.finish(summary, args.record)


if __name__ == "__main__":
    sys.exit(main())
