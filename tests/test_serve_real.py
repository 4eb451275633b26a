"""The Serve app exactly as serve_config.yaml describes it (embedded SmolLM2 + shipped draft head),
on a local cluster that provides its large_gpu resource."""
import pytest
from openai import OpenAI

from serve_helpers import run_app, serve_cluster

pytestmark = [pytest.mark.integration, pytest.mark.serve]


def test_default_app_streams_with_speculation_stats():
    from ray import serve

    with serve_cluster() as url:
        run_app("specdec", "/", {"api_keys_env": None})
        status = serve.status().applications["specdec"]
        # the draft head drafts inside the Verifier: no Drafter deployment
        assert {n: d.status for n, d in status.deployments.items()} == {"Verifier": "HEALTHY", "OpenAIIngress": "HEALTHY"}
        client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        chunks = list(client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Name the capital city of France."}],
            max_tokens=24, temperature=0, stream=True, stream_options={"include_usage": True}))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        # (asked "What is the capital of France?", this model's first token is a near-tie between
        # "The" and "L" in float32; llama.cpp's Q4_1 arithmetic, and ours in int4, take "L'Étoile")
        assert "Paris" in text
        spec = chunks[-1].usage.model_extra["speculative"]
        assert spec["num_verifier_passes"] >= 1 and "acceptance_rate" in spec
        plain = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Name the capital city of France."}],
            max_tokens=24, temperature=0, extra_body={"num_speculative_tokens": 0})
        assert plain.choices[0].message.content == text  # lossless through the whole distributed path
        predicted = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Name the capital city of France."}],
            max_tokens=24, temperature=0, prediction={"type": "content", "content": text})
        assert predicted.choices[0].message.content == text
        usage = predicted.usage  # the prefill's pass, then each pass keeps copies of the prediction
        assert usage.completion_tokens_details.accepted_prediction_tokens >= usage.completion_tokens // 2
        assert usage.model_extra["speculative"]["num_verifier_passes"] <= usage.completion_tokens // 2
