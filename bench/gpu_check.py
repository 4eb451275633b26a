"""GPU check (run where a CUDA device is lent): the engine's exactness on CUDA, the verify cost curve
of a random-weight ~1B Llama, and what a 1-token pass, a speculative round and the engine under load
cost for random Llama-3.2-1B- and Llama-3.1-8B-shaped models built on the device (their weights are
too big to travel).

    python3 bench/gpu_check.py [--out DIR] [--device cuda] [--skip-1b | --cpu-dry-run]

1. Exactness on the device, tiny random models: greedy speculative output equals the verifier's
   own greedy output (K=0) token for token, in float32 and bfloat16, for a batch of prompts; a
   seeded sampled run is reproducible and its first-token distribution matches the verifier's
   (chi-square against the target's softmax over many seeded runs).
2. Verify cost curve: median ms of one verifier pass over T = 1..16 new tokens after a 512-token
   context, at batch 1 and 16, for a Llama-3.2-1B-shaped model (bfloat16) — the shape of the curve
   is what adaptive K learns online; on a GPU it stays flat far longer than on the CPU.
3. Per shape (1B, and 8B when the device has 40 GB free), bfloat16, small-std random weights:
   - the device's read bandwidth (a >= 1 GiB sum and copy), and the 1-token pass at batch 1 against
     its memory-bound time (the bytes it must read: every weight but the embedding table, of which
     it reads one row, plus the context's K/V; over that bandwidth);
   - a K=2 and K=4 round against a plain step, at batch 1: K draft steps of a 2-layer slice of the
     same model (sharing its embedding and LM head) plus one verify pass over K+1 tokens, each pass
     with its logits and argmax on the host, as the engine does them; and the same through
     `SpecEngine.step` (the host's work around the passes included);
   - tok/s at 1, 4 and 16 concurrent sequences, K=0 against adaptive K (up to 8) with that draft,
     64 greedy tokens each; the random weights set the acceptance, so it is reported, not chosen.
4. `targets`: each target of the GPU work, its measured value, met or missed.
Every stage writes DIR/gpu-check.json (default bench/results) as it finishes, so a run cut short
keeps what it measured. `--cpu-dry-run` runs every stage on the CPU with tiny shapes (dim 64,
4 layers) to exercise the code paths; its numbers mean nothing."""
from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics as st
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specdec.bench.run import verify_cost_curve  # noqa: E402
from specdec.config import EngineConfig  # noqa: E402
from specdec.engine import SpecEngine, summarize  # noqa: E402
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


LLAMA_1B = ModelArgs(vocab_size=49152, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, intermediate_size=8192,
                     rope_theta=500000.0, max_position=4096, tie_embeddings=True)
LLAMA_8B = ModelArgs(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, intermediate_size=14336,
                     rope_theta=500000.0, max_position=4096, tie_embeddings=False)
MIN_FREE_GB_8B = 40  # 16 GB of weights, KV caches for two engines of 16 slots, the bandwidth tensors
DRAFT_LAYERS = 2
CTX = 256  # context before each timed pass and round
TARGETS = {"one_token_pass_vs_memory_bound": 2.0, "k2_round_vs_plain_step": 1.3}


def tiny(args: ModelArgs) -> ModelArgs:
    """A shape scaled down so that every stage runs on a CPU in seconds (the dry run)."""
    return replace(args, vocab_size=512, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, intermediate_size=128)


