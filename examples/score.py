"""Score continuations by the verifier's log-likelihood (multiple choice, as eval harnesses do):
one completions call with every context + continuation as a prompt, `echo` and `logprobs`, and
`max_tokens=0`, so nothing is generated and each prompt token comes back with its logprob.

    .venv/bin/python examples/score.py "The capital of France is" " Paris" " Rome" " Berlin"
"""
from __future__ import annotations

import os
import sys

from openai import OpenAI

BASE_URL = os.environ.get("SPECDEC_URL", "http://127.0.0.1:8000/v1")
API_KEY = os.environ.get("SPECDEC_API_KEY", "none")


def score(client: OpenAI, context: str, continuations: list[str], model: str = "SmolLM2-135M-Instruct") -> list[float]:
    """Sum of the continuation tokens' logprobs given the context, per continuation."""
    r = client.completions.create(model=model, prompt=[context + c for c in continuations], max_tokens=0,
                                  echo=True, logprobs=0, temperature=0)
    totals = []
    for choice in sorted(r.choices, key=lambda c: c.index):
        lp = choice.logprobs
        # the continuation's tokens are those that start at or after the context's end
        totals.append(sum(x for x, at in zip(lp.token_logprobs, lp.text_offset) if at >= len(context) and x is not None))
    return totals


def main() -> int:
    if len(sys.argv) < 3:
        print(__doc__)
        return 2
    context, continuations = sys.argv[1], sys.argv[2:]
    totals = score(OpenAI(base_url=BASE_URL, api_key=API_KEY), context, continuations)
    for c, t in sorted(zip(continuations, totals), key=lambda x: -x[1]):
        print(f"{t:9.3f}  {context}{c}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
