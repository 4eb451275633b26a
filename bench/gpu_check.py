"""GPU check (run where a CUDA device is lent): the engine's exactness on CUDA, and the verify cost
curve of a random-weight ~1B Llama built on the device (its weights are too big to travel).

    python3 bench/gpu_check.py [--out DIR] [--device cuda]

1. Exactness on the device, tiny random models: greedy speculative output equals the verifier's
   own greedy output (K=0) token for token, in float32 and bfloat16, for a batch of prompts; a
   seeded sampled run is reproducible and its first-token distribution matches the verifier's
   (chi-square against the target's softmax over many seeded runs).
2. Verify cost curve: median ms of one verifier pass over T = 1..16 new tokens after a 512-token
   context, at batch 1 and 16, for a Llama-3.2-1B-shaped model (bfloat16) — the shape of the curve
   is what adaptive K learns online; on a GPU it stays flat far longer than on the CPU.
Writes DIR/gpu-check.json (default bench/results)."""
from __future__ import annotations

import argparse
import json
import platform
import statistics as st
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specdec.bench.run import verify_cost_curve  # noqa: E402
from specdec.config import EngineConfig  # noqa: E402
from specdec.engine import SpecEngine  # noqa: E402
from specdec.models.llama import ModelArgs, Transformer  # noqa: E402
from specdec.models.runner import ModelRunner  # noqa: E402
from specdec.models.tiny import build_tiny, noisy_copy, tiny_args  # noqa: E402
from specdec.proposers import DraftModelProposer  # noqa: E402
from specdec.sampling import SamplingParams  # noqa: E402
from specdec.verifier import Verifier  # noqa: E402


def engine(target, draft, k, prefix_caching=True, **cfg) -> SpecEngine:
    """Target and draft model in one engine: 16 slots of 512 tokens; cfg: other EngineConfig fields."""
    runner = lambda m: ModelRunner(m, 16, 512, prefix_caching=prefix_caching)  # noqa: E731
    return SpecEngine(Verifier(runner(target)), DraftModelProposer(runner(draft)), None,
                      EngineConfig(**({"num_speculative_tokens": k, "adaptive": False, "max_batch_size": 16} | cfg)))


def exactness(device, dtype) -> dict:
    target = build_tiny(tiny_args(n_layers=4, dim=128, n_heads=4, n_kv_heads=2, intermediate_size=256), seed=0)
    draft = noisy_copy(target, 0.3)
    target, draft = target.to(device, dtype), draft.to(device, dtype)
    prompts = [[(7 * i + j) % 250 + 1 for j in range(5 + 3 * i)] for i in range(8)]
    greedy = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = engine(target, draft, 0).generate(prompts, greedy, num_speculative_tokens=0)
    spec = engine(target, draft, 4).generate(prompts, greedy)
    same = all(a.token_ids == b.token_ids for a, b in zip(plain, spec))
    # where they part: in reduced precision a K+1-token pass and K+1 one-token passes accumulate
    # in different orders, and a near-tie in the verifier's logits can flip (float32: none here)
    first_diff = [next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
                  for a, b in zip(plain, spec)]
    acc = st.mean(c.metrics.acceptance_rate for c in spec)
    sampled = [SamplingParams(max_tokens=24, temperature=0.8, seed=s, ignore_eos=True) for s in range(8)]
    s1 = engine(target, draft, 4).generate(prompts, sampled)
    s2 = engine(target, draft, 4).generate(prompts, sampled)
    return {"dtype": str(dtype), "greedy_spec_equals_k0": same, "first_differing_token": first_diff,
            "identical_sequences": sum(d is None for d in first_diff), "sequences": len(first_diff), "acceptance_rate": acc,
            "sampled_reproducible": all(a.token_ids == b.token_ids for a, b in zip(s1, s2))}


def first_token_distribution(device, n=3000) -> dict:
    """Speculative sampling's first emitted token vs the target's own softmax (temperature 1),
    over n seeded runs: the chi-square statistic over the tokens with expected count >= 5; the
    negative control is the same counts against the draft's softmax (what a sampler that skipped
    verification would follow), which must come out far larger."""
    target = build_tiny(seed=0).to(device)
    draft = noisy_copy(build_tiny(seed=0), 0.8).to(device)
    prompt = [5, 17, 42, 99, 3]
    with torch.no_grad():
        runner = ModelRunner(target, 1, 64)
        pending = runner.sync(["p"], [prompt], [0])
        p = torch.softmax(runner.last_logits(["p"], pending).float()[0], -1).cpu()
        druns = ModelRunner(draft, 1, 64)
        q = torch.softmax(druns.last_logits(["p"], druns.sync(["p"], [prompt], [0])).float()[0], -1).cpu()
    counts = torch.zeros_like(p)
    eng = engine(target, draft, 3)
    for start in range(0, n, 16):
        params = [SamplingParams(max_tokens=1, temperature=1.0, seed=start + i, ignore_eos=True) for i in range(16)]
        for c in eng.generate([prompt] * 16, params):
            counts[c.token_ids[0]] += 1
    n = int(counts.sum())

    def chi2_per_bin(dist):  # ~1 when the counts follow dist
        exp = dist * n
        keep = exp >= 5
        return float(((counts[keep] - exp[keep]) ** 2 / exp[keep]).sum()) / max(int(keep.sum()) - 1, 1)

    return {"runs": n, "chi2_per_bin_vs_target": chi2_per_bin(p), "chi2_per_bin_vs_draft_control": chi2_per_bin(q)}


def llama_1b(device, dtype) -> Transformer:
    args = ModelArgs(vocab_size=49152, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, intermediate_size=8192,
                     rope_theta=500000.0, max_position=4096, tie_embeddings=True)
    with torch.device(device):
        model = Transformer(args)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return model.to(dtype).eval()


@torch.no_grad()
def verify_curve(model, batch: int) -> dict[int, float]:
    ms = verify_cost_curve(ModelRunner(model, batch, 1024), ctx_len=512, max_tokens=16, reps=9, batch=batch, warmup=2)
    return {t: round(v, 3) for t, v in ms.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--skip-1b", action="store_true", help="exactness only (a CPU dry run)")
    a = ap.parse_args()
    device = torch.device(a.device)
    out = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
           "torch": torch.__version__, "exactness": [], "distribution": None, "verify_curve_1b": {}}
    for dtype in (torch.float32, torch.bfloat16):
        out["exactness"].append(exactness(device, dtype))
        print(json.dumps(out["exactness"][-1]), flush=True)
    out["distribution"] = first_token_distribution(device)
    print(json.dumps(out["distribution"]), flush=True)
    if not a.skip_1b:
        model = llama_1b(device, torch.bfloat16)
        out["params_1b"] = sum(p.numel() for p in model.parameters())
        for batch in (1, 16):
            curve = verify_curve(model, batch)
            out["verify_curve_1b"][batch] = curve
            print(f"batch {batch}: " + ", ".join(f"T={t}: {ms} ms" for t, ms in curve.items()), flush=True)
            out[f"verify_cost_ratio_9_vs_1_batch_{batch}"] = curve[9] / curve[1]
    path = Path(a.out) / "gpu-check.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
