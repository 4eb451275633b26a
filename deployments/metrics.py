"""Prometheus metrics of the ingress (served at /metrics), under vLLM's names and labels with a
`specdec:` prefix in place of `vllm:`, so vLLM's dashboards and alerts read them unchanged.

Requests are counted as they progress (tokens, drafts, first token), not when they succeed: a
request that fails or is abandoned mid-way has its work and its latency counted too, under
request_success_total{finished_reason="error" | "abort"}."""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

P = "specdec:"
# vLLM's buckets
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)
FINISHED_REASONS = ("stop", "length", "abort", "error")
FAILURE_CAUSES = ("timeout", "unavailable", "error")  # deployments.driver.failure_cause


class ServeMetrics:
    # the process's ingress metrics, for code that has no ingress at hand (its exception handlers);
    # a class attribute, not a module global: Serve ships the ingress class by value, with copies
    # of the globals its methods name, while this class is imported where the replica runs
    current: "ServeMetrics | None" = None

    def __init__(self, model_name: str = "specdec"):
        ServeMetrics.current = self
        disable_created_metrics()  # as vLLM: no `_created` twin of every counter and histogram
        r = self.registry = CollectorRegistry()
        self.model = model_name
        m = ["model_name"]

        # bound to this model's label once: a request updates them every round
        def counter(name, doc, labels=()):
            c = Counter(P + name, doc, m + list(labels), registry=r)
            return c if labels else c.labels(model_name)

        def gauge(name, doc):
            return Gauge(P + name, doc, m, registry=r).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(P + name, doc, m, registry=r, buckets=buckets).labels(model_name)

        self.running = gauge("num_requests_running", "Requests in the round loop's batches")
        self.waiting = gauge("num_requests_waiting", "Requests in the round loop waiting for a batch slot")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests")
        self.generation_tokens = counter("generation_tokens", "Tokens generated")
        self.success = counter("request_success", "Requests ended, by finished_reason (abort: the client left; "
                               "error: the server failed it)", ["finished_reason"])
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between output tokens (a round's gap spread "
                             "over its tokens)", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency", E2E_BUCKETS)
        self.drafts = counter("spec_decode_num_drafts", "Rounds in which a request was given drafts")
        self.draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed")
        self.accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self.accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each draft position (a token tree's depth)", ["position"])
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the Verifier's prefix cache")
        self.prediction_tokens = counter("prediction_tokens", "Requests' predictions (Predicted Outputs) drafted, "
                                         "by whether the verifier kept them (kind: accepted, rejected)", ["kind"])
        # a round's calls as the ingress sees them (RPC included): what adaptive K weighs
        self.calls = Histogram(P + "replica_call_seconds", "Drafter / Verifier call latency seen by the ingress",
                               ["deployment"], registry=r, buckets=(0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5))
        self.call_failures = Counter(P + "replica_call_failures", "Drafter / Verifier calls that failed, by cause "
                                     "(timeout; unavailable: the replica died or restarts; error: its code raised)",
                                     ["deployment", "cause"], registry=r)
        self.call_retries = Counter(P + "replica_call_retries", "Verifier calls retried after a failure",
                                    ["deployment"], registry=r)
        self.errors = Counter(P + "request_errors", "Error responses (and failed streams), by HTTP status and code",
                              ["status", "code"], registry=r)
        self.replicas = _ReplicaStats(model_name)
        r.register(self.replicas)
        # present from the start, so rate() sees the first increase
        for reason in FINISHED_REASONS:
            self.success.labels(self.model, reason)
        for deployment in ("Verifier", "Drafter"):
            for cause in FAILURE_CAUSES:
                self.call_failures.labels(deployment, cause)
        self.call_retries.labels("Verifier")

    def observe_call(self, deployment: str, seconds: float) -> None:
        self.calls.labels(deployment).observe(seconds)

    def observe_failure(self, deployment: str, cause: str, retried: bool = False) -> None:
        self.call_failures.labels(deployment, cause).inc()
        if retried:
            self.call_retries.labels(deployment).inc()

    def observe_error(self, status: int, code: str | None) -> None:
        self.errors.labels(str(status), code or "").inc()

    def set_queue(self, running: int, waiting: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)

    def track(self, seq) -> RequestTracker:
        """Start counting an admitted sequence."""
        self.prompt_tokens.inc(len(seq.prompt_ids))
        self.prefix_queries.inc(len(seq.prompt_ids))
        return RequestTracker(self, seq)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTracker:
    """What one sequence has reported so far: each call of update() counts what its rounds added
    since the last one."""

    def __init__(self, metrics: ServeMetrics, seq):
        self.m, self.seq = metrics, seq
        self.tokens = self.rounds = self.drafted = self.accepted = 0
        self.predicted = {"accepted": 0, "rejected": 0}
        self.per_pos: list[int] = []
        self.t_last: float | None = None  # when the last counted token arrived
        self.ended = False

    def update(self) -> None:
        m, sm = self.m, self.seq.metrics
        new = sm.num_output_tokens - self.tokens
        if new > 0:
            m.generation_tokens.inc(new)
            now = time.perf_counter()
            if self.t_last is None:  # the first block: its wait is the time to first token
                if sm.ttft_s is not None:
                    m.ttft.observe(sm.ttft_s)
            else:  # a later block's wait, spread over its tokens (a speculative round emits several)
                for _ in range(new):
                    m.itl.observe((now - self.t_last) / new)
            self.t_last, self.tokens = now, sm.num_output_tokens
        rounds = sm.drafted_per_position[0] if sm.drafted_per_position else 0
        for c, was, now_ in ((m.drafts, self.rounds, rounds), (m.draft_tokens, self.drafted, sm.num_drafted),
                             (m.accepted_tokens, self.accepted, sm.num_accepted)):
            if now_ > was:
                c.inc(now_ - was)
        self.rounds, self.drafted, self.accepted = rounds, sm.num_drafted, sm.num_accepted
        for j, n in enumerate(sm.accepted_per_position):
            was = self.per_pos[j] if j < len(self.per_pos) else 0
            if n > was:
                m.accepted_per_pos.labels(m.model, str(j)).inc(n - was)
        self.per_pos = list(sm.accepted_per_position)
        kept = sm.num_prediction_accepted
        for kind, n in (("accepted", kept), ("rejected", sm.num_prediction_drafted - kept)):
            if n > self.predicted[kind]:
                m.prediction_tokens.labels(m.model, kind).inc(n - self.predicted[kind])
                self.predicted[kind] = n

    def end(self, reason: str) -> None:
        """Count the request's end once: its finish reason, or abort / error."""
        if self.ended:
            return
        self.ended = True
        self.update()
        self.m.success.labels(self.m.model, reason).inc()
        self.m.e2e.observe(self.seq.metrics.latency_s)


class _ReplicaStats:
    """Cache figures the Verifier replicas report (each scrape asks one; replicas that stop
    reporting drop out after a minute)."""

    def __init__(self, model_name: str):
        self.model = model_name
        self.seen: dict[str, tuple[float, dict]] = {}

    def report(self, replica: str, stats: dict) -> None:
        self.seen[replica] = (time.monotonic(), stats)

    def collect(self):
        now = time.monotonic()
        self.seen = {k: v for k, v in self.seen.items() if now - v[0] < 60}
        # vLLM's `engine` label names the engine core; here it names the Verifier replica
        usage = GaugeMetricFamily(P + "kv_cache_usage_perc", "Fraction of a Verifier replica's KV-cache slots in use "
                                  "(1 = full)", labels=["model_name", "engine"])
        hits = CounterMetricFamily(P + "prefix_cache_hits", "Prompt tokens a Verifier replica took from its prefix "
                                   "cache instead of computing them", labels=["model_name", "engine"])
        for replica, (_, s) in sorted(self.seen.items()):
            usage.add_metric([self.model, replica], s["resident"] / max(1, s["max_seqs"]))
            hits.add_metric([self.model, replica], s["prefix_tokens_reused"])
        yield usage
        yield hits
