"""The Serve application on a real (local) Ray cluster with tiny models, through HTTP and the
official openai SDK."""
import concurrent.futures as cf
import time

import httpx
import pytest
from openai import OpenAI

from conftest import tiny_head_dir
from serve_helpers import run_app, serve_cluster

pytestmark = pytest.mark.serve

KEY = "sk-test-key-123"
# the models and sizes only; everything else as serve_config.yaml ships it
MODELS = {"verifier": "tiny", "draft": "tiny:noise=0.05", "model_name": "tiny", "num_threads": 1,
          "max_model_len": 256, "max_seqs": 24}
# fixed K (adaptive off) where a test needs drafts in every round
TINY = {**MODELS, "adaptive": False}
CHAT = [{"role": "user", "content": "Tell me about speculative decoding."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"{KEY}\nsk-other\n")
    # five apps: a model replica asks for half a small_gpu or large_gpu
    with serve_cluster(resources={"small_gpu": 2, "large_gpu": 3}) as url:
        verifier, drafter = run_app("specdec", "/", {**TINY, "api_keys_file": str(keys)})
        # one decoding step per call keeps a 200-token request well over its 0.5 s timeout
        run_app("limited", "/limited", {**TINY, "draft": "none", "rate_limit": "4/minute", "decode_steps": 1,
                                        "request_timeout_s": 0.5, "api_keys_env": None})
        run_app("shipped", "/shipped", {**MODELS, "api_keys_env": None})
        # a draft head: it drafts in the Verifier's calls, chains, and token trees of three children a node
        head = str(tiny_head_dir(tmp_path_factory.mktemp("head")))
        run_app("head", "/head", {**TINY, "draft": head, "api_keys_env": None})
        run_app("tree", "/tree", {**TINY, "draft": head, "draft_tree_width": 3, "api_keys_env": None})
        yield {"url": url, "verifier": verifier, "drafter": drafter}


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server["url"] + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def reference():
    """The in-process engine on the same tiny models: what the server must reproduce."""
    from specdec.config import EngineConfig
    from specdec.engine import SpecEngine

    return SpecEngine.from_config(EngineConfig(verifier="tiny", draft="tiny:noise=0.05", progress=False))


def greedy(reference, messages, n=40):
    from specdec.sampling import SamplingParams

    return reference.generate([messages], SamplingParams(max_tokens=n))[0]


def post(server, path, body, key=KEY, prefix=""):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server["url"] + prefix + path, json=body, headers=headers, timeout=60)


def test_chat_non_streaming_equals_engine(client, reference):
    r = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=40, temperature=0)
    want = greedy(reference, CHAT)
    assert r.choices[0].message.content == want.text
    assert r.usage.completion_tokens == len(want.token_ids)
    spec = r.usage.model_extra["speculative"]
    assert spec["num_drafted"] > 0 and 0 < spec["acceptance_rate"] <= 1 and spec["mean_accepted_length"] > 1


def test_round_trace_reports_what_each_round_did(client):
    """The ingress's round trace: what each round drafted, accepted and emitted, and what it cost."""
    from ray import serve

    client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=40, temperature=0)
    last = serve.get_deployment_handle("OpenAIIngress", "specdec").loop_stats.remote().result()["recent_rounds"][-3:]
    assert all(r["emitted"] == [a + 1 for a in r["accepted"]] and r["verify_s"] > 0 for r in last if r["steps"] == 1)
    assert any(r["drafted"][0] > 0 for r in last)


def test_the_shipped_config_serves_the_engines_greedy_output(server, reference):
    """serve_config.yaml as shipped (adaptive K, prompt lookup, multi-step plain calls), on the
    tiny models: greedy output equals the in-process engine's, sampled requests are served."""
    want = greedy(reference, CHAT).text
    for temperature in (0, 0, 0.8):  # the second greedy request meets a warmed-up adaptive K
        r = post(server, "/v1/chat/completions", {"model": "tiny", "messages": CHAT, "max_tokens": 40,
                                                  "temperature": temperature, "seed": 5}, key=None, prefix="/shipped")
        assert r.status_code == 200
        assert temperature or r.json()["choices"][0]["message"]["content"] == want


