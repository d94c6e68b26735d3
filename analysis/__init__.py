"""Analysis of the runtime's stats tables (``runtime/stats.py``), one module per concern.

| module | owns |
| --- | --- |
| load | validated lazy scans (``scan_stats``, ``scan_run``), the X.parquet / X.executes.parquet pair |
| acceptance | τ overall / by key / rolling, acceptance-length histogram, per-position acceptance |
| throughput | per-call de-duplication (``calls``), tokens/s, latency by phase |
| drafting | static / dynamic / target mode share, context rows drained |
| counters | per-execute counter totals and their cross-check against the cycles table |
| compare | one summary row per run, speedup against a baseline |
| plots | PNGs of the collected tables (matplotlib, Agg canvas) |
| report | everything collected at once (``summarize``), Markdown, CSV, headline JSON |
| command | ``dflash-trt report`` |

Every analysis function takes and returns Polars LazyFrames; only ``report``
(and ``load.in_call_order``) collect.
"""
