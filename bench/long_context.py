"""Decoding after a long prompt: our engine (K=0 and the default) against llama.cpp on the same
GGUF, threads and prompt, at several context lengths; and our verify pass of 5 tokens against one
at each length. Attention's share of a pass grows with the context, so this is where it shows.
The prompt is docs/design.md's text, cut to the length (an extractive context: prompt lookup may
draft from it). Decode speed excludes the prompt: (tokens - 1) / (seconds - time to first token).
Writes bench/results/long-context.{json,md,png}.

--march builds specdec's kernels for another CPU than this one (haswell: AVX2 without AVX-512, as
some of these VMs are) and writes long-context-<march>.*; llama.cpp stays out of those runs (its
build is this machine's).

    .venv/bin/python bench/long_context.py [--depths 100,500,1500] [--tokens 48] [--reps 3] [--march haswell]"""
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

ROWS = ("llama_cpp", "k0", "default")  # the peer, plain decoding, the shipped default


def decode_rate(run: dict) -> float:
    """Tokens per second after the first token, which carries the prompt."""
    return (run["tokens"] - 1) / max(run["seconds"] - run["ttft_s"], 1e-9)


def measure(depths: list[int], tokens: int, reps: int, threads: int, peer_row: bool = True) -> dict:
    from specdec.bench import peer
    from specdec.bench.run import verify_cost_curve
    from specdec.config import EngineConfig
    from specdec.engine import SpecEngine
    from specdec.sampling import SamplingParams

    engine = SpecEngine.from_config(EngineConfig(prefix_caching=False, max_model_len=2048))
    llama = peer.LlamaCppProcess(peer.default_gguf(), threads) if peer_row and peer.available() else None
    text = engine.tokenizer.encode((ROOT / "docs" / "design.md").read_text())
    params = SamplingParams(max_tokens=tokens, temperature=0.0)
    out = {}
    for depth in depths:
        ids = text[:depth]
        runs: dict[str, list[dict]] = {r: [] for r in ROWS}
        for rep in range(reps):
            for row in ROWS if rep % 2 == 0 else ROWS[::-1]:  # alternate order against drift
                if row == "llama_cpp":
                    if llama is not None:
                        runs[row].append(llama.run(ids, tokens))
                    continue
                k = 0 if row == "k0" else None  # None: the engine's default (adaptive K, lookup first)
                c = engine.generate([ids], params, num_speculative_tokens=k)[0]
                runs[row].append({"tokens": len(c.token_ids), "token_ids": c.token_ids, "seconds": c.metrics.latency_s,
                                  "ttft_s": c.metrics.ttft_s})
        curve = verify_cost_curve(engine.verifier.runner, ctx_len=depth, max_tokens=5, reps=7, warmup=1)
        rates = {r: st.median(decode_rate(x) for x in v) for r, v in runs.items() if v}
        out[depth] = {"tok_s": {r: round(v, 1) for r, v in rates.items()},
                      "pass_ms": {t: round(curve[t], 2) for t in (1, 5)},
                      "pass5_over_pass1": round(curve[5] / curve[1], 3),
                      "default_identical_to_k0": runs["default"][0]["token_ids"] == runs["k0"][0]["token_ids"]}
        if "llama_cpp" in rates:
            out[depth] |= {f"{r}_vs_llama_cpp": round(rates[r] / rates["llama_cpp"], 3) for r in ("k0", "default")}
        print(depth, json.dumps(out[depth]), flush=True)
    return out


def markdown(res: dict) -> str:
    lines = ["| context | llama.cpp tok/s | K=0 tok/s | default tok/s | K=0 vs llama.cpp | default vs llama.cpp "
             "| 5-token pass / 1-token |", "|---|---|---|---|---|---|---|"]
    for depth, r in res.items():
        t = r["tok_s"]
        vs = [f"{r[k]}x" if k in r else "-" for k in ("k0_vs_llama_cpp", "default_vs_llama_cpp")]
        lines.append(f"| {depth} | {t.get('llama_cpp', '-')} | {t['k0']} | {t['default']} | {vs[0]} | {vs[1]} | "
                     f"{r['pass5_over_pass1']}x |")
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    depths = [int(d) for d in res]
    for row, label in zip(ROWS, ("llama.cpp", "specdec K=0", "specdec default")):
        if all(row in r["tok_s"] for r in res.values()):
            ax[0].plot(depths, [r["tok_s"][row] for r in res.values()], "o-", label=label)
    ax[0].set_xlabel("context (tokens)")
    ax[0].set_ylabel("decode tok/s")
    ax[0].set_ylim(bottom=0)
    ax[0].legend(fontsize=8)
    ax[0].set_title("Decoding after a long prompt")
    ax[1].plot(depths, [r["pass5_over_pass1"] for r in res.values()], "o-")
    ax[1].set_xlabel("context (tokens)")
    ax[1].set_title("5-token verify pass / 1-token pass")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depths", default="100,500,1500")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--march", default=None, help="build the kernels for this gcc -march (e.g. haswell), not this CPU")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.march:
        from specdec.models import kernels

        kernels.build_for(a.march)
    res = measure([int(d) for d in a.depths.split(",")], a.tokens, a.reps, a.threads, peer_row=not a.march)
    dest = ROOT / "bench" / "results"
    meta = {"threads": a.threads, "tokens": a.tokens, "reps": a.reps, "torch": torch.__version__, "machine": machine(),
            "prompt": "docs/design.md, first N tokens", "kernels_march": a.march or "native"}
    name = f"long-context-{a.march}" if a.march else "long-context"
    (dest / f"{name}.json").write_text(json.dumps(meta | {"by_context": res}, indent=1))
    (dest / f"{name}.md").write_text(markdown(res))
    plot(res, dest / f"{name}.png")
    print(markdown(res))


if __name__ == "__main__":
    main()
