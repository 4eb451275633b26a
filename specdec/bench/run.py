"""The speculation benchmark: every row on the same prompts, interleaved, in one process.

Rows: our K=0 (the baseline), the default draft at fixed K, adaptive K (the shipped default: prompt
lookup first, then the draft; `adaptive_draft` without lookup; `adaptive_w<w>` with the head's token
trees w children wide, where w is not the default's), the n-gram proposer,
HF `generate` plain and with prompt lookup (the best assisted generation HF can run here: no other
model shares SmolLM2's tokenizer). Greedy and sampled. Prints a Markdown table and writes
bench/results/<name>.json, .md and .png; `--out PATH` also writes the summary figures."""
from __future__ import annotations

import argparse
import json
import statistics as st
import time
from pathlib import Path

import torch

from specdec.bench import machine
from specdec.sampling import SamplingParams

PROMPTS = Path(__file__).with_name("prompts.json")


def load_prompts(per_category: int | None) -> list[dict]:
    """The shipped held-out prompts (never trained on), the first `per_category` of each category."""
    ps = json.loads(PROMPTS.read_text())
    if per_category is None:
        return ps
    count: dict[str, int] = {}
    out = []
    for p in ps:
        count[p["category"]] = count.get(p["category"], 0) + 1
        if count[p["category"]] <= per_category:
            out.append(p)
    return out


# -- cost measurements ---------------------------------------------------------------------------
def verify_cost_curve(runner, ctx_len=200, max_tokens=9, reps=7, batch=1, warmup=0) -> dict[int, float]:
    """Median ms of one verifier pass over T new tokens per sequence, for `batch` sequences after a
    ctx_len context each, T = 1..max; the first `warmup` sweeps are not timed. Each timed pass
    follows an untimed 1-token pass, the state a decoding pass meets: a 1-token pass right after a
    9-token one took 0.1-0.2 ms longer, and the curve read as if 2 and 3 tokens cost what 1 does. On a
    GPU the device is synchronised around each pass, so the time is the pass's, not its launch's."""
    V = runner.model.args.vocab_size  # ids kept in range for small (tiny) vocabularies
    ids = [f"__bench{b}" for b in range(batch)]
    ctxs = [[(100 + 7 * b + i) % V for i in range(ctx_len)] for b in range(batch)]
    runner.sync(ids, ctxs, [0] * batch)
    runner.prefill(ids, [c[:-1] for c in ctxs])
    cuda = runner.device.type == "cuda"
    times: dict[int, list[float]] = {t: [] for t in range(1, max_tokens + 1)}

    def one_pass(t: int) -> None:  # the last context token and t - 1 more, then their logits
        hidden, valid = runner.forward(ids, [c[-1:] + [(500 + i) % V for i in range(t - 1)] for c in ctxs])
        runner.model.logits(hidden[valid])

    for rep in range(warmup + reps):  # interleaved, so drift hits every T alike
        for t in times:
            runner.sync(ids, ctxs, [1] * batch)
            one_pass(1)
            runner.sync(ids, ctxs, [t] * batch)
            if cuda:
                torch.cuda.synchronize(runner.device)
            t0 = time.perf_counter()
            one_pass(t)
            if cuda:
                torch.cuda.synchronize(runner.device)
            if rep >= warmup:
                times[t].append(time.perf_counter() - t0)
    for i in ids:
        runner.free(i)
    return {t: 1000 * st.median(v) for t, v in times.items()}


def draft_step_ms(engine, prompt_ids: list[int], reps=5) -> float:
    """Median ms of the default proposer's first draft, on a real feature, right after a verifier
    pass as in a round: the pass streams the verifier's weights through the caches, so the head's
    are read from memory (timed hot, one after another, the same step took a third as long)."""
    from specdec.protocol import ProposeRequest

    seq = engine.add_request(prompt_ids, SamplingParams(max_tokens=reps + 4), 0)
    prop = engine.proposers[engine.default_proposer]
    engine.step()  # the prefill pass gives the sequence its feature
    ts = []
    for _ in range(reps):
        engine.step()  # a verifier pass, then the draft it feeds
        t0 = time.perf_counter()
        prop.propose([ProposeRequest(seq.seq_id, list(seq.tokens), 1, seq.params, seq.feature)])
        ts.append(time.perf_counter() - t0)
    engine.abort(seq.seq_id)
    return 1000 * st.median(ts)


