"""GET /metrics: Prometheus text with vLLM's metric names under the `met:` prefix.

The numbers come from the engine thread (EngineObserver hooks, called between steps); the
prometheus_client objects are thread-safe. Per-request timing state lives in a dict that only
the engine thread touches.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from metrale.engine.async_engine import EngineObserver, EngineSnapshot
from metrale.engine.spec_stats import SpecDecodeStats
from metrale.messages.outputs import RequestOutput

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST

disable_created_metrics()  # no `_created` series, as vLLM


class _RequestTiming:
    __slots__ = ("arrival", "last_token_time", "num_tokens")

    def __init__(self, arrival: float):
        self.arrival = arrival
        self.last_token_time: float | None = None
        self.num_tokens = 0


class _SpecDecodeCounters:
    """vLLM's spec_decode_* counters, fed from the scheduler's running totals."""

    def __init__(self, registry: CollectorRegistry, model_name: str):
        self.model_name = model_name
        self.drafts = Counter("met:spec_decode_num_drafts", "Requests' drafts verified (one per request and step)",
                              ["model_name"], registry=registry).labels(model_name)
        self.draft_tokens = Counter("met:spec_decode_num_draft_tokens", "Draft tokens verified",
                                    ["model_name"], registry=registry).labels(model_name)
        self.accepted = Counter("met:spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                ["model_name"], registry=registry).labels(model_name)
        self.per_position = Counter("met:spec_decode_num_accepted_tokens_per_pos",
                                    "Drafts whose token at this position was accepted",
                                    ["model_name", "position"], registry=registry)
        self.seen = SpecDecodeStats()

    def update(self, totals: SpecDecodeStats) -> None:
        for counter, total, seen in ((self.drafts, totals.num_drafts, self.seen.num_drafts),
                                     (self.draft_tokens, totals.num_draft_tokens, self.seen.num_draft_tokens),
                                     (self.accepted, totals.num_accepted_tokens, self.seen.num_accepted_tokens)):
            if total > seen:
                counter.inc(total - seen)
        for position, total in enumerate(totals.accepted_per_position):
            seen = self.seen.accepted_per_position[position] if position < len(self.seen.accepted_per_position) else 0
            counter = self.per_position.labels(self.model_name, str(position))
            if total > seen:
                counter.inc(total - seen)
        self.seen = totals.copy()


class ServerMetrics(EngineObserver):
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry(auto_describe=True)
        labels, r = ["model_name"], self.registry

        def gauge(name, doc):
            return Gauge(name, doc, labels, registry=r).labels(model_name)

        def counter(name, doc, extra=()):
            metric = Counter(name, doc, labels + list(extra), registry=r)
            return metric if extra else metric.labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.model_name = model_name
        # Static facts of the engine as labels of one gauge whose value is 1 (set once ready).
        self.engine_info = Gauge("met:engine_info", "The engine's configuration, as labels",
                                 ["model_name", "forward", "device"], registry=r)
        self.running = gauge("met:num_requests_running", "Sequences in the running batch")
        self.waiting = gauge("met:num_requests_waiting", "Sequences waiting to be scheduled")
        self.kv_usage = gauge("met:kv_cache_usage_perc", "Share of KV cache blocks in use (0 to 1)")
        self.prompt_tokens = counter("met:prompt_tokens", "Prompt tokens of requests that started generating")
        self.generation_tokens = counter("met:generation_tokens", "Generated tokens")
        self.preemptions = counter("met:num_preemptions", "Times a running sequence was preempted")
        self.prefix_queries = counter("met:prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = counter("met:prefix_cache_hits", "Prompt tokens whose KV the prefix cache supplied")
        self.success = counter("met:request_success", "Requests that finished", ["finished_reason"])
        self.rejected = counter("met:request_rejected", "Requests refused with 503 (queue full, draining)")
        self.ttft = histogram("met:time_to_first_token_seconds", "Arrival to first token", _TTFT_BUCKETS)
        self.itl = histogram("met:inter_token_latency_seconds", "Time between two tokens of a request",
                             _ITL_BUCKETS)
        self.e2e = histogram("met:e2e_request_latency_seconds", "Arrival to last token", _E2E_BUCKETS)
        self._timing: dict[str, _RequestTiming] = {}  # engine thread only
        self._preemptions_seen = 0
        self._queries_seen = 0
        self._hits_seen = 0
        self._spec: _SpecDecodeCounters | None = None  # registered with the first speculative counts

    # -- EngineObserver (engine thread) -----------------------------------------------------------

    def on_request_added(self, request_id: str, arrival_time: float) -> None:
        self._timing[request_id] = _RequestTiming(arrival_time)

    def on_request_aborted(self, request_id: str) -> None:
        if self._timing.pop(request_id, None) is not None:
            self.success.labels(self.model_name, "abort").inc()

    def on_outputs(self, outputs: list[RequestOutput], now: float) -> None:
        for output in outputs:
            timing = self._timing.get(output.request_id)
            if timing is None:
                continue
            num_tokens = sum(len(c.token_ids) for c in output.outputs)
            new_tokens = num_tokens - timing.num_tokens
            if new_tokens > 0:
                if timing.last_token_time is None:
                    self.prompt_tokens.inc(len(output.prompt_token_ids))
                    first = output.metrics.get("first_token_time") or now
                    self.ttft.observe(max(0.0, first - timing.arrival))
                    if output.finished and new_tokens > 1:
                        # A final-only output (not streamed): the steps between are not seen;
                        # each token interval counts as the mean one.
                        mean = max(0.0, now - first) / (new_tokens - 1)
                        for _ in range(new_tokens - 1):
                            self.itl.observe(mean)
                else:
                    self.itl.observe(now - timing.last_token_time)
                self.generation_tokens.inc(new_tokens)
                timing.num_tokens = num_tokens
                timing.last_token_time = now
            if output.finished:
                del self._timing[output.request_id]
                self.e2e.observe(now - timing.arrival)
                for c in output.outputs:
                    self.success.labels(self.model_name, c.finish_reason or "unknown").inc()

    def on_snapshot(self, snapshot: EngineSnapshot) -> None:
        self.running.set(snapshot.num_running)
        self.waiting.set(snapshot.num_waiting)
        self.kv_usage.set(snapshot.kv_cache_usage)
        for metric, total, seen in ((self.prefix_queries, snapshot.prefix_cache_queries_total, "_queries_seen"),
                                    (self.prefix_hits, snapshot.prefix_cache_hits_total, "_hits_seen")):
            if total > getattr(self, seen):
                metric.inc(total - getattr(self, seen))
                setattr(self, seen, total)
        if snapshot.num_preemptions_total > self._preemptions_seen:
            self.preemptions.inc(snapshot.num_preemptions_total - self._preemptions_seen)
            self._preemptions_seen = snapshot.num_preemptions_total
        if snapshot.spec_decode is not None:
            if self._spec is None:
                self._spec = _SpecDecodeCounters(self.registry, self.model_name)
            self._spec.update(snapshot.spec_decode)

    # -- exposition ------------------------------------------------------------------------------

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def on_ready(self, forward: str, device: str) -> None:
        self.engine_info.labels(self.model_name, forward, device).set(1)
