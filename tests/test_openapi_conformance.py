"""Schemathesis against the running app's /openapi.json: generated requests (bounded: few
examples, max_tokens capped, 127.0.0.1 only) never get a server error, and every answer's
status, content type and body are the ones the schema documents."""
import collections
import time

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,
                                              status_code_conformance)

from serve_helpers import run_app, serve_cluster

pytestmark = pytest.mark.serve

TINY = {"verifier": "tiny", "draft": "tiny:noise=0.05", "model_name": "tiny", "num_threads": 1, "max_model_len": 128,
        "max_seqs": 16, "api_keys_env": None, "default_max_tokens": 4, "max_queue": 8, "request_timeout_s": 20}
MAX_TOKENS = 4
EXAMPLES = 100  # per operation with a body; the GET routes take no input


@pytest.fixture(scope="module")
def api_schema():
    with serve_cluster() as url:
        assert url.startswith("http://127.0.0.1:")
        run_app("specdec", "/", TINY)
        yield schemathesis.openapi.from_url(url + "/openapi.json")


def bounded(body):
    """The model that exists (else nearly every case is a 404) and few tokens per prompt."""
    if isinstance(body, dict):
        body["model"] = "tiny"
        for field in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(field), (int, float)) and body[field] > MAX_TOKENS:  # integers may come as 5.0
                body[field] = MAX_TOKENS
        if isinstance(body.get("prompt"), list) and len(body["prompt"]) > 2 and not isinstance(body["prompt"][0], int):
            body["prompt"] = body["prompt"][:2]
    return body


CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


def test_generated_requests_get_documented_answers(api_schema):
    # one Hypothesis run per operation, inside this test (schemathesis' own pytest plugin does
    # not run under pytest 9)
    t0, ran, statuses = time.monotonic(), [], collections.Counter()
    for result in api_schema.get_all_operations():
        operation = result.ok()

        @given(case=operation.as_strategy())
        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        def call(case):
            case.body = bounded(case.body)
            r = case.call_and_validate(timeout=30, checks=CHECKS)
            statuses[f"{operation.label} {r.status_code}"] += 1

        call()
        ran.append(operation.label)
    print(f"schemathesis: {', '.join(ran)} in {time.monotonic() - t0:.0f} s")
    print(dict(statuses))
    assert len(ran) == 5