# -- rows ----------------------------------------------------------------------------------------
class Rows:
    def __init__(self, engine, adaptive_engines: dict, hf, tok, max_tokens: int, peer=None):
        self.engine, self.adaptive_engines, self.hf, self.tok, self.max_tokens = engine, adaptive_engines, hf, tok, max_tokens
        self.peer = peer  # llama.cpp on the same GGUF (specdec.bench.peer), or None

    def ours(self, eng, ids, params, k, proposer):
        v0 = eng.verifier.busy_s
        c = eng.generate([ids], params, num_speculative_tokens=k, proposer=proposer)[0]
        m = c.metrics
        return {"tokens": len(c.token_ids), "token_ids": c.token_ids, "seconds": m.latency_s,
                "ttft_s": m.ttft_s, "passes": m.num_verifier_passes, "drafted": m.num_drafted,
                "accepted": m.num_accepted, "accepted_per_position": m.accepted_per_position,
                "drafted_per_position": m.drafted_per_position, "verifier_s": eng.verifier.busy_s - v0}

    def hf_generate(self, ids, params, lookup: int | None):
        kw = {"max_new_tokens": params.max_tokens, "pad_token_id": self.tok.hf.eos_token_id}
        if params.greedy:
            kw["do_sample"] = False
        else:
            kw.update(do_sample=True, temperature=params.temperature, top_p=params.top_p, top_k=0)
            torch.manual_seed(params.seed)
        if lookup:
            kw["prompt_lookup_num_tokens"] = lookup
        t0 = time.perf_counter()
        out = self.hf.generate(torch.tensor([ids]), **kw)[0, len(ids):].tolist()
        dt = time.perf_counter() - t0
        n = len(out) - (1 if out and out[-1] in self.tok.eos_token_ids else 0)  # HF keeps its EOS
        return {"tokens": n, "token_ids": out[:n], "seconds": dt, "ttft_s": None, "passes": None if lookup else len(out),
                "drafted": None, "accepted": None, "verifier_s": None}

    def run(self, row: str, ids, params):
        if row == PEER:
            return self.peer.run(ids, params.max_tokens) | {"passes": None, "drafted": None, "accepted": None,
                                                            "verifier_s": None}
        if row == "hf_plain":
            return self.hf_generate(ids, params, None)
        if row == "hf_prompt_lookup":
            return self.hf_generate(ids, params, 4)
        if row in self.adaptive_engines:
            return self.ours(self.adaptive_engines[row], ids, params, 8, self.engine.default_proposer)
        if row.startswith("ngram"):
            return self.ours(self.engine, ids, params, 4, "ngram")
        k = int(row.removeprefix("k"))
        return self.ours(self.engine, ids, params, k, self.engine.default_proposer if k else None)


PEER = "llama_cpp"  # the peer's row: plain greedy decoding in llama.cpp
TREE_WIDTHS = (1, 2, 4)  # the head's token-tree widths measured beside the default's
OTHERS = (PEER, "hf_plain", "hf_prompt_lookup")  # rows that are not our engine


