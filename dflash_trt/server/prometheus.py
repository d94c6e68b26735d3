"""``GET /metrics``: the serving loop's metrics snapshot as Prometheus families (prometheus-client).

One ``ServingLoop.metrics()`` call per scrape feeds every family, so a scrape is
consistent. Latencies are histograms (seconds, cumulative since start, the
buckets of ``runtime.serving.metrics.LATENCY_BUCKETS_S``), as vLLM exposes
them: ``histogram_quantile(0.99, rate(dflash_trt_time_to_first_token_seconds_bucket[1m]))``.

| family | kind | labels |
| --- | --- | --- |
| dflash_trt_requests_running / _queued | gauge | model |
| dflash_trt_requests_total | counter | model, outcome (submitted, completed, cancelled, failed, rejected) |
| dflash_trt_prompt_tokens_total / _output_tokens_total | counter | model |
| dflash_trt_output_tokens_per_second | gauge (trailing window) | model |
| dflash_trt_cycles_total, dflash_trt_executes_total, dflash_trt_failed_executes_total | counter | model |
| dflash_trt_acceptance_length | gauge (τ, bonus included) | model |
| dflash_trt_policy_choices_total | counter (drafting lanes' launches, ``runtime.policy``) | model, choice (cycle, decode) |
| dflash_trt_policy_verified_proposals_total | counter (proposals the policy's cycles verified: Σ verify length k; over ``choice="cycle"``, the mean k) | model |
| dflash_trt_drafting_stopped_total | counter (sessions that stopped drafting for good: decode by estimate, cycling losing) | model |
| dflash_trt_device_seconds_total | counter (device time of the engine's loop launches: ``rate()`` of it is how busy the device runs) | model |
| dflash_trt_loop_launches_total, _loop_rounds_total, _lane_rounds_total | counter (the engine's loop launches, the rounds they ran, the lanes' rounds in them: rounds per launch and lanes per round, the launches' shape under load) | model |
| dflash_trt_queue_wait_seconds, _time_to_first_token_seconds, _inter_token_latency_seconds, _e2e_request_latency_seconds | histogram | model, le |
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.registry import Collector

from dflash_trt.runtime.serving.metrics import OUTCOMES, Histogram

if TYPE_CHECKING:  # a front process scrapes a ServingClient and never imports the runtime (torch)
    from dflash_trt.runtime.serving.loop import ServingLoop

PREFIX = "dflash_trt"
HISTOGRAMS = (  # (family, help, ServingMetrics.histograms key)
    ("queue_wait_seconds", "Submit to joining a batch", "queue_wait_s"),
    ("time_to_first_token_seconds", "Submit to the first delivered tokens", "ttft_s"),
    ("inter_token_latency_seconds", "Gap between two deliveries of a request", "itl_s"),
    ("e2e_request_latency_seconds", "Submit to the end of a request (finished or cancelled)", "e2e_s"),
)


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
        choices = CounterMetricFamily(f"{PREFIX}_policy_choices", "Drafting lanes' launches by the speculation policy's choice", labels=["model", "choice"])
        for choice, count in sorted(m.policy_choices.items()):
            choices.add_metric([self.model, choice], count)
        yield choices
        yield self._counter("policy_verified_proposals", "Proposals the speculation policy's cycles verified (sum of verify lengths)", m.policy_verified)
        yield self._counter("drafting_stopped", "Sessions that stopped drafting for good where cycling lost (speculation policy)", m.drafting_stopped)
        yield self._counter("device_seconds", "Device time of the engine's loop launches (rate: the device's busy share)", m.device_s)
        yield self._counter("loop_launches", "The engine's loop launches (programs of owner groups)", m.loop_launches)
        yield self._counter("loop_rounds", "Rounds the engine's loop launches ran (several per launch: --launch-rounds)", m.loop_rounds)
        yield self._counter("lane_rounds", "Lanes' rounds in the engine's loop launches (owner-cycles and decode steps)", m.lane_rounds)
        yield self._gauge("acceptance_length", "Mean tokens per cycle (tau), bonus included; NaN before the first cycle", m.tau if m.tau is not None else float("nan"))
        for name, doc, key in HISTOGRAMS:
            yield self._histogram(name, doc, m.histograms[key])

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=["model"])
        family.add_metric([self.model], value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=["model"])
        family.add_metric([self.model], value)
        return family

    def _histogram(self, name: str, doc: str, histogram: Histogram) -> HistogramMetricFamily:
        family = HistogramMetricFamily(f"{PREFIX}_{name}", f"{doc} (seconds)", labels=["model"])
        family.add_metric([self.model], histogram.cumulative(), sum_value=histogram.sum)
        return family
