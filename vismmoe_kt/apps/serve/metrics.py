"""The server's Prometheus metrics (prometheus_client), named after vLLM's where they mean the same.

Each app gets its own CollectorRegistry, so several servers in one process (tests) do not clash.
The operators' runtime counters (hits, bytes copied, ...) are read at scrape time by a collector.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class _RuntimeCollector:
    """Every operator's numeric `stats()` as `vismmoe_runtime{operator, stat}`, at scrape time."""

    def __init__(self, model: Any):
        self.model = model

    def collect(self):
        from ...core.stats import collect_stats

        family = GaugeMetricFamily("vismmoe_runtime", "operator counters (collect_stats)", labels=["operator", "stat"])
        for operator, values in collect_stats(self.model)["operators"].items():
            for key, value in values.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    family.add_metric([operator, key], float(value))
        yield family


class ServerMetrics:
    def __init__(self, model: Any):
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("vismmoe_requests", "HTTP requests by route template and outcome", ["endpoint", "status"],
                                registry=registry)
        self.prompt_tokens = Counter("vismmoe_prompt_tokens", "prompt tokens processed", registry=registry)
        self.generation_tokens = Counter("vismmoe_generation_tokens", "tokens generated", registry=registry)
        self.ttft = Histogram("vismmoe_time_to_first_token_seconds", "request admitted to its first text (queueing "
                              "included)", buckets=LATENCY_BUCKETS, registry=registry)
        self.latency = Histogram("vismmoe_e2e_request_latency_seconds", "request duration: admitted to its last token "
                                 "(queueing included)", buckets=LATENCY_BUCKETS, registry=registry)
        self.tpot = Histogram("vismmoe_time_per_output_token_seconds", "a request's mean time per token after its first",
                              buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
                              registry=registry)
        self.waiting = Gauge("vismmoe_num_requests_waiting", "requests admitted and not yet in a slot", registry=registry)
        self.running = Gauge("vismmoe_num_requests_running", "requests in a slot (prefilling or generating)", registry=registry)
        self.rejected = Counter("vismmoe_requests_rejected", "requests refused with 429 (queue full)", registry=registry)
        self.cancelled = Counter("vismmoe_requests_cancelled", "generations stopped early because the client left",
                                 registry=registry)
        self.batch_size = Histogram("vismmoe_decode_batch_size", "sequences per batched decode step (the lean decode path)",
                                    buckets=(1, 2, 4, 8, 16, 32, 64), registry=registry)
        self.inter_token = Histogram("vismmoe_inter_token_latency_seconds",
                                     "gap between a request's consecutive tokens",
                                     buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
                                     registry=registry)
        registry.register(_RuntimeCollector(model))

    def set_queue(self, waiting: int, running: int) -> None:
        self.waiting.set(waiting)
        self.running.set(running)

    def count(self, endpoint: str, status: int) -> None:
        """One ended request; `endpoint` is its route's template or `unmatched` (access.py), never the raw path."""
        self.requests.labels(endpoint, str(status)).inc()

    def finished(self, usage: Any, first_text: float | None, end: float, cancelled: bool) -> None:
        """A request ended at `end` (perf_counter), its first text at `first_text` (None: it sent none)."""
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.generation_tokens.inc(max(usage.completion_tokens, 0))
        self.latency.observe(end - usage.arrived)
        if first_text is not None:
            self.ttft.observe(first_text - usage.arrived)
            if usage.completion_tokens > 1:
                self.tpot.observe(max(end - first_text, 0.0) / (usage.completion_tokens - 1))
        if cancelled:
            self.cancelled.inc()

    def text(self) -> bytes:
        return generate_latest(self.registry)
