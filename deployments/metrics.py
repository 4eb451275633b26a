"""Prometheus metrics of the ingress (served at /metrics)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


class ServeMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("specdec_requests", "Requests admitted (each prompt of a batched completions request)",
                                registry=r)
        self.disconnects = Counter("specdec_client_disconnects", "Streams the client abandoned", registry=r)
        self.output_tokens = Counter("specdec_output_tokens", "Tokens generated", registry=r)
        self.drafted = Counter("specdec_draft_tokens", "Draft tokens proposed", registry=r)
        self.accepted = Counter("specdec_accepted_tokens", "Draft tokens accepted by the verifier", registry=r)
        self.latency = Histogram("specdec_request_latency_seconds", "End-to-end latency", registry=r,
                                 buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 60, 120))
        self.ttft = Histogram("specdec_time_to_first_token_seconds", "Time to first token", registry=r,
                              buckets=(0.02, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10))
        self.in_flight = Gauge("specdec_in_flight", "Requests being generated", registry=r)
        # a round's calls as the ingress sees them (RPC included): what adaptive K weighs
        self.calls = Histogram("specdec_replica_call_seconds", "Drafter / Verifier call latency seen by the ingress",
                               ["deployment"], registry=r, buckets=(0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5))

    def observe_call(self, deployment: str, seconds: float) -> None:
        self.calls.labels(deployment).observe(seconds)

    def observe(self, tokens: int, drafted: int, accepted: int, latency_s: float, ttft_s: float | None) -> None:
        self.output_tokens.inc(tokens)
        self.drafted.inc(drafted)
        self.accepted.inc(accepted)
        self.latency.observe(latency_s)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
