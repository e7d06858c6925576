"""Prometheus metrics. Engine figures use vLLM's names (vllm:...), so existing vLLM dashboards and
alerts work unchanged; the gateway's own figures (rate limits, queue, moderation) use chatloom:...

Each app owns a registry (tests build many apps in one process). Engine gauges and counters are
read from backend.stats() at scrape time; per-request latencies are observed when a request ends.

Goodput follows vLLM's definition: requests that met every SLO (TTFT and TPOT targets, from the
settings), counted beside all finished requests, and as a rate over the last minute.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from chatloom.serving import BackendStats, Timings, Usage

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Buckets close to vLLM's, so histograms line up with theirs.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0)


class _EngineCollector:
    """vLLM's engine gauges and counters, from the backend's stats dict at scrape time."""

    def __init__(self, stats: Callable[[], BackendStats], model: Callable[[], str]) -> None:
        self._stats = stats
        self._model = model

    def collect(self) -> Iterable[Metric]:
        try:
            s = self._stats()
        except Exception:  # a scrape must not fail because the model is loading
            return
        if not s.ready or s.num_requests_running is None:
            return
        labels = ["model_name"]
        model = [self._model()]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(model, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(model, value)
            return c

        yield gauge("vllm:num_requests_running", "Requests in model execution batches.", s.num_requests_running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting inside the engine.", s.num_requests_waiting or 0)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                    s.kv_cache_usage_perc or 0.0)
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in tokens.", s.prefix_cache_queries or 0)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.", s.prefix_cache_hits or 0)
        yield counter("vllm:num_preemptions", "Cumulative number of preemptions.", s.num_preemptions or 0)
        if s.interrupted_steps is not None:
            yield counter("chatloom:interrupted_batch_steps", "Steps of batch work alone stopped part-way for an "
                          "interactive request (each runs again later).", s.interrupted_steps)
        if s.step_seconds is not None:
            steps = CounterMetricFamily("chatloom:engine_step_seconds", "Seconds of engine steps by what they "
                                        "carried: foreground (any interactive sequence), background (batch "
                                        "work alone), interrupted (batch steps stopped part-way).",
                                        labels=["model_name", "kind"])
            for kind, seconds in s.step_seconds.items():
                steps.add_metric([model[0], kind], seconds)
            yield steps
        if s.spec_decode is not None:  # speculative decoding is on
            sd = s.spec_decode
            for key, doc in (("num_drafts", "Sequence-steps that carried proposed tokens."),
                             ("num_draft_tokens", "Proposed tokens checked by the target model."),
                             ("num_accepted_tokens", "Proposed tokens accepted."),
                             ("num_emitted_tokens", "Tokens emitted by speculative steps (accepted plus one).")):
                yield counter(f"vllm:spec_decode_{key}", doc, getattr(sd, key))
            yield gauge("chatloom:spec_decode_acceptance_rate", "Accepted over proposed tokens, since start.",
                        sd.acceptance_rate)
        if s.kv_holds is not None:  # the KV cache of answers waiting for their tools
            h = s.kv_holds
            for key, doc in (("holds", "Tool rounds whose KV blocks were held while their tools ran."),
                             ("evictions", "Tool rounds whose KV blocks were freed when their tools started."),
                             ("pressure_releases", "Held tool rounds released because another request needed "
                                                   "the blocks."),
                             ("timeouts", "Held tool rounds released at their timeout."),
                             ("reprefilled_tokens", "Tokens resumes after tool calls computed again."),
                             ("block_seconds", "KV blocks held for tool rounds times seconds held.")):
                yield counter(f"chatloom:kv_tool_{key}", doc, getattr(h, key))
            yield gauge("chatloom:kv_tool_blocks_held", "KV blocks held now for answers waiting on tools.",
                        h.blocks_held)
        if s.generation_tokens_per_s is not None:
            yield gauge("chatloom:generation_tokens_per_s", "Generated tokens per second over the last seconds.",
                        s.generation_tokens_per_s)


@dataclass(frozen=True)
class Slo:
    """Latency targets a request must meet to count as goodput; None: no target."""

    ttft_s: float | None = None
    tpot_s: float | None = None

    def met(self, timings: Timings | None) -> bool:
        t = timings or Timings()
        return ((self.ttft_s is None or (t.ttft is not None and t.ttft <= self.ttft_s))
                and (self.tpot_s is None or t.tpot is None or t.tpot <= self.tpot_s))


class _RecentRate:
    """Events per second over a sliding window."""

    def __init__(self, window_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.clock = clock
        self._times: deque[float] = deque()

    def add(self) -> None:
        self._times.append(self.clock())

    def per_s(self) -> float:
        now = self.clock()
        while self._times and self._times[0] <= now - self.window_s:
            self._times.popleft()
        return len(self._times) / self.window_s


class Metrics:
    def __init__(self, stats: Callable[[], BackendStats], model: Callable[[], str], slo: Slo = Slo(),
                 class_slos: dict[str, Slo] | None = None) -> None:
        self.registry = CollectorRegistry()
        self.slo = slo
        self.class_slos = dict(class_slos or {})
        r = self.registry
        self._model = model
        r.register(_EngineCollector(stats, model))
        m = ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", m,
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "Time per output token after the first.", m,
                              buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency in the engine.", m,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("vllm:request_queue_time_seconds", "Time spent waiting inside the engine.", m,
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed.", m, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generation tokens processed.", m, registry=r)
        self.request_success = Counter("vllm:request_success", "Finished requests.", m + ["finished_reason"],
                                       registry=r)
        # The gateway's own.
        self.rate_limited = Counter("chatloom:rate_limited", "Requests refused with 429.", ["code"], registry=r)
        self.queue_timeouts = Counter("chatloom:queue_timeouts", "Requests that left the admission queue with 503.",
                                      registry=r)
        self.queue_wait = Histogram("chatloom:admission_queue_wait_seconds", "Time in the admission queue.",
                                    ["tier", "kind"], buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10,
                                                               20, 30, 60), registry=r)
        self.queue_waiting = Gauge("chatloom:admission_queue_waiting", "Requests in the admission queue.",
                                   registry=r)
        self.queue_running = Gauge("chatloom:admission_running", "Requests admitted and not yet finished.",
                                   registry=r)
        self.moderation_blocks = Counter("chatloom:moderation_blocks", "Messages or answers stopped by moderation.",
                                         ["stage", "category"], registry=r)
        self.goodput_requests = Counter("chatloom:goodput_requests", "Finished requests that met every SLO "
                                        "(TTFT and TPOT targets).", m, registry=r)
        # Server-side tool calls, and what resuming an answer after them cost: a call frees the answer's
        # sequence, so the resumed round's prompt is read again, from the prefix cache where its blocks
        # survived the wait (cached) and computed again where they did not.
        self.tool_calls = Counter("chatloom:tool_calls", "Server-side tool calls, by tool (mcp: any MCP "
                                  "server's) and outcome (ok, error).", ["tool", "outcome"], registry=r)
        self.tool_seconds = Histogram("chatloom:tool_call_seconds", "Time a server-side tool call took.", ["tool"],
                                      buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120), registry=r)
        self.resume_prompt_tokens = Counter("chatloom:tool_resume_prompt_tokens", "Prompt tokens of answer rounds "
                                            "resumed after tool calls.", registry=r)
        self.resume_cached_tokens = Counter("chatloom:tool_resume_cached_tokens", "Of those, the tokens found in "
                                            "the prefix cache (the rest were computed again).", registry=r)
        self.resume_ttft = Histogram("chatloom:tool_resume_ttft_seconds", "Time to first token of an answer round "
                                     "resumed after tool calls.", buckets=TTFT_BUCKETS, registry=r)
        self._goodput_rate = _RecentRate()
        goodput = Gauge("chatloom:goodput_requests_per_s", "Requests meeting every SLO per second, "
                        "over the last minute.", registry=r)
        goodput.set_function(self._goodput_rate.per_s)
        for name, target in (("ttft", slo.ttft_s), ("tpot", slo.tpot_s)):
            if target is not None:
                g = Gauge(f"chatloom:slo_{name}_seconds", f"The {name.upper()} target of the goodput SLO.",
                          registry=r)
                g.set(target)
        # Per traffic class ('interactive:<tier>', 'reasoning', 'batch'), each against its own targets.
        c = ["slo_class"]
        self.class_requests = Counter("chatloom:class_requests", "Finished requests per traffic class.", c,
                                      registry=r)
        self.class_goodput_requests = Counter("chatloom:class_goodput_requests", "Finished requests that met "
                                              "their class's SLO.", c, registry=r)
        self.class_goodput_tokens = Counter("chatloom:class_goodput_tokens", "Output tokens of requests that "
                                            "met their class's SLO.", c, registry=r)
        targets = Gauge("chatloom:class_slo_seconds", "Each configured class's targets.", c + ["figure"],
                        registry=r)
        for name, target in self.class_slos.items():
            for figure, value in (("ttft", target.ttft_s), ("tpot", target.tpot_s)):
                if value is not None:
                    targets.labels(name, figure).set(value)
        self.degrade_level = Gauge("chatloom:degrade_level", "Degrade steps in force (0: none; 1 effort capped, "
                                   "2 small model, 3 answers shortened).", registry=r)
        self.degraded_requests = Counter("chatloom:degraded_requests", "Requests answered with a degrade step.",
                                         ["step"], registry=r)

    def slo_for(self, slo_class: str) -> Slo:
        """A class's targets: its own, else its kind's ('interactive' for 'interactive:free'), else the
        service-wide ones."""
        kind = slo_class.partition(":")[0]
        return self.class_slos.get(slo_class) or self.class_slos.get(kind) or self.slo

    def observe_request(self, timings: Timings | None, finish_reason: str | None, usage: Usage,
                        slo_class: str | None = None) -> None:
        model = self._model()
        self.prompt_tokens.labels(model).inc(usage.prompt_tokens)
        self.generation_tokens.labels(model).inc(usage.completion_tokens)
        self.request_success.labels(model, finish_reason or "unknown").inc()
        t = timings or Timings()
        for hist, value in ((self.ttft, t.ttft), (self.tpot, t.tpot), (self.e2e, t.e2e),
                            (self.queue_time, t.queue_time)):
            if value is not None:
                hist.labels(model).observe(value)
        if finish_reason in ("stop", "length") and self.slo.met(timings):
            self.goodput_requests.labels(model).inc()
            self._goodput_rate.add()
        if slo_class is not None and finish_reason in ("stop", "length"):
            self.class_requests.labels(slo_class).inc()
            if self.slo_for(slo_class).met(timings):
                self.class_goodput_requests.labels(slo_class).inc()
                self.class_goodput_tokens.labels(slo_class).inc(usage.completion_tokens)

    def observe_tool(self, tool: str, seconds: float, failed: bool) -> None:
        self.tool_calls.labels(tool, "error" if failed else "ok").inc()
        self.tool_seconds.labels(tool).observe(seconds)

    def observe_resume(self, usage: Usage, timings: Timings | None) -> None:
        """One round of an answer that resumed after tool calls."""
        self.resume_prompt_tokens.inc(usage.prompt_tokens)
        self.resume_cached_tokens.inc(usage.cached_tokens)
        if timings is not None and timings.ttft is not None:
            self.resume_ttft.observe(timings.ttft)

    def render(self) -> bytes:
        return generate_latest(self.registry)
