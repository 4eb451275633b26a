"""Hostile input through HTTP: a tiny temperature shares a batch without stalling it, text the
tokenizer cannot take and content parts the model cannot read get 400s naming the field, every
error is OpenAI-shaped, and the metrics count what happened (vLLM's names, `specdec:` prefix)."""
import concurrent.futures as cf
import json
import re
import time

import httpx
import pytest

from serve_helpers import run_app, serve_cluster

pytestmark = pytest.mark.serve

# fixed K (adaptive off): every round drafts, so the speculation counters move
TINY = {"verifier": "tiny", "draft": "tiny:noise=0.05", "model_name": "tiny", "num_threads": 1, "max_model_len": 256,
        "max_seqs": 24, "adaptive": False, "api_keys_env": None, "default_max_tokens": 16}
CHAT = [{"role": "user", "content": "Tell me about speculative decoding."}]


@pytest.fixture(scope="module")
def server():
    with serve_cluster() as url:
        verifier, drafter = run_app("specdec", "/", TINY)
        yield {"url": url, "verifier": verifier, "drafter": drafter}


def post(server, path, body=None, content=None, timeout=60):
    # serialized here: JSON's \uXXXX escapes carry lone surrogates, which httpx's UTF-8 encoding refuses
    content = json.dumps(body) if content is None else content
    return httpx.post(server["url"] + path, content=content, timeout=timeout, headers={"content-type": "application/json"})


def chat(**kw):
    return {"model": "tiny", "messages": CHAT, "max_tokens": 24, "temperature": 0, **kw}


def assert_error(r, status, param):
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json") and r.headers.get("x-request-id")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param, err
    return err


def loop_stats():
    from ray import serve

    return serve.get_deployment_handle("OpenAIIngress", "specdec").loop_stats.remote().result()


def test_tiny_temperature_shares_a_batch_without_stalling_it(server):
    """Temperatures inside the schema's 0-2 whose 1/T overflows decode greedily; a normal request
    in the same rounds finishes in normal time, and no Verifier call fails."""
    want = post(server, "/v1/chat/completions", chat()).json()["choices"][0]["message"]["content"]
    before = loop_stats()["verifier_failures"]
    with cf.ThreadPoolExecutor(4) as pool:
        t0 = time.monotonic()
        normal = pool.submit(post, server, "/v1/chat/completions", chat(temperature=0.8, seed=3))
        odd = [pool.submit(post, server, "/v1/chat/completions", chat(temperature=t)) for t in (1e-38, 1e-45, 5e-324)]
        r = normal.result()
        took = time.monotonic() - t0
        assert r.status_code == 200, r.text
        for f in odd:
            assert f.result().status_code == 200, f.result().text
            assert f.result().json()["choices"][0]["message"]["content"] == want
    assert took < 10, f"a request beside tiny temperatures took {took:.1f} s"
    assert loop_stats()["verifier_failures"] == before