def summarize_row(row: str, runs: list[dict], base: list[dict]) -> dict:
    tokens = sum(r["tokens"] for r in runs)
    secs = sum(r["seconds"] for r in runs)
    tps = [r["tokens"] / r["seconds"] for r in runs if r["seconds"] > 0]
    # a prompt answered with nothing (EOS first: tiny random models, some sampled draws) has no speed
    speed = [(r["tokens"] / r["seconds"]) / (b["tokens"] / b["seconds"]) for r, b in zip(runs, base)
             if r["tokens"] and b["tokens"] and r["seconds"] > 0 and b["seconds"] > 0] or [float("nan")]
    out = {"row": row, "n": len(runs), "tokens": tokens,
           "seconds": secs, "tokens_per_s": tokens / secs, "tokens_per_s_median": st.median(tps),
           "tokens_per_s_iqr": _iqr(tps), "ms_per_token": 1000 * secs / max(tokens, 1),
           "latency_s_median": st.median(r["seconds"] for r in runs),
           "speedup_vs_k0": st.median(speed), "speedup_vs_k0_iqr": _iqr(speed),
           "identical_to_k0": all(r["token_ids"] == b["token_ids"] for r, b in zip(runs, base))}
    ttfts = [r["ttft_s"] for r in runs if r["ttft_s"] is not None]
    out["ttft_s_median"] = st.median(ttfts) if ttfts else None
    if all(r["passes"] is not None for r in runs):
        passes, base_passes = sum(r["passes"] for r in runs), sum(b["passes"] for b in base)
        out["verifier_passes_per_token"] = passes / max(tokens, 1)
        base_ppt = base_passes / max(sum(b["tokens"] for b in base), 1)
        out["cost_saving_passes"] = 1 - out["verifier_passes_per_token"] / base_ppt
    if all(r.get("drafted") is not None for r in runs):
        d, a = sum(r["drafted"] for r in runs), sum(r["accepted"] for r in runs)
        p = sum(r["passes"] for r in runs)
        out["acceptance_rate"] = a / d if d else 0.0
        out["mean_accepted_length"] = 1 + a / p if p else 0.0
        width = max(len(r["drafted_per_position"]) for r in runs)
        per = []
        for j in range(width):
            dj = sum(r["drafted_per_position"][j] for r in runs if j < len(r["drafted_per_position"]))
            aj = sum(r["accepted_per_position"][j] for r in runs if j < len(r["accepted_per_position"]))
            per.append(aj / dj if dj else 0.0)
        out["acceptance_per_position"] = per
        verifier_s = sum(r["verifier_s"] for r in runs)
        # a request's first round is its prompt's pass (nothing drafts there; it yields one token):
        # the same work in every row, so it is counted apart from the decoding passes
        prefill_s = sum(r["ttft_s"] or 0.0 for r in runs)
        dp = max(p - len(runs), 1)
        out["pass_s"] = {"verifier": (verifier_s - prefill_s) / dp,  # per decoding pass
                         "rest": (secs - verifier_s) / dp,  # drafting, sampling, bookkeeping
                         "prefill": prefill_s}  # the prompts' passes, all requests
        out["decode_tokens_per_pass"] = (tokens - len(runs)) / dp
        vs = verifier_s / max(tokens, 1)
        vb = sum(b["verifier_s"] for b in base) / max(sum(b["tokens"] for b in base), 1)
        out["verifier_time_saving"] = 1 - vs / vb if vb else 0.0
    return out


def _iqr(xs: list[float]) -> float:
    if len(xs) < 2:
        return 0.0
    q = st.quantiles(xs, n=4)
    return q[2] - q[0]


# -- output --------------------------------------------------------------------------------------
COLS = [("row", "row", "{}"), ("acc", "acceptance_rate", "{:.2f}"), ("mean len", "mean_accepted_length", "{:.2f}"),
        ("tok/s", "tokens_per_s_median", "{:.1f}"), ("±iqr", "tokens_per_s_iqr", "{:.1f}"),
        ("ms/tok", "ms_per_token", "{:.1f}"), ("TTFT s", "ttft_s_median", "{:.3f}"),
        ("latency s", "latency_s_median", "{:.2f}"), ("passes/tok", "verifier_passes_per_token", "{:.2f}"),
        ("pass saving", "cost_saving_passes", "{:.0%}"), ("verify-time saving", "verifier_time_saving", "{:.0%}"),
        ("speedup vs K=0", "speedup_vs_k0", "{:.2f}x"), ("same as K=0", "identical_to_k0", "{}")]