def test_token_trees_through_serve_keep_the_greedy_output(server, reference):
    r = post(server, "/v1/chat/completions", {"model": "tiny", "messages": CHAT, "max_tokens": 40, "temperature": 0},
             key=None, prefix="/tree")
    assert r.status_code == 200
    assert r.json()["choices"][0]["message"]["content"] == greedy(reference, CHAT).text
    spec = r.json()["usage"]["speculative"]
    assert spec["num_drafted"] > 3 * spec["num_verifier_passes"]  # trees: several drafts a depth


def test_a_draft_head_drafts_inside_the_verifiers_calls(server, reference):
    """The head app has no Drafter: the Verifier drafts before each pass of its calls. Greedy
    output is the engine's, every token has its logprobs, and a seed fixes sampled output."""
    from ray import serve

    assert "Drafter" not in serve.status().applications["head"].deployments
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 40, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    r = post(server, "/v1/chat/completions", body, key=None, prefix="/head").json()
    assert r["choices"][0]["message"]["content"] == greedy(reference, CHAT).text
    assert len(r["choices"][0]["logprobs"]["content"]) == r["usage"]["completion_tokens"] == 40
    spec = r["usage"]["speculative"]
    assert spec["num_drafted"] > spec["num_verifier_passes"] > 1  # K drafts in the passes after the prefill
    sampled = {**body, "temperature": 0.8, "seed": 3}
    texts = [post(server, "/v1/chat/completions", sampled, key=None, prefix="/head").json()["choices"][0]["message"]
             ["content"] for _ in range(2)]
    assert texts[0] == texts[1]


def test_a_draft_call_after_its_sequence_ended_drafts_and_caches_nothing():
    from deployments.replicas import Drafter
    from specdec.protocol import ProposeRequest
    from specdec.sampling import SamplingParams

    d = Drafter.func_or_class({**TINY, "draft": "tiny:noise=0.05"})
    req = ProposeRequest("a", list(range(5, 25)), 4, SamplingParams(max_tokens=50, temperature=0.8, seed=3))
    assert len(d._propose([req])[0].token_ids) == 4
    d.free(["a"])
    assert d._propose([req])[0].token_ids == [] and "a" not in d.proposer.runner.slots


def test_chat_streaming_chunks_and_usage(client, reference):
    stream = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=40, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == greedy(reference, CHAT).text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.model_extra["speculative"]["num_verifier_passes"] > 0
    # one chunk per verifier pass (accepted block), not one per token
    content_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content_chunks) < 40


def test_completions_and_models(client, server):
    r = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=12, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 12
    parts = list(client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=12, temperature=0,
                                           stream=True))
    assert "".join(p.choices[0].text for p in parts) == r.choices[0].text
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_seeded_sampling_reproducible_over_http(client):
    a, b = (client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=20, temperature=0.8, top_p=0.9,
                                           seed=42).choices[0].message.content for _ in range(2))
    assert a == b


def test_sixteen_concurrent_users_share_verifier_passes(client, server, reference):
    prompts = [[{"role": "user", "content": f"Question number {i}: " + "why? " * (i % 5)}] for i in range(16)]
    before = len(server["verifier"].stats.remote().result()["batch_sizes"])

    want = [greedy(reference, m, 30).text for m in prompts]

    def one(i):  # every third user sends its answer as a prediction: it shares the passes too
        extra = {"prediction": {"type": "content", "content": want[i]}} if i % 3 == 0 else {}
        return client.chat.completions.create(model="tiny", messages=prompts[i], max_tokens=30, temperature=0, **extra)

    with cf.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(16)))
    assert all(r.choices[0].finish_reason in ("length", "stop") for r in results)
    for w, r in zip(want, results):  # greedy under concurrency equals single-user greedy
        assert r.choices[0].message.content == w
    sizes = server["verifier"].stats.remote().result()["batch_sizes"][before:]
    print(f"verifier batch sizes with 16 users: max {max(sizes)}, mean {sum(sizes) / len(sizes):.2f}")
    assert max(sizes) > 1 and sum(sizes) / len(sizes) > 2