def test_lone_surrogates_get_400_naming_the_field(server):
    r = post(server, "/v1/completions", {"model": "tiny", "prompt": "a\ud800b", "max_tokens": 4})
    assert "surrogate" in assert_error(r, 400, "prompt")["message"]
    r = post(server, "/v1/completions", {"model": "tiny", "prompt": ["ok", "a\udfffb"], "max_tokens": 4})
    assert_error(r, 400, "prompt")
    r = post(server, "/v1/chat/completions", chat(messages=[{"role": "user", "content": "x\ud800"}]))
    assert_error(r, 400, "messages.0.content")
    r = post(server, "/v1/chat/completions", chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": "\udc00"}]}]))
    assert_error(r, 400, "messages.0.content.0.text")
    assert_error(post(server, "/v1/chat/completions", chat(stop=["\ud800"])), 400, "stop")
    # an error message that quotes the text still renders (as an escape)
    r = post(server, "/v1/chat/completions", chat(model="m\ud800"))
    assert "\\ud800" in assert_error(r, 404, "model")["message"]


def test_content_parts_the_model_cannot_read_are_refused(server):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    msgs = [{"role": "user", "content": [{"type": "text", "text": "What is in this picture?"}, image]}]
    err = assert_error(post(server, "/v1/chat/completions", chat(messages=msgs)), 400, "messages.0.content.1.type")
    assert "image_url" in err["message"]
    audio = [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]
    assert "input_audio" in assert_error(post(server, "/v1/chat/completions", chat(messages=audio)), 400,
                                         "messages.0.content.0.type")["message"]
    text_only = [{"role": "user", "content": [{"type": "text", "text": "Tell me about "},
                                              {"type": "text", "text": "speculative decoding."}]}]
    r = post(server, "/v1/chat/completions", chat(messages=text_only))
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == \
        post(server, "/v1/chat/completions", chat()).json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize("path,body,content,param", [
    ("/v1/chat/completions", None, b'{"model": "tiny", "messages": [', None),  # not JSON: no field to name
    ("/v1/completions", None, b'{"model": "tiny", "prompt": "x",,}', None),
    ("/v1/completions", {"model": "tiny", "prompt": "x" * 300, "max_tokens": 2}, None, "prompt"),  # over-long
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": "x" * 300}]), None, "messages"),
    ("/v1/completions", {"model": "tiny", "prompt": 5}, None, "prompt"),  # a union's member is not a field
    ("/v1/completions", {"model": "tiny", "prompt": [[1, "a"]]}, None, "prompt"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": 5}]), None, "messages.0.content"),
    ("/v1/chat/completions", chat(messages=[{"role": "robot", "content": "hi"}]), None, "messages.0.role"),
    ("/v1/chat/completions", None, json.dumps(chat()).replace('"temperature": 0', '"temperature": 1e400'),
     "temperature"),  # Python's JSON reads it as inf
    ("/v1/chat/completions", chat(seed=2**64), None, "seed"),
    ("/v1/chat/completions", None, b"[]", None),  # JSON, but not an object
])
def test_error_params_name_the_field_or_none(server, path, body, content, param):
    assert_error(post(server, path, body, content), 400, param)


def test_no_route_answers_plain_text(server):
    assert_error(httpx.get(server["url"] + "/v1/nope"), 404, None)
    assert_error(httpx.put(server["url"] + "/v1/models"), 405, None)
    r = httpx.post(server["url"] + "/v1/completions", content=b"\xff\xfe", headers={"content-type": "application/json"})
    assert_error(r, 400, None)


def test_health_reports_the_drafter(server):
    r = httpx.get(server["url"] + "/health", timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "ok"
    assert r.json()["verifier"] == "ok" and r.json()["drafter"] in ("ok", "unavailable")


def metric(text: str, name: str, **labels) -> float:
    """The sum of a metric's samples whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z0-9_:]+)(?:\{(.*)\})? (\S+)$", line)
        if not m or m.group(1) != name:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
    return total


VLLM_NAMES = ["spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total",
              "spec_decode_num_accepted_tokens_per_pos_total", "num_requests_running", "num_requests_waiting",
              "prompt_tokens_total", "generation_tokens_total", "request_success_total",
              "time_to_first_token_seconds_count", "inter_token_latency_seconds_count", "e2e_request_latency_seconds_count",
              "prefix_cache_queries_total", "prefix_cache_hits_total", "kv_cache_usage_perc"]


def test_metrics_speak_vllms_names_and_move(server):
    scrape = lambda: httpx.get(server["url"] + "/metrics", timeout=10).text  # noqa: E731
    before = scrape()
    r = post(server, "/v1/chat/completions", chat(max_tokens=20, num_speculative_tokens=3))
    assert r.status_code == 200
    n = r.json()["usage"]["completion_tokens"]
    text = r.json()["choices"][0]["message"]["content"]
    r = post(server, "/v1/chat/completions", chat(max_tokens=20, prediction={"type": "content", "content": text}))
    predicted = r.json()["usage"]["completion_tokens_details"]
    assert_error(post(server, "/v1/chat/completions", chat(n=2)), 400, "n")
    time.sleep(5.1)  # the cache figures are asked for at most every 5 s
    after = scrape()
    for name in VLLM_NAMES:
        assert re.search(rf"^specdec:{name}\{{[^}}]*model_name=\"tiny\"", after, re.M), name
    d = lambda name, **kw: metric(after, "specdec:" + name, **kw) - metric(before, "specdec:" + name, **kw)  # noqa: E731
    assert d("generation_tokens_total") >= n and d("prompt_tokens_total") > 0
    assert d("spec_decode_num_drafts_total") > 0 and d("spec_decode_num_draft_tokens_total") > 0
    assert d("spec_decode_num_accepted_tokens_total") == pytest.approx(
        sum(d("spec_decode_num_accepted_tokens_per_pos_total", position=str(j)) for j in range(16)))
    assert d("request_success_total", finished_reason="length") + d("request_success_total", finished_reason="stop") == 2
    assert d("time_to_first_token_seconds_count") == 2 and d("e2e_request_latency_seconds_count") == 2
    for kind in ("accepted", "rejected"):
        assert d("prediction_tokens_total", kind=kind) == predicted[f"{kind}_prediction_tokens"]
    assert d("request_errors_total", status="400") >= 1
    assert d("prefix_cache_queries_total") > 0 and metric(after, "specdec:kv_cache_usage_perc") >= 0


def test_abandoned_stream_is_counted(server):
    scrape = lambda: httpx.get(server["url"] + "/metrics", timeout=10).text  # noqa: E731
    before = metric(scrape(), "specdec:request_success_total", finished_reason="abort")
    body = chat(max_tokens=200, ignore_eos=True, stream=True)
    with httpx.stream("POST", server["url"] + "/v1/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert any(next(lines).startswith("data: ") for _ in range(4))
    deadline = time.time() + 20
    while time.time() < deadline and metric(scrape(), "specdec:request_success_total", finished_reason="abort") == before:
        time.sleep(0.2)
    assert metric(scrape(), "specdec:request_success_total", finished_reason="abort") == before + 1