def markdown(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(c[0] for c in COLS) + " |", "|" + "---|" * len(COLS)]
    for r in rows:
        cells = [fmt.format(r[key]) if r.get(key) is not None else "–" for _, key, fmt in COLS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(15, 4.2))
    g = {r["row"]: r for r in result["greedy"]}
    ks = [k for k in (1, 2, 3, 4, 6, 8) if f"k{k}" in g]
    ax[0].plot(ks, [g[f"k{k}"]["speedup_vs_k0"] for k in ks], "o-", label="speedup vs K=0 (greedy)")
    ax[0].plot(ks, [g[f"k{k}"]["acceptance_rate"] for k in ks], "s--", label="acceptance rate")
    if "adaptive" in g:
        ax[0].axhline(g["adaptive"]["speedup_vs_k0"], color="g", ls=":", label="adaptive K speedup")
    ax[0].axhline(1.0, color="gray", lw=0.8)
    ax[0].set_xlabel("K (num_speculative_tokens)")
    ax[0].set_title("Speedup and acceptance vs K")
    ax[0].legend(fontsize=8)
    big = g.get("k8") or g.get(f"k{ks[-1]}") if ks else None
    if big:
        per = big["acceptance_per_position"]
        ax[1].bar(range(1, len(per) + 1), per)
    ax[1].set_xlabel("draft position")
    ax[1].set_title("Acceptance per draft position (largest K)")
    curve = result["verify_cost_ms"]
    ax[2].plot([int(t) for t in curve], list(curve.values()), "o-")
    ax[2].set_xlabel("tokens per verifier pass")
    ax[2].set_ylabel("ms per pass")
    ax[2].set_ylim(bottom=0)
    ax[2].set_title("Verify cost curve")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# -- main ----------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="specdec bench", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="one prompt per category, fewer rows (<= 3 min)")
    ap.add_argument("--max-tokens", type=int, default=None, help="new tokens per request (default 40, quick 32)")
    ap.add_argument("--per-category", type=int, default=None, help="prompts per category (default 0 = all 4, quick 1): 2 measured each ratio to about ±0.1")
    ap.add_argument("--reps", type=int, default=1, help="passes over the prompts (as llama-bench's -r): a ratio is a median over all "
                    "prompt passes; sampled passes draw with their own seeds")
    ap.add_argument("--name", default=None, help="results file stem under bench/results/")
    ap.add_argument("--out", default=None, help="also write the summary figures to this JSON file")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--verifier", default="default", help="verifier model ('tiny' = random weights, for smoke tests)")
    ap.add_argument("--draft", default="default", help="proposer for the draft rows")
    ap.add_argument("--dtype", default="auto", help="our engines' weights (EngineConfig.dtype); HF's rows run float32")
    ap.add_argument("--results-dir", default="bench/results", help="where <name>.json/.md/.png go")
    ap.add_argument("--no-hf", action="store_true", help="skip the HF rows")
    ap.add_argument("--no-sampled", action="store_true", help="skip the sampled rows")
    ap.add_argument("--no-peer", action="store_true", help="skip the llama.cpp row (skipped anyway without llama-cpp-python)")
    return ap.parse_args(argv)