@pytest.mark.parametrize("body,status,param", [
    ({"max_tokens": -1}, 400, "max_tokens"),
    ({"max_tokens": 10**6}, 400, "max_tokens"),
    ({"temperature": 3.5}, 400, "temperature"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "x" * 400}]}, 400, "messages"),  # longer than the context
    ({"n": 2}, 400, "n"),
    ({"top_p": 0}, 400, "top_p"),
    ({"model": "gpt-17"}, 404, "model"),
    ({"num_speculative_tokens": 99}, 400, "num_speculative_tokens"),
    ({"top_logprobs": 2}, 400, "top_logprobs"),  # without logprobs: true
    ({"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ({"presence_penalty": 0.5}, 400, "presence_penalty"),  # known but not implemented: refused, not ignored
    ({"logit_bias": {"5": 10}}, 400, "logit_bias"),
    ({"min_p": 0.1}, 400, "min_p"),  # vLLM's, as above
    ({"modalities": ["text", "audio"]}, 400, "modalities"),
    ({"stop_token_ids": [10**6]}, 400, "stop_token_ids"),
    ({"prediction": {"type": "file", "content": "x"}}, 400, "prediction.type"),
    ({"prediction": {"type": "content", "content": [{"type": "image_url"}]}}, 400, "prediction.content.0"),
    ({"prediction": {"type": "content", "content": "ab " * 400}}, 400, "prediction.content"),  # over the context
])
def test_bad_requests_get_openai_errors(server, body, status, param):
    r = post(server, "/v1/chat/completions", {"model": "tiny", "messages": CHAT, "max_tokens": 5, **body})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param


def test_a_prediction_keeps_the_output_and_counts_its_tokens(server, client, reference):
    """OpenAI's Predicted Outputs through the SDK: the same text, with the prediction's drafts
    counted as OpenAI reports them; also where a draft head drafts inside the Verifier's calls,
    which copy the prediction in every pass. (The tiny model's text does not encode back to its
    tokens, so most copies are refused here; test_serve_real.py has them kept.)"""
    want = greedy(reference, CHAT, 40).text
    r = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=40, temperature=0,
                                       prediction={"type": "content", "content": want})
    details = r.usage.completion_tokens_details
    assert r.choices[0].message.content == want
    assert details.accepted_prediction_tokens + details.rejected_prediction_tokens > 0
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 40, "temperature": 0,
            "prediction": {"type": "content", "content": want}}
    r = post(server, "/v1/chat/completions", body, key=None, prefix="/head").json()
    assert r["choices"][0]["message"]["content"] == want
    assert sum(r["usage"]["completion_tokens_details"].values()) > 0
    plain = client.completions.create(model="tiny", prompt="abc", max_tokens=20, temperature=0)
    r = client.completions.create(model="tiny", prompt="abc", max_tokens=20, temperature=0,
                                  extra_body={"prediction": {"type": "content", "content": plain.choices[0].text}})
    assert r.choices[0].text == plain.choices[0].text


def test_stop_token_ids_end_the_output(server, reference):
    ref = greedy(reference, CHAT, 20)
    r = post(server, "/v1/chat/completions", {"model": "tiny", "messages": CHAT, "max_tokens": 20, "temperature": 0,
                                              "stop_token_ids": [ref.token_ids[6]]}).json()
    assert r["choices"][0]["finish_reason"] == "stop"
    assert r["usage"]["completion_tokens"] == ref.token_ids.index(ref.token_ids[6])


def test_logprobs_over_http_are_the_engines(client, reference):
    """Chat and completions logprobs in OpenAI's shapes, streamed or not, equal the in-process
    engine's (the verifier's own, whichever round made each token); unimplemented fields at
    their do-nothing values are accepted."""
    from specdec.sampling import SamplingParams

    want = reference.generate([CHAT], SamplingParams(max_tokens=24, logprobs=2))[0]
    text = reference.tokenizer.token_text
    r = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=24, temperature=0, logprobs=True,
                                       top_logprobs=2, presence_penalty=0, logit_bias={})
    got = r.choices[0].logprobs.content
    assert r.choices[0].message.content == want.text and len(got) == len(want.token_ids) == r.usage.completion_tokens
    assert [g.token for g in got] == [text(t) for t in want.token_ids]
    assert all(g.bytes == list(g.token.encode()) and len(g.top_logprobs) == 2 for g in got)
    assert [g.top_logprobs[0].token for g in got] == [g.token for g in got]  # greedy: each token is its argmax
    assert [g.logprob for g in got] == pytest.approx([w.logprob for w in want.logprobs], abs=1e-4)
    streamed = [c.choices[0].logprobs for c in client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=24, temperature=0, logprobs=True, top_logprobs=2, stream=True)
        if c.choices and c.choices[0].logprobs]
    assert [x.token for lp in streamed for x in lp.content] == [g.token for g in got]
    assert [x.logprob for lp in streamed for x in lp.content] == pytest.approx([g.logprob for g in got], abs=1e-4)
    plain = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None

    c = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=12, temperature=0, logprobs=1)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 12
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:j]) for j in range(12)]
    assert all(lp.tokens[j] in lp.top_logprobs[j] and lp.top_logprobs[j][lp.tokens[j]] == lp.token_logprobs[j]
               for j in range(12))
    parts = [p.choices[0].logprobs for p in client.completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=12, temperature=0, logprobs=1, stream=True)
        if p.choices[0].logprobs and p.choices[0].logprobs.tokens]
    assert [t for p in parts for t in p.tokens] == lp.tokens
    assert [o for p in parts for o in p.text_offset] == lp.text_offset


