"""Predicted Outputs: requests that carry the text their answer is expected to repeat (OpenAI's
`prediction`), against plain decoding (K=0), the default without a prediction, and llama.cpp on
the same GGUF, threads and prompts, greedy, in one process, rows interleaved. The predictions:
- `exact`: the answer itself (a retried request, a cached draft): the most a prediction gives;
- `edited`: the answer with one word in 12 replaced (a document or code file with small edits);
- `sampled`: the verifier's own sampled answer (T=0.7) to the same prompt (an earlier version).
Every greedy row must give K=0's tokens: a prediction changes only how fast they come.
Writes bench/results/predicted-outputs.{json,md,png}.

    .venv/bin/python bench/predicted_outputs.py [--tokens 96] [--reps 3] [--per-category N]"""
from __future__ import annotations

import argparse
import json
import statistics as st
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specdec.bench import machine  # noqa: E402

ROWS = ("llama_cpp", "k0", "default", "exact", "edited", "sampled")


def edit(text: str, every: int = 12) -> str:
    """The text with every `every`-th word replaced: an edited version of it."""
    words = text.split(" ")
    return " ".join("also" if i % every == every - 1 else w for i, w in enumerate(words))


def predictions(engine, ids: list[list[int]], tokens: int) -> tuple[list[dict], list[str]]:
    """The prediction texts per prompt (exact, edited, sampled) and the K=0 answers' text."""
    from specdec.sampling import SamplingParams

    plain = engine.generate(ids, SamplingParams(max_tokens=tokens), num_speculative_tokens=0)
    sampled = engine.generate(ids, [SamplingParams(max_tokens=tokens, temperature=0.7, seed=100 + i)
                                    for i in range(len(ids))], num_speculative_tokens=0)
    return [{"exact": p.text, "edited": edit(p.text), "sampled": s.text} for p, s in zip(plain, sampled)], \
        [p.text for p in plain]


def run_row(engine, llama, row: str, ids: list[int], pred: dict, tokens: int) -> dict:
    from specdec.sampling import SamplingParams

    if row == "llama_cpp":
        return llama.run(ids, tokens)
    c = engine.generate([ids], SamplingParams(max_tokens=tokens), num_speculative_tokens=0 if row == "k0" else None,
                        predictions=[pred.get(row)])[0]
    m = c.metrics
    return {"tokens": len(c.token_ids), "token_ids": c.token_ids, "seconds": m.latency_s, "ttft_s": m.ttft_s,
            "passes": m.num_verifier_passes, "prediction_drafted": m.num_prediction_drafted,
            "prediction_accepted": m.num_prediction_accepted}


def measure(prompts: list[dict], tokens: int, reps: int, threads: int) -> dict:
    from specdec.bench import peer
    from specdec.config import EngineConfig
    from specdec.engine import SpecEngine

    engine = SpecEngine.from_config(EngineConfig(prefix_caching=False))
    llama = peer.LlamaCppProcess(peer.default_gguf(), threads) if peer.available() else None
    rows = [r for r in ROWS if r != "llama_cpp" or llama is not None]
    ids = [engine.tokenizer.chat(p["messages"]) for p in prompts]
    preds, answers = predictions(engine, ids, tokens)
    runs = {r: [[] for _ in prompts] for r in rows}
    for rep in range(reps):
        for i, (x, pred) in enumerate(zip(ids, preds)):
            for row in rows if (rep + i) % 2 == 0 else rows[::-1]:  # alternate order against drift
                runs[row][i].append(run_row(engine, llama, row, x, pred, tokens))
        print(f"pass {rep + 1}/{reps} done", flush=True)
    return {"rows": {r: summarize(runs[r], runs["k0"], runs.get("llama_cpp")) for r in rows},
            "answers": answers, "predictions": preds}


def rate(run: dict) -> float:
    return run["tokens"] / run["seconds"]


def summarize(runs: list[list[dict]], k0: list[list[dict]], peer: list[list[dict]] | None) -> dict:
    """Per-prompt medians over the passes; ratios: median of per-prompt ratios to K=0, totals to llama.cpp."""
    med = [st.median(rate(r) for r in rs) for rs in runs]
    base = [st.median(rate(r) for r in rs) for rs in k0]
    out = {"tok_s": round(st.median(med), 1), "vs_k0": round(st.median(a / b for a, b in zip(med, base)), 3),
           "same_tokens_as_k0": all(r["token_ids"] == b[0]["token_ids"] for rs, b in zip(runs, k0) for r in rs)}
    if peer is not None:
        total = lambda rr: sum(r["tokens"] for rs in rr for r in rs) / sum(r["seconds"] for rs in rr for r in rs)  # noqa: E731
        out["vs_llama_cpp"] = round(total(runs) / total(peer), 3)
    if "passes" in runs[0][0]:
        out["tokens_per_pass"] = round(sum(r["tokens"] for rs in runs for r in rs) /
                                       sum(r["passes"] for rs in runs for r in rs), 2)
        drafted = sum(r["prediction_drafted"] for rs in runs for r in rs)
        kept = sum(r["prediction_accepted"] for rs in runs for r in rs)
        out["prediction_kept"] = round(kept / drafted, 3) if drafted else None
    return out


def markdown(res: dict) -> str:
    lines = ["| row | prediction | tok/s | vs K=0 | vs llama.cpp | tokens per pass | prediction drafts kept "
             "| same tokens as K=0 |", "|---|---|---|---|---|---|---|---|"]
    what = {"llama_cpp": "-", "k0": "none (K=0)", "default": "none", "exact": "the answer",
            "edited": "the answer, 1 word in 12 changed", "sampled": "a sampled answer (T=0.7)"}
    for row, r in res.items():
        cells = [r["tok_s"], f"{r['vs_k0']:.2f}x", f"{r['vs_llama_cpp']:.2f}x" if "vs_llama_cpp" in r else "-",
                 r.get("tokens_per_pass", "-"), r.get("prediction_kept") if r.get("prediction_kept") is not None else "-",
                 "yes" if r["same_tokens_as_k0"] else "no" if row != "llama_cpp" else "-"]
        lines.append(f"| {row} | {what[row]} | " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    names = list(res)
    ax[0].bar(names, [res[r]["vs_k0"] for r in names])
    ax[0].axhline(1.0, color="gray", lw=0.8)
    ax[0].set_ylabel("speedup vs K=0 (median per prompt)")
    ax[0].set_title("Predicted Outputs, greedy")
    spec = [r for r in names if "tokens_per_pass" in res[r]]
    ax[1].bar(spec, [res[r]["tokens_per_pass"] for r in spec])
    ax[1].set_ylabel("tokens per verifier pass")
    for a in ax:
        a.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    from specdec.bench.run import load_prompts

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--per-category", type=int, default=None, help="the first N prompts of each category")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    prompts = load_prompts(a.per_category)
    res = measure(prompts, a.tokens, a.reps, a.threads)
    meta = {"threads": a.threads, "tokens": a.tokens, "reps": a.reps, "prompts": len(prompts),
            "torch": torch.__version__, "machine": machine()}
    dest = ROOT / "bench" / "results"
    (dest / "predicted-outputs.json").write_text(json.dumps(meta | res, indent=1))
    (dest / "predicted-outputs.md").write_text(markdown(res["rows"]))
    plot(res["rows"], dest / "predicted-outputs.png")
    print(markdown(res["rows"]))


if __name__ == "__main__":
    main()