def build_rows(a: argparse.Namespace, max_tokens: int) -> "Rows":
    """Our engines and HF's model on one set of weights. Fixed-K rows measure the draft alone;
    "adaptive" is the shipped default (adaptive K, prompt lookup first), "adaptive_draft" the same
    without lookup. Prefix caching is off: every row runs the same prompts, so a cache would hand
    all but the first row its prompt for free (HF's rows get no such help); bench/prefix_cache.py
    measures it."""
    from transformers import AutoModelForCausalLM

    from specdec.config import EngineConfig
    from specdec.engine import SpecEngine
    from specdec.models.loader import model_dir
    from specdec.proposers import NgramProposer
    from specdec.proposers.feature_head import FeatureHeadProposer

    cfg = EngineConfig(verifier=a.verifier, draft=a.draft, dtype=a.dtype, adaptive=False, max_seqs=4,
                       max_model_len=2048, lookup_min_n=0, prefix_caching=False)
    base = SpecEngine.from_config(cfg)
    prop = base.proposers[base.default_proposer]

    def adaptive(lookup_min_n: int = EngineConfig().lookup_min_n, width: int | None = None) -> SpecEngine:
        p = prop if width is None else prop.with_width(width)  # its compiled step too
        return SpecEngine(base.verifier, p, base.tokenizer, EngineConfig(lookup_min_n=lookup_min_n), {"ngram": NgramProposer()})

    engines = {"adaptive": adaptive(), "adaptive_draft": adaptive(0)}
    if isinstance(prop, FeatureHeadProposer):  # the head's trees, at the widths the default does not draft
        engines |= {f"adaptive_w{w}": adaptive(width=w) for w in TREE_WIDTHS if w != prop.tree_width}
    hf_dir = None if a.no_hf else model_dir(a.verifier)  # None for tiny models: HF has no copy of them
    hf = None if hf_dir is None else AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    return Rows(base, engines, hf, base.tokenizer, max_tokens, build_peer(a))


def build_peer(a: argparse.Namespace):
    """llama.cpp on the default verifier's GGUF, where its bindings are installed."""
    from specdec.bench import peer

    if a.no_peer or a.verifier != "default":
        return None
    if not peer.available():
        print("llama.cpp row skipped: `pip install llama-cpp-python` to measure the peer", flush=True)
        return None
    return peer.LlamaCppProcess(peer.default_gguf(), a.threads)


def run_prompts(rows: "Rows", prompts: list[dict], ids: list[list[int]], row_names: dict[str, list[str]],
                max_tokens: int) -> dict[str, dict[str, list[dict]]]:
    """Every row on every prompt, greedy and sampled, rows interleaved per prompt."""
    results = {mode: {r: [] for r in names} for mode, names in row_names.items()}
    t_start = time.time()
    for i, (p, pid) in enumerate(zip(prompts, ids)):
        for mode, names in row_names.items():
            order = names if i % 2 == 0 else names[::-1]  # alternate order against drift
            for row in order:
                params = SamplingParams(max_tokens=max_tokens) if mode == "greedy" else \
                    SamplingParams(max_tokens=max_tokens, temperature=0.7, top_p=0.95, seed=1000 + i)
                r = rows.run(row, pid, params)
                r["category"] = p["category"]
                results[mode][row].append(r)
        print(f"  prompt {i + 1}/{len(prompts)} ({p['category']}) done, {time.time() - t_start:.0f}s", flush=True)
    return results


def tabulate(results: dict, prompts: list[dict], greedy_rows: list[str]) -> dict:
    """Rows summarised against K=0, overall and per prompt category."""
    out = {}
    for mode in ("greedy", "sampled"):
        if results[mode]:
            b = results[mode]["k0"]
            out[mode] = [summarize_row(r, runs, b) for r, runs in results[mode].items()]
    out["by_category"] = {}
    for cat in sorted({p["category"] for p in prompts}):
        sel = [j for j, p in enumerate(prompts) if p["category"] == cat]
        b = [results["greedy"]["k0"][j] for j in sel]
        out["by_category"][cat] = {row: summarize_row(row, [results["greedy"][row][j] for j in sel], b)["speedup_vs_k0"]
                                   for row in greedy_rows}
    return out


# what the default configuration is measured against: tokens per pass, speedups over K=0
TARGETS = {"tokens_per_pass": 2.2, "greedy": 1.5, "sampled": 1.3, "worst_category": 1.0}