@torch.no_grad()
def build(args: ModelArgs, device, dtype=torch.bfloat16, std=0.02) -> Transformer:
    """Random weights allocated in `dtype` on the device itself: an 8B model in float32 first would
    need twice its memory, and on the host it could not travel."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Transformer(args)
    finally:
        torch.set_default_dtype(prev)
    g = torch.Generator(device=device).manual_seed(0)
    for p in model.parameters():
        p.normal_(0.0, std, generator=g)
    return model.eval()


def llama_1b(device, dtype) -> Transformer:
    return build(LLAMA_1B, device, dtype)


def layer_slice(model: Transformer, n: int) -> Transformer:
    """The model's first n blocks with its embedding, final norm and LM head, sharing its tensors
    (a draft that costs no memory of its own beyond its KV cache)."""
    with torch.device("meta"):
        draft = Transformer(replace(model.args, n_layers=n))
    draft.load_state_dict({k: v for k, v in model.state_dict().items()
                           if not k.startswith("layers.") or int(k.split(".")[1]) < n}, strict=True, assign=True)
    return draft.eval()


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn, device, reps=15, warmup=3) -> float:
    """Median ms of fn(), the device synchronised around each call: the work's time, not its launch's."""
    ts = []
    for i in range(warmup + reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        if i >= warmup:
            ts.append(time.perf_counter() - t0)
    return 1000 * st.median(ts)


@torch.no_grad()
def read_bandwidth(device, gib: float) -> dict:
    """GB/s of a sum over a float32 tensor of `gib` GiB (reads it once) and of a copy of it (reads
    and writes it); the faster one is the bandwidth the memory-bound times use, so they are lower
    bounds."""
    n = int(gib * 2**30) // 4
    x = torch.ones(n, device=device)
    y = torch.empty_like(x)
    read_ms = median_ms(lambda: x.sum(), device, reps=10, warmup=2)
    copy_ms = median_ms(lambda: y.copy_(x), device, reps=10, warmup=2)
    del x, y
    free_memory(device)
    read, copy = 4 * n / read_ms / 1e6, 2 * 4 * n / copy_ms / 1e6
    return {"bytes": 4 * n, "sum_gb_s": round(read, 1), "copy_gb_s": round(copy, 1), "gb_s": round(max(read, copy), 1)}


def free_memory(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def free_gb(device) -> float | None:
    """Free device memory in GB; None on the CPU (the dry run's shapes are tiny)."""
    return torch.cuda.mem_get_info(device)[0] / 1e9 if device.type == "cuda" else None


class Passes:
    """One sequence of CTX tokens resident in a target and a draft runner; every call rewinds both
    to that context first, so each rep does the same work."""

    def __init__(self, target: Transformer, draft: Transformer):
        V = target.args.vocab_size
        self.ctx = [(100 + 7 * i) % V for i in range(CTX)]
        self.runners = [ModelRunner(m, 1, CTX + 32, prefix_caching=False) for m in (target, draft)]
        for r in self.runners:
            r.sync(["s"], [self.ctx], [17])
            r.prefill(["s"], [self.ctx[:-1]])

    def run_pass(self, runner: ModelRunner, tokens: list[int], rewind: bool) -> list[int]:
        """A pass over `tokens` with its logits and the argmax on the host, as the engine does it."""
        if rewind:
            runner.sync(["s"], [self.ctx], [17])
        hidden, valid = runner.forward(["s"], [tokens])
        return runner.model.logits(hidden[valid]).argmax(-1).tolist()

    def plain_step(self) -> list[int]:
        return self.run_pass(self.runners[0], self.ctx[-1:], True)

    def draft_step(self) -> list[int]:
        return self.run_pass(self.runners[1], self.ctx[-1:], True)

    def round(self, k: int) -> list[int]:
        """K draft steps, then one verify pass over the last context token and the K drafts."""
        drafts, tok = [], self.ctx[-1]
        for i in range(k):
            tok = self.run_pass(self.runners[1], [tok], i == 0)[-1]
            drafts.append(tok)
        return self.run_pass(self.runners[0], self.ctx[-1:] + drafts, True)


def weight_bytes(model: Transformer) -> dict:
    """Bytes a 1-token pass must read: every weight but the embedding table (one row of it), plus
    the context's K and V in every layer."""
    a = model.args
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.embed.weight.numel() * model.embed.weight.element_size()
    kv = a.n_layers * 2 * a.n_kv_heads * a.head_dim * CTX * model.embed.weight.element_size()
    return {"param_bytes": params, "embedding_bytes": embed, "kv_bytes": kv, "read_bytes": params - embed + kv}


def pass_and_rounds(target: Transformer, draft: Transformer, device, bandwidth_gb_s: float) -> dict:
    """The 1-token pass against its memory-bound time, and K=2/4 rounds against a plain step."""
    passes = Passes(target, draft)
    plain = median_ms(passes.plain_step, device)
    out = {**weight_bytes(target), "ctx": CTX, "one_token_pass_ms": round(plain, 3),
           "draft_step_ms": round(median_ms(passes.draft_step, device), 3)}
    out["memory_bound_ms"] = round(out["read_bytes"] / bandwidth_gb_s / 1e6, 3)
    out["one_token_pass_vs_memory_bound"] = round(plain / out["memory_bound_ms"], 3)
    for k in (2, 4):
        rnd = median_ms(lambda: passes.round(k), device)
        verify = median_ms(lambda: passes.run_pass(passes.runners[0], passes.ctx[-k - 1:], True), device)
        out[f"k{k}"] = {"round_ms": round(rnd, 3), "verify_pass_ms": round(verify, 3),
                        "round_vs_plain_step": round(rnd / plain, 3), "verify_vs_plain_step": round(verify / plain, 3)}
    del passes
    free_memory(device)
    return out


def engine_rounds(target: Transformer, draft: Transformer, device, steps=12) -> dict:
    """Median ms of one `SpecEngine.step` for one sequence at K = 0, 2, 4 (fixed K): the rounds as
    served, the host's bookkeeping, the draft's catch-up and the acceptance included."""
    prompt = [(3 + 11 * i) % target.args.vocab_size for i in range(CTX)]
    ms, acc = {}, {}
    for k in (0, 2, 4):
        eng = engine(target, draft, k, prefix_caching=False, lookup_min_n=0)
        seq = eng.add_request(prompt, SamplingParams(max_tokens=(k + 1) * (steps + 4), ignore_eos=True))
        ms[k] = median_ms(eng.step, device, reps=steps, warmup=3)  # the first step prefills
        acc[k] = round(seq.metrics.acceptance_rate, 3)
        eng.abort(seq.seq_id)
        del eng
        free_memory(device)
    return {"step_ms": {k: round(v, 3) for k, v in ms.items()}, "acceptance_rate": {k: acc[k] for k in (2, 4)},
            **{f"k{k}_round_vs_plain_step": round(ms[k] / ms[0], 3) for k in (2, 4)}}


def generate_run(eng: SpecEngine, prompts, max_tokens: int) -> dict:
    sync(eng.verifier.runner.device)
    t0 = time.perf_counter()
    done = eng.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    sync(eng.verifier.runner.device)
    s = summarize(done)
    return {"tok_s": s["num_output_tokens"] / (time.perf_counter() - t0), "acceptance_rate": s["acceptance_rate"],
            "passes": s["num_verifier_passes"], "drafted": s["num_drafted"]}


def throughput(target: Transformer, draft: Transformer, users=(1, 4, 16), max_tokens=64, reps=2) -> list[dict]:
    """tok/s of K=0 and of adaptive K (up to 8) at each number of concurrent sequences; each engine
    first runs a short warm-up (kernels, allocator, adaptive K's cost fits)."""
    g = torch.Generator().manual_seed(1)
    V = target.args.vocab_size
    prompts = [torch.randint(0, V, (int(torch.randint(64, 128, (1,), generator=g)),), generator=g).tolist()
               for _ in range(max(users))]
    engines = {"k0": engine(target, draft, 0, prefix_caching=False, lookup_min_n=0),
               "adaptive": engine(target, draft, 8, prefix_caching=False, lookup_min_n=0, adaptive=True)}
    cells = []
    for n in users:
        cell = {"users": n}
        for name, eng in engines.items():
            generate_run(eng, prompts[:n], 16)
            runs = [generate_run(eng, prompts[:n], max_tokens) for _ in range(reps)]
            cell[name] = {**runs[-1], "tok_s": round(st.median(r["tok_s"] for r in runs), 1)}
        cell["adaptive_vs_k0"] = round(cell["adaptive"]["tok_s"] / cell["k0"]["tok_s"], 3)
        print(f"  {n} users: K=0 {cell['k0']['tok_s']} tok/s, adaptive {cell['adaptive']['tok_s']} tok/s "
              f"({cell['adaptive_vs_k0']}x, acceptance {cell['adaptive']['acceptance_rate']:.2f})", flush=True)
        cells.append(cell)
    return cells


@torch.no_grad()
def verify_curve(model, batch: int) -> dict[int, float]:
    ms = verify_cost_curve(ModelRunner(model, batch, 1024), ctx_len=512, max_tokens=16, reps=9, batch=batch, warmup=2)
    return {t: round(v, 3) for t, v in ms.items()}


def curve_1b(model: Transformer, out: dict) -> None:
    out["params_1b"] = sum(p.numel() for p in model.parameters())
    for batch in (1, 16):
        curve = verify_curve(model, batch)
        out["verify_curve_1b"][batch] = curve
        print(f"batch {batch}: " + ", ".join(f"T={t}: {ms} ms" for t, ms in curve.items()), flush=True)
        out[f"verify_cost_ratio_9_vs_1_batch_{batch}"] = curve[9] / curve[1]


def shape_check(name: str, model: Transformer, device, bandwidth_gb_s: float, max_tokens: int) -> dict:
    """Pass, rounds and load for one shape, with a 2-layer slice of it as the draft."""
    draft = layer_slice(model, DRAFT_LAYERS)
    res = {"model": vars(model.args), "params": sum(p.numel() for p in model.parameters()),
           "draft_layers": DRAFT_LAYERS}
    t0 = time.time()
    res["passes"] = pass_and_rounds(model, draft, device, bandwidth_gb_s)
    p = res["passes"]
    print(f"{name}: 1-token pass {p['one_token_pass_ms']} ms = {p['one_token_pass_vs_memory_bound']}x its "
          f"memory-bound {p['memory_bound_ms']} ms; K=2 round {p['k2']['round_vs_plain_step']}x, "
          f"K=4 {p['k4']['round_vs_plain_step']}x a plain step", flush=True)
    res["engine_rounds"] = engine_rounds(model, draft, device)
    print(f"{name}: engine step ms {res['engine_rounds']['step_ms']}", flush=True)
    res["throughput"] = throughput(model, draft, max_tokens=max_tokens)
    res["wall_s"] = round(time.time() - t0, 1)
    return res


def targets(out: dict) -> list[dict]:
    """Each target against what this run measured (the model passes; the engine's steps beside them)."""
    rows = []
    for name, res in out["shapes"].items():
        p, e = res["passes"], res["engine_rounds"]
        for what, value in ((f"{name}: 1-token pass / memory-bound time", p["one_token_pass_vs_memory_bound"]),
                            (f"{name}: K=2 round / plain step (model passes)", p["k2"]["round_vs_plain_step"]),
                            (f"{name}: K=2 round / plain step (SpecEngine.step)", e["k2_round_vs_plain_step"])):
            limit = TARGETS["one_token_pass_vs_memory_bound" if "memory" in what else "k2_round_vs_plain_step"]
            rows.append({"target": f"{what} <= {limit}", "measured": value, "met": value <= limit})
    return rows


def save(out: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))