def test_echo_scores_prompts_as_eval_harnesses_ask(server, client, reference):
    """lm-eval-harness style loglikelihood requests: a list of token-id prompts, echo, logprobs,
    max_tokens 0 or 1. Each choice echoes its prompt with the verifier's logprobs for every
    prompt token after the first (None for it), then any output; streamed, the prompt comes first."""
    tok = reference.tokenizer
    prompts = [tok.encode("Once upon a time there was"), tok.encode("The quick brown fox")]
    want = [reference.verifier.prompt_logprobs(f"ref-{i}", p, 1) for i, p in enumerate(prompts)]
    r = post(server, "/v1/completions", {"model": "tiny", "prompt": prompts, "max_tokens": 0, "echo": True,
                                         "logprobs": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["prompt_tokens"] == sum(map(len, prompts)) and body["usage"]["completion_tokens"] == 0
    for choice, p, w in zip(sorted(body["choices"], key=lambda c: c["index"]), prompts, want):
        lp = choice["logprobs"]
        assert choice["text"] == tok.decode(p) and choice["finish_reason"] == "length"
        assert lp["tokens"] == [tok.token_text(t) for t in p]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["token_logprobs"][1:] == pytest.approx([x.logprob for x in w], abs=1e-4)
    text = "Once upon a time"
    one = client.completions.create(model="tiny", prompt=text, max_tokens=3, temperature=0, echo=True, logprobs=2)
    plain = client.completions.create(model="tiny", prompt=text, max_tokens=3, temperature=0, logprobs=2)
    n = len(tok.encode(text))
    assert one.choices[0].text == text + plain.choices[0].text
    assert one.choices[0].logprobs.tokens[n:] == plain.choices[0].logprobs.tokens and len(one.choices[0].logprobs.tokens) == n + 3
    assert one.choices[0].logprobs.token_logprobs[n:] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-4)
    parts = list(client.completions.create(model="tiny", prompt=text, max_tokens=3, temperature=0, echo=True,
                                           logprobs=2, stream=True))
    assert parts[0].choices[0].text == text and len(parts[0].choices[0].logprobs.tokens) == n
    assert "".join(p.choices[0].text for p in parts) == one.choices[0].text
    assert [t for p in parts if p.choices[0].logprobs for t in p.choices[0].logprobs.tokens] == one.choices[0].logprobs.tokens
    assert client.completions.create(model="tiny", prompt=text, max_tokens=2, echo=True).choices[0].text.startswith(text)
    only = [p for p in client.completions.create(model="tiny", prompt=text, max_tokens=0, echo=True, logprobs=0,
                                                 stream=True, stream_options={"include_usage": True})]
    assert [(p.choices[0].text, p.choices[0].finish_reason) for p in only if p.choices] == [(text, "length")]
    assert only[0].choices[0].logprobs.token_logprobs[1:] == pytest.approx(one.choices[0].logprobs.token_logprobs[1:n], abs=1e-4)
    assert only[-1].usage.completion_tokens == 0 and only[-1].usage.prompt_tokens == n
    for bad, param in (({"max_tokens": 0}, "max_tokens"), ({"prompt": ["a", "b"], "stream": True}, "prompt")):
        r = post(server, "/v1/completions", {"model": "tiny", "prompt": text, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_score_example_sums_the_continuations_logprobs(client, reference):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "examples" / "score.py"
    spec = importlib.util.spec_from_file_location("score_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    context, conts = "Once upon a", [" time", " banana"]
    got = example.score(client, context, conts, model="tiny")
    tok = reference.tokenizer  # the tiny tokenizer is byte-level: a continuation is its own tokens
    want = [sum(x.logprob for x in reference.verifier.prompt_logprobs(f"ex-{c}", tok.encode(context + c), 0)[-len(tok.encode(c)):])
            for c in conts]
    assert got == pytest.approx(want, abs=1e-3)


def test_auth(server):
    assert post(server, "/v1/chat/completions", {"model": "tiny", "messages": CHAT}, key=None).status_code == 401
    r = post(server, "/v1/chat/completions", {"model": "tiny", "messages": CHAT}, key="sk-wrong")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert "sk-wrong" not in r.text
    assert post(server, "/v1/chat/completions", {"model": "tiny", "messages": CHAT, "max_tokens": 3},
                key="sk-other").status_code == 200


def test_timeout_then_rate_limit_on_limited_app(server):
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 200, "ignore_eos": True}
    r = post(server, "/v1/chat/completions", body, key=None, prefix="/limited")
    assert r.status_code == 408 and r.json()["error"]["type"] == "timeout"
    codes = [post(server, "/v1/chat/completions", {**body, "max_tokens": 1}, key=None, prefix="/limited").status_code
             for _ in range(4)]
    assert codes[:3] == [200, 200, 200] and codes[3] == 429
    r = post(server, "/v1/chat/completions", {**body, "max_tokens": 1}, key=None, prefix="/limited")
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    assert r.json()["error"]["type"] == "rate_limit_error"


def test_bad_input_does_not_harm_other_streams(server, client, reference):
    with cf.ThreadPoolExecutor(4) as pool:
        good = pool.submit(lambda: "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="tiny", messages=CHAT, max_tokens=40, temperature=0, stream=True) if c.choices))
        bad = [pool.submit(post, server, "/v1/chat/completions", {"model": "tiny", "messages": [], "max_tokens": -5})
               for _ in range(6)]
        assert all(b.result().status_code == 400 for b in bad)
        assert good.result() == greedy(reference, CHAT).text
    assert httpx.get(server["url"] + "/health").json()["status"] == "ok"


def test_client_disconnect_frees_sequence_on_both_replicas(server):
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 200, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server["url"] + "/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
        busy = server["verifier"].stats.remote().result()["resident_sequences"]
        assert len(busy) == 1
    deadline = time.time() + 20
    while time.time() < deadline:
        v = server["verifier"].stats.remote().result()["resident_sequences"]
        d = server["drafter"].stats.remote().result()["resident_sequences"]
        if not v and not d:
            break
        time.sleep(0.2)
    assert v == [] and d == []


def test_metrics_and_health(server, client):
    assert httpx.get(server["url"] + "/health").json()["status"] == "ok"
    client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, temperature=0)
    text = httpx.get(server["url"] + "/metrics").text
    assert "specdec:prompt_tokens_total" in text and "specdec:spec_decode_num_accepted_tokens_total" in text
    # a speculative round's calls, as the ingress saw them
    assert 'specdec:replica_call_seconds_count{deployment="Verifier"}' in text
    assert 'specdec:replica_call_seconds_count{deployment="Drafter"}' in text
    # replica stats let an operator see how busy the model calls keep the cores
    assert {"busy_s", "cpu_s"} <= set(server["drafter"].stats.remote().result())
    r = httpx.get(server["url"] + "/v1/nope")
    assert r.status_code == 404 and "error" in r.json()


def test_health_says_starting_until_every_deployment_answers():
    import asyncio

    from deployments.ingress import replicas_answer

    class Handle:  # stands in for a DeploymentHandle whose replica answers after `delay` seconds
        def __init__(self, delay):
            self.where = self
            self.delay = delay

        def remote(self):
            return asyncio.sleep(self.delay, result={"pid": 1})

    up, starting = Handle(0.0), Handle(60.0)
    assert asyncio.run(replicas_answer([up, up], timeout_s=0.5))
    assert not asyncio.run(replicas_answer([up, starting], timeout_s=0.2))