def time_terms(row: dict, k0: dict) -> dict | None:
    """Why a row runs at the speed it does, in terms of its speedup over K=0 by totals. Decoding
    (every round after a request's first): decode_speedup = tokens_per_pass / (verify + rest), the
    tokens a decoding pass yields over the verifier's time per pass and the time outside it
    (drafts, sampling, bookkeeping), both in K=0 decoding passes (K=0's own rest is k0_rest).
    Prompts' passes: prefill_share is the row's, in K=0's total time (k0_prefill_share is K=0's
    own; they differ by timing noise), so speedup = 1 / (prefill_share + (1 - k0_prefill_share)
    / decode_speedup), exactly when both rows answer with the same tokens."""
    if "pass_s" not in row or "pass_s" not in k0:
        return None
    t0 = k0["pass_s"]["verifier"] + k0["pass_s"]["rest"]
    v, o = row["pass_s"]["verifier"] / t0, row["pass_s"]["rest"] / t0
    n, f, f0 = (row["decode_tokens_per_pass"], row["pass_s"]["prefill"] / k0["seconds"],
                k0["pass_s"]["prefill"] / k0["seconds"])
    decode = n / (v + o)
    return {"tokens_per_pass": n, "verify": v, "rest": o, "k0_rest": k0["pass_s"]["rest"] / t0, "prefill_share": f,
            "k0_prefill_share": f0, "decode_speedup": decode, "speedup": 1 / (f + (1 - f0) / decode)}


def tokens_needed(goal: float, terms: dict) -> float:
    """The tokens a decoding pass must yield for a speedup of `goal` at the costs measured
    (infinite where the prompts' share of the time alone rules it out)."""
    f, f0 = terms["prefill_share"], terms["k0_prefill_share"]
    if 1 / goal <= f:
        return float("inf")
    return (1 - f0) / (1 / goal - f) * (terms["verify"] + terms["rest"])


def targets(out: dict) -> list[dict]:
    """Each target against the default (adaptive) row: measured, met, and the tokens per pass it
    would need at the costs this run measured (how far acceptance must rise)."""
    g, s = ({r["row"]: r for r in out.get(m, [])} for m in ("greedy", "sampled"))
    if "adaptive" not in g:
        return []
    cats = [v["adaptive"] for v in out["by_category"].values() if "adaptive" in v]
    rows = [("tokens per pass, greedy", TARGETS["tokens_per_pass"], g["adaptive"].get("mean_accepted_length"), None),
            ("greedy speedup vs K=0", TARGETS["greedy"], g["adaptive"]["speedup_vs_k0"], time_terms(g["adaptive"], g["k0"])),
            ("worst category vs K=0", TARGETS["worst_category"], min(cats, default=None), None)]
    if "adaptive" in s:
        rows.insert(2, ("sampled speedup vs K=0", TARGETS["sampled"], s["adaptive"]["speedup_vs_k0"],
                        time_terms(s["adaptive"], s["k0"])))
    res = []
    for name, goal, got, terms in rows:
        if terms:  # at these costs, the tokens a pass must yield to meet the goal
            terms |= {"tokens_per_pass_for_target": tokens_needed(goal, terms)}
        res.append({"target": name, "goal": goal, "measured": got, "met": got is not None and got >= goal, "terms": terms})
    return res