def correctness(out: dict, device, path: Path, dry: bool) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        out["exactness"].append(exactness(device, dtype))
        print(json.dumps(out["exactness"][-1]), flush=True)
    out["distribution"] = first_token_distribution(device, n=480 if dry else 3000)
    print(json.dumps(out["distribution"]), flush=True)
    save(out, path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--skip-1b", action="store_true", help="exactness only")
    ap.add_argument("--cpu-dry-run", action="store_true", help="every stage on the CPU with tiny shapes")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per sequence in the tok/s runs")
    a = ap.parse_args()
    device = torch.device("cpu" if a.cpu_dry_run else a.device)
    out = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
           "torch": torch.__version__, "dry_run": a.cpu_dry_run, "date": time.strftime("%Y-%m-%d %H:%M"),
           "exactness": [], "distribution": None, "verify_curve_1b": {}, "shapes": {}}
    path = Path(a.out) / "gpu-check.json"
    t0 = time.time()
    correctness(out, device, path, a.cpu_dry_run)
    if a.skip_1b:
        print("wrote", path)
        return 0
    out["bandwidth"] = read_bandwidth(device, 0.0625 if a.cpu_dry_run else 2.0)
    print(f"read bandwidth {out['bandwidth']['gb_s']} GB/s (sum {out['bandwidth']['sum_gb_s']}, "
          f"copy {out['bandwidth']['copy_gb_s']})", flush=True)
    shapes = {"llama-3.2-1b": LLAMA_1B, "llama-3.1-8b": LLAMA_8B}
    for name, args in shapes.items():
        free = free_gb(device)
        if name == "llama-3.1-8b" and free is not None and free < MIN_FREE_GB_8B:
            out["shapes_skipped"] = {name: f"{free:.1f} GB free < {MIN_FREE_GB_8B}"}
            print(f"{name}: skipped ({free:.1f} GB free)", flush=True)
            continue
        model = build(tiny(args) if a.cpu_dry_run else args, device)
        if name == "llama-3.2-1b":
            curve_1b(model, out)
        out["shapes"][name] = shape_check(name, model, device, out["bandwidth"]["gb_s"], a.max_tokens)
        out["targets"] = targets(out)
        out["wall_s"] = round(time.time() - t0, 1)
        save(out, path)
        del model
        free_memory(device)
    for row in out.get("targets", []):
        print(f"{'met   ' if row['met'] else 'MISSED'} {row['target']}: {row['measured']}", flush=True)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
