"""Error shapes and the OpenAPI document of the ingress, without Ray: no route can answer a
plain-text 500, error params name a field (or null), and the schema documents what the server
answers (no 422, an ErrorResponse per status, response models, the event stream)."""
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from deployments.ingress import RequestIds, _api_error, _field_path, app
from deployments.openai_protocol import APIError, ChatCompletionRequest


def test_an_unhandled_exception_is_an_openai_500_with_a_request_id():
    toy = FastAPI()
    toy.add_exception_handler(APIError, _api_error)
    toy.add_middleware(RequestIds)

    @toy.get("/boom")
    async def boom():
        raise TypeError("a bug")

    @toy.get("/refused")
    async def refused():
        raise APIError(400, "no", param="x")

    client = TestClient(toy, raise_server_exceptions=False)
    r = client.get("/boom")
    assert r.status_code == 500 and r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    rid = r.headers["x-request-id"]
    assert err["type"] == "server_error" and err["code"] == "internal_error" and rid in err["message"]
    r = client.get("/refused")
    assert r.status_code == 400 and r.json()["error"]["param"] == "x" and r.headers["x-request-id"] != rid


@pytest.mark.parametrize("loc,param", [
    (("body", 10), "10"),  # a plain index stays (a list position), but...
    (("body", "prompt", "str"), "prompt"),  # ...a union member's tag is no field
    (("body", "prompt", "list[int]", 0), "prompt"),
    (("body", "messages", 0, "content", "list[ContentPart]", 1, "type"), "messages.0.content"),
    (("body", "messages", 0, "role"), "messages.0.role"),
    (("body",), None),
    ((), None),
])
def test_field_paths(loc, param):
    assert _field_path(loc) == param


def test_an_error_quoting_a_lone_surrogate_still_renders():
    r = APIError(404, "model 'm\ud800' does not exist", param="model").response()
    assert b"m\\\\ud800" in r.body  # the escape, as text


def test_content_parts_other_than_text_are_refused_naming_their_type():
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": [
        {"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "x"}}]}])
    with pytest.raises(APIError) as e:
        req.check_supported()
    assert e.value.status == 400 and e.value.param == "messages.0.content.1.type" and "image_url" in e.value.message


def test_openapi_documents_the_real_answers():
    schema = app.openapi()
    ops = {(path, method): op for path, item in schema["paths"].items() for method, op in item.items()}
    assert all("422" not in op["responses"] for op in ops.values())
    assert "HTTPValidationError" not in schema["components"]["schemas"]
    for path in ("/v1/chat/completions", "/v1/completions"):
        responses = ops[(path, "post")]["responses"]
        assert {"200", "400", "401", "404", "408", "429", "500", "503"} <= set(responses)
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
        assert responses["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    assert ops[("/v1/chat/completions", "post")]["responses"]["200"]["content"]["application/json"]["schema"][
        "$ref"].endswith("/ChatCompletion")
    assert {"200", "503"} <= set(ops[("/health", "get")]["responses"])
    assert "text/plain" in ops[("/metrics", "get")]["responses"]["200"]["content"]
    assert {"ChatCompletionChunk", "Completion", "ErrorResponse", "ModelList", "Health"} <= set(
        schema["components"]["schemas"])