def targets_markdown(rows: list[dict]) -> list[str]:
    md = ["## Targets (the default row; decoding passes, costs in K=0's: decode speedup = tokens/pass / "
          "(verify + rest); speedup = 1 / (prefill share + (1 - K=0's prefill share) / decode speedup))",
          "| target | goal | measured | met | tokens/pass | verify | rest (K=0's) | decode speedup | prefill share (K=0's) "
          "| tokens/pass needed |",
          "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t = r["terms"]
        cells = [f"{t['tokens_per_pass']:.2f}", f"{t['verify']:.2f}", f"{t['rest']:.2f} ({t['k0_rest']:.2f})",
                 f"{t['decode_speedup']:.2f}x", f"{t['prefill_share']:.2f} ({t['k0_prefill_share']:.2f})",
                 f"{t['tokens_per_pass_for_target']:.2f}"] if t else ["–"] * 6
        got = "–" if r["measured"] is None else f"{r['measured']:.2f}"
        md.append(f"| {r['target']} | {r['goal']:.2f} | {got} | {'yes' if r['met'] else 'no'} | " + " | ".join(cells) + " |")
    return md


def write_results(out: dict, res_dir: Path, name: str, greedy_rows: list[str]) -> list[str]:
    """<name>.json, .md and .png under res_dir; returns the Markdown lines."""
    cfg, curve = out["config"], out["verify_cost_ms"]
    res_dir.mkdir(parents=True, exist_ok=True)
    (res_dir / f"{name}.json").write_text(json.dumps(out, indent=1, default=float))
    passes = f" x {cfg['reps']} passes" if cfg.get("reps", 1) > 1 else ""
    md = [f"## Greedy ({cfg['prompts']} prompts{passes}, {cfg['max_tokens']} new tokens, {cfg['threads']} threads)",
          markdown(out["greedy"])]
    if "sampled" in out:
        md += ["", "## Sampled (T=0.7, top-p 0.95)", markdown(out["sampled"])]
    md += ["", "## Speedup vs K=0 by prompt category (greedy)",
           "| category | " + " | ".join(greedy_rows) + " |", "|---|" + "---|" * len(greedy_rows)]
    md += [f"| {c} | " + " | ".join(f"{v:.2f}" for v in v_by_row.values()) + " |"
           for c, v_by_row in out["by_category"].items()]
    if out.get("targets"):
        md += ["", *targets_markdown(out["targets"])]
    md += ["", "Verify cost (ms per pass by tokens in pass): " + ", ".join(f"{t}: {v:.1f}" for t, v in curve.items()),
           f"Draft step after a verifier pass: {out['draft_step_ms']:.2f} ms (c = {out['draft_cost_ratio_c']:.3f} of a 1-token verifier pass)",
           f"Run took {cfg['wall_s'] / 60:.1f} min.", "", "Summary: " + json.dumps(out["summary"])]
    (res_dir / f"{name}.md").write_text("\n".join(md) + "\n")
    plot(out, res_dir / f"{name}.png")
    return md


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    t_begin = time.time()
    torch.set_num_threads(a.threads)
    max_tokens = a.max_tokens or (32 if a.quick else 40)
    per_cat = a.per_category if a.per_category is not None else (1 if a.quick else 0)
    rows = build_rows(a, max_tokens)
    base = rows.engine
    prompts = load_prompts(per_cat or None) * max(1, a.reps)  # each pass is the prompts again, rows interleaved
    ids = [base.tokenizer.chat(p["messages"]) for p in prompts]
    trees = [r for r in rows.adaptive_engines if r.startswith("adaptive_w")]
    greedy_rows = ["k0", "k1", "k2", "k4", "adaptive", *trees, "ngram"] if a.quick else \
        ["k0", "k1", "k2", "k3", "k4", "k6", "k8", "adaptive", "adaptive_draft", *trees, "ngram"]
    if rows.hf is not None:
        greedy_rows += ["hf_plain", "hf_prompt_lookup"]
    if rows.peer is not None:
        greedy_rows += [PEER]
    sampled_rows = [] if a.no_sampled else ["k0", "k1", "adaptive", *trees]

    print("verify cost curve ...", flush=True)
    curve = verify_cost_curve(base.verifier.runner, reps=9, warmup=2)  # first sweeps run while the process settles
    c_ms = draft_step_ms(base, ids[0])
    # warm up every engine (allocator, adaptive cost fits) on a prompt outside the measured set
    warm = base.tokenizer.chat([{"role": "user", "content": "Say hello in five words."}])
    for eng in (base, *rows.adaptive_engines.values()):
        eng.generate([warm], SamplingParams(max_tokens=24), num_speculative_tokens=4)
    results = run_prompts(rows, prompts, ids, {"greedy": greedy_rows, "sampled": sampled_rows}, max_tokens)

    out = {"config": {"max_tokens": max_tokens, "prompts": len(prompts) // max(1, a.reps), "reps": max(1, a.reps),
                      "threads": a.threads, "quick": a.quick,
                      "verifier": a.verifier, "draft": a.draft, "dtype": a.dtype,
                      "quantized": any(getattr(m, "quantized", False) for m in base.verifier.runner.model.modules()),
                      "torch": torch.__version__, "machine": machine(),
                      "date": time.strftime("%Y-%m-%d %H:%M")},
           "verify_cost_ms": curve, "draft_step_ms": c_ms, "draft_cost_ratio_c": c_ms / curve[1]}
    out |= tabulate(results, prompts, greedy_rows)
    out["targets"] = targets(out)
    out["summary"] = summary(out)
    out["config"]["wall_s"] = time.time() - t_begin  # the whole run, model loading included
    md = write_results(out, Path(a.results_dir), a.name or ("quick" if a.quick else "default"), greedy_rows)
    print("\n".join(md))
    if a.out:
        Path(a.out).write_text(json.dumps(out["summary"], indent=1))
    return 0


def summary(out: dict) -> dict:
    g = {r["row"]: r for r in out["greedy"]}
    s = {r["row"]: r for r in out.get("sampled", [])}
    fixed = [r for r in g if r.startswith("k") and r != "k0"]
    best_k = max(fixed, key=lambda r: g[r]["speedup_vs_k0"]) if fixed else "k0"
    best_row = max([best_k] + [r for r in g if r.startswith("adaptive")], key=lambda r: g[r]["speedup_vs_k0"])
    curve = out["verify_cost_ms"]
    c = out["draft_cost_ratio_c"]
    k = int(best_k[1:]) if best_k != "k0" else 0
    a = g[best_k].get("acceptance_rate", 0.0)
    predicted = ((1 - a ** (k + 1)) / (1 - a) if a < 1 else k + 1) / (k * c + curve[k + 1] / curve[1]) if k else 1.0
    tps = lambda row, d=g: d[row]["tokens_per_s"] if row in d else None  # noqa: E731
    best_tps = tps(best_row)
    res = {
        # the default configuration (adaptive) against K=0, in the precision served
        "tokens_per_pass_default": g["adaptive"].get("mean_accepted_length") if "adaptive" in g else None,
        "greedy_speedup_vs_k0": g["adaptive"]["speedup_vs_k0"] if "adaptive" in g else None,
        "sampled_speedup_vs_k0": s["adaptive"]["speedup_vs_k0"] if "adaptive" in s else None,
        # our rows only: HF (float32) and llama.cpp (its own arithmetic) match K=0 only where the arithmetic does
        "greedy_identical_to_k0": all(r["identical_to_k0"] for r in out["greedy"] if r["row"] not in OTHERS),
        "greedy_best_row": best_row,
        "greedy_best_speedup_vs_k0": g[best_row]["speedup_vs_k0"],
        "sampled_best_speedup_vs_k0": max((s[r]["speedup_vs_k0"] for r in s if r not in ("k0", "hf_plain")), default=None),
        "speedup_vs_hf_assisted": best_tps / tps("hf_prompt_lookup") if "hf_prompt_lookup" in g else None,
        "speedup_vs_hf_plain": best_tps / tps("hf_plain") if "hf_plain" in g else None,
        "k0_vs_hf_plain": tps("k0") / tps("hf_plain") if "hf_plain" in g else None,
        "acceptance_rate_k4": g["k4"]["acceptance_rate"] if "k4" in g else None,
        "best_k": k,
        "draft_cost_ratio_c": c,
        "verify_cost_ratio_5_vs_1": curve[5] / curve[1],
        "predicted_speedup_best_k": predicted,
        "realized_vs_predicted": g[best_k]["speedup_vs_k0"] / predicted if k else None,
        "ngram_extractive_speedup": out["by_category"].get("extract", {}).get("ngram"),
        "adaptive_min_category_ratio": min((v["adaptive"] for v in out["by_category"].values() if "adaptive" in v),
                                           default=None),
        "hf_identical_to_k0": g["hf_plain"]["identical_to_k0"] if "hf_plain" in g else None,
        "speedup_vs_llama_cpp_k0": tps("k0") / tps(PEER) if PEER in g else None,
        "speedup_vs_llama_cpp_default": tps("adaptive") / tps(PEER) if PEER in g and "adaptive" in g else None,
    }
    return res
