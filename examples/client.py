"""Streaming chat against a specdec server with the official openai SDK, retrying 429/5xx with
exponential backoff and jitter (tenacity), and printing what speculation did.

    .venv/bin/python examples/client.py "Explain speculative decoding in two sentences."
"""
from __future__ import annotations

import os
import sys

import openai
from openai import OpenAI
from tenacity import retry, retry_if_exception, stop_after_attempt, wait_random_exponential

BASE_URL = os.environ.get("SPECDEC_URL", "http://127.0.0.1:8000/v1")
API_KEY = os.environ.get("SPECDEC_API_KEY", "none")  # any string when the server has no keys configured


def _retryable(exc: BaseException) -> bool:
    if isinstance(exc, openai.APIStatusError):
        return exc.status_code == 429 or exc.status_code >= 500  # Retry-After honoured via the backoff floor
    return isinstance(exc, (openai.APIConnectionError, openai.APITimeoutError))


@retry(retry=retry_if_exception(_retryable), wait=wait_random_exponential(multiplier=0.5, max=20),
       stop=stop_after_attempt(6), reraise=True)
def chat(client: OpenAI, prompt: str, **kw):
    stream = client.chat.completions.create(
        model=kw.pop("model", "SmolLM2-135M-Instruct"), messages=[{"role": "user", "content": prompt}],
        stream=True, stream_options={"include_usage": True}, **kw)
    usage = None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
        if chunk.usage:
            usage = chunk.usage
    print()
    return usage


def main() -> int:
    client = OpenAI(base_url=BASE_URL, api_key=API_KEY, max_retries=0)  # tenacity does the retrying
    usage = chat(client, " ".join(sys.argv[1:]) or "What is speculative decoding?", max_tokens=128, temperature=0)
    spec = (usage.model_extra or {}).get("speculative", {})
    print(f"\n{usage.completion_tokens} tokens | acceptance {spec.get('acceptance_rate')} | "
          f"mean accepted length {spec.get('mean_accepted_length')} | {spec.get('tokens_per_s')} tok/s | "
          f"{spec.get('ms_per_output_token')} ms/token | TTFT {spec.get('ttft_s')} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
