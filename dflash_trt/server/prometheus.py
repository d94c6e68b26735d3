"""``GET /metrics``: the serving loop's metrics snapshot as Prometheus families (prometheus-client).

One ``ServingLoop.metrics()`` call per scrape feeds every family, so a scrape is
consistent. Latency windows are exposed as gauges with a ``quantile`` label
(seconds): ``dflash_trt_time_to_first_token_seconds{quantile="0.99"}``.

| family | kind | labels |
| --- | --- | --- |
| dflash_trt_requests_running / _queued | gauge | model |
| dflash_trt_requests_total | counter | model, outcome (submitted, completed, cancelled, failed, rejected) |
| dflash_trt_prompt_tokens_total / _output_tokens_total | counter | model |
| dflash_trt_output_tokens_per_second | gauge (trailing window) | model |
| dflash_trt_cycles_total, dflash_trt_executes_total, dflash_trt_failed_executes_total | counter | model |
| dflash_trt_acceptance_length | gauge (τ, bonus included) | model |
| dflash_trt_queue_wait_seconds, _time_to_first_token_seconds, _inter_token_latency_seconds | gauge | model, quantile |
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from dflash_trt.runtime.serving.loop import ServingLoop
from dflash_trt.runtime.serving.metrics import OUTCOMES, Percentiles

PREFIX = "dflash_trt"


class ServingCollector(Collector):
    def __init__(self, serving: ServingLoop, model: str) -> None:
        self.serving, self.model = serving, model

    def collect(self):
        m = self.serving.metrics()
        yield self._gauge("requests_running", "Requests holding a session", m.running)
        yield self._gauge("requests_queued", "Accepted requests waiting for a session", m.queued)
        requests = CounterMetricFamily(f"{PREFIX}_requests", "Requests by outcome", labels=["model", "outcome"])
        for outcome in ("submitted", *OUTCOMES):
            requests.add_metric([self.model, outcome], getattr(m, outcome))
        yield requests
        yield self._counter("prompt_tokens", "Prompt tokens of submitted requests", m.prompt_tokens)
        yield self._counter("output_tokens", "Tokens delivered to requests", m.output_tokens)
        yield self._gauge("output_tokens_per_second", "Delivered tokens per second over the trailing window", m.output_tokens_per_s)
        yield self._counter("cycles", "Speculative owner-cycles (draft + verify)", m.cycles)
        yield self._counter("executes", "Executor batches run", m.executes)
        yield self._counter("failed_executes", "Executor batches that failed (their requests failed)", m.failed_executes)
        yield self._gauge("acceptance_length", "Mean tokens per cycle (tau), bonus included; NaN before the first cycle", m.tau if m.tau is not None else float("nan"))
        yield self._quantiles("queue_wait_seconds", "Submit to joining a batch", m.queue_wait_s)
        yield self._quantiles("time_to_first_token_seconds", "Submit to the first delivered tokens", m.ttft_s)
        yield self._quantiles("inter_token_latency_seconds", "Gap between two deliveries of a request", m.itl_s)

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=["model"])
        family.add_metric([self.model], value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=["model"])
        family.add_metric([self.model], value)
        return family

    def _quantiles(self, name: str, doc: str, window: Percentiles) -> GaugeMetricFamily:
        family = GaugeMetricFamily(f"{PREFIX}_{name}", f"{doc} (seconds, recent window)", labels=["model", "quantile"])
        for quantile, value in (("0.5", window.p50), ("0.9", window.p90), ("0.99", window.p99)):
            family.add_metric([self.model, quantile], value if value is not None else float("nan"))
        return family
