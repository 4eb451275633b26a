"""What each precision costs the default verifier in quality: the mean negative log-likelihood
of the benchmark prompts' text, up to 1,000 tokens (teacher-forced, one pass) in float32, in int4 on torch's
kernel (bfloat16 activations) and in int4 on specdec's kernels (int8 activations, 8-bit LM head).
Writes bench/results/precision.json.

    .venv/bin/python bench/precision.py"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def build(variant: str):
    from specdec.models import kernels, quant
    from specdec.models.loader import load_model

    model = load_model("default", "cpu", "float32", progress=False)
    if variant == "float32":
        return model
    model = model.to(quant.ACT_DTYPE)
    real = kernels.load
    if variant == "int4_torch":  # as if specdec's kernels could not be built
        kernels.load = lambda verbose=False: False
    try:
        quant.quantize_model(model, compiled=False)
    finally:
        kernels.load = real
    return model


def nll(model, ids: list[int]) -> float:
    from specdec.models.runner import ModelRunner

    runner = ModelRunner(model, 1, 2048, prefix_caching=False)
    runner.sync(["doc"], [ids], [0])
    with torch.no_grad():
        hidden, _ = runner.forward(["doc"], [ids])
        logits = model.logits(hidden[0]).float()
    return torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:])).item()


def main() -> None:
    from specdec.models.loader import load_tokenizer

    torch.set_num_threads(2)
    prompts = json.loads((ROOT / "specdec" / "bench" / "prompts.json").read_text())
    text = "\n\n".join(m["content"] for p in prompts for m in p.get("messages", []))
    ids = load_tokenizer("default", progress=False)(text)["input_ids"][:1000]
    out = {"tokens": len(ids), "text": "specdec/bench/prompts.json (messages)", "nll": {v: round(nll(build(v), ids), 4)
                                                          for v in ("float32", "int4_torch", "int4")}}
    (ROOT / "bench" / "results" / "precision.json").write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
