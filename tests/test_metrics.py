"""The ingress's Prometheus metrics (deployments/metrics.py), without Ray: vLLM's names under a
`specdec:` prefix, counted as a request progresses, so failed and abandoned requests count too."""
import re

from deployments.metrics import ServeMetrics
from specdec.protocol import VerifyResult
from specdec.sampling import SamplingParams
from specdec.sequence import Sequence


def value(m: ServeMetrics, name: str, **labels) -> float:
    total = 0.0
    for line in m.render().decode().splitlines():
        hit = re.match(r"^([a-zA-Z0-9_:]+)(?:\{(.*)\})? (\S+)$", line)
        if hit and hit.group(1) == name:
            have = dict(re.findall(r'(\w+)="([^"]*)"', hit.group(2) or ""))
            if all(have.get(k) == v for k, v in labels.items()):
                total += float(hit.group(3))
    return total


def rounds(seq, *blocks):
    """Commit verify results: each block (drafted, accepted) emits accepted + 1 tokens."""
    for drafted, accepted in blocks:
        seq.commit(VerifyResult(list(range(10, 11 + accepted)), accepted, drafted))


def test_names_and_labels_are_vllms():
    text = ServeMetrics("tiny").render().decode()
    for name in ("num_requests_running", "num_requests_waiting", "prompt_tokens_total", "generation_tokens_total",
                 "spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                 "spec_decode_num_accepted_tokens_total", "e2e_request_latency_seconds_bucket",
                 "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket", "prefix_cache_queries_total"):
        assert re.search(rf'^specdec:{name}\{{.*model_name="tiny"', text, re.M), name
    for reason in ("stop", "length", "abort", "error"):
        assert f'specdec:request_success_total{{finished_reason="{reason}",model_name="tiny"}} 0.0' in text
    assert 'specdec:replica_call_failures_total{cause="unavailable",deployment="Verifier"} 0.0' in text
    assert "_created" not in text


def test_a_request_is_counted_round_by_round():
    m = ServeMetrics("tiny")
    seq = Sequence("a", [1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True), 3, 100)
    t = m.track(seq)
    assert value(m, "specdec:prompt_tokens_total") == 3
    rounds(seq, (0, 0))  # the prefill's plain token
    t.update()
    assert value(m, "specdec:time_to_first_token_seconds_count") == 1 and value(m, "specdec:generation_tokens_total") == 1
    rounds(seq, (3, 2), (3, 0), (3, 3))
    t.update()
    assert value(m, "specdec:generation_tokens_total") == 1 + 3 + 1 + 4
    assert value(m, "specdec:spec_decode_num_drafts_total") == 3
    assert value(m, "specdec:spec_decode_num_draft_tokens_total") == 9
    assert value(m, "specdec:spec_decode_num_accepted_tokens_total") == 5
    per_pos = [value(m, "specdec:spec_decode_num_accepted_tokens_per_pos_total", position=str(j)) for j in range(3)]
    assert per_pos == [2, 2, 1]
    assert value(m, "specdec:inter_token_latency_seconds_count") == 8  # each token after the first block
    assert value(m, "specdec:e2e_request_latency_seconds_count") == 0
    t.end("error")  # a request that fails mid-way: its work is counted already, and its end now
    t.end("error")
    assert value(m, "specdec:request_success_total", finished_reason="error") == 1
    assert value(m, "specdec:e2e_request_latency_seconds_count") == 1


def test_failures_and_errors_are_counted_by_cause():
    m = ServeMetrics("tiny")
    m.observe_failure("Verifier", "unavailable", retried=True)
    m.observe_failure("Drafter", "timeout")
    m.observe_error(400, "invalid_value")
    assert value(m, "specdec:replica_call_failures_total", deployment="Verifier", cause="unavailable") == 1
    assert value(m, "specdec:replica_call_retries_total", deployment="Verifier") == 1
    assert value(m, "specdec:replica_call_failures_total", deployment="Drafter", cause="timeout") == 1
    assert value(m, "specdec:request_errors_total", status="400", code="invalid_value") == 1


def test_cache_figures_per_verifier_replica():
    m = ServeMetrics("tiny")
    m.replicas.report("Verifier#abc", {"resident": 6, "max_seqs": 24, "prefix_tokens_reused": 40})
    assert value(m, "specdec:kv_cache_usage_perc", engine="Verifier#abc", model_name="tiny") == 0.25
    assert value(m, "specdec:prefix_cache_hits_total", engine="Verifier#abc") == 40
