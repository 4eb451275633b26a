"""`specdec plan`: size the draft and verifier pools and price the output, from measurements.

Per round a sequence costs one verifier pass over K+1 tokens (t_v(K+1)) and K draft steps (t_d
each) and yields E = (1 - a^(K+1)) / (1 - a) tokens at acceptance a. With drafters and
verifiers on separate replicas working on different sequence groups at once, a verifier
replica stays saturated with K t_d / t_v(K+1) drafter replicas beside it, and a million output
tokens cost (t_v(K+1) p_v + K t_d p_d) / E per token, against t_v(1) p_v for verifier-only
decoding (p = price per replica-second)."""
from __future__ import annotations

import argparse
import json
import math
import sys


def plan(acceptance: float, k: int, draft_ms: float, verify_ms_1: float, verify_ratio: float,
         draft_price_h: float, verifier_price_h: float) -> dict:
    a = min(max(acceptance, 0.0), 0.999)
    e = (1 - a ** (k + 1)) / (1 - a)
    t_v = verify_ms_1 * verify_ratio / 1000  # s per verify pass of K+1 tokens
    t_d = k * draft_ms / 1000  # s of drafting per round
    ratio = t_d / t_v if t_v else 0.0
    spec_cost = (t_v * verifier_price_h + t_d * draft_price_h) / 3600 / e * 1e6
    plain_cost = verify_ms_1 / 1000 * verifier_price_h / 3600 * 1e6
    return {"tokens_per_round": round(e, 3), "drafters_per_verifier": round(ratio, 3),
            "pool_ratio": f"{max(1, math.ceil(ratio * 4))}:4 drafter:verifier replicas",
            "tokens_per_s_per_sequence": round(e / (t_v + t_d), 2),
            "tokens_per_s_per_sequence_plain": round(1000 / verify_ms_1, 2),
            "cost_per_million_tokens_spec": round(spec_cost, 4),
            "cost_per_million_tokens_verifier_only": round(plain_cost, 4),
            "cost_saving": round(1 - spec_cost / plain_cost, 4)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="specdec plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--from-bench", help="take acceptance, K, draft and verify costs from a bench results JSON")
    ap.add_argument("--acceptance", type=float, default=0.6, help="per-draft acceptance rate")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--draft-ms", type=float, default=5.0, help="one draft step on a drafter replica")
    ap.add_argument("--verify-ms", type=float, default=40.0, help="one 1-token verifier pass")
    ap.add_argument("--verify-ratio", type=float, default=1.2, help="cost of a (K+1)-token pass / a 1-token pass")
    ap.add_argument("--draft-price", type=float, default=0.80, help="$ per hour of a small-GPU (drafter) replica")
    ap.add_argument("--verifier-price", type=float, default=4.00, help="$ per hour of a large-GPU (verifier) replica")
    a = ap.parse_args(argv)
    if a.from_bench:
        b = json.load(open(a.from_bench))
        s = b["summary"]
        k = s["best_k"] or a.k
        rows = {r["row"]: r for r in b["greedy"]}
        a.k, a.acceptance = k, rows[f"k{k}"]["acceptance_rate"]
        a.draft_ms, a.verify_ms = b["draft_step_ms"], b["verify_cost_ms"]["1"]
        a.verify_ratio = b["verify_cost_ms"][str(k + 1)] / a.verify_ms
    out = plan(a.acceptance, a.k, a.draft_ms, a.verify_ms, a.verify_ratio, a.draft_price, a.verifier_price)
    print(f"inputs: acceptance {a.acceptance:.3f}, K={a.k}, draft step {a.draft_ms:.2f} ms, verify pass "
          f"{a.verify_ms:.2f} ms x{a.verify_ratio:.2f} for K+1 tokens, ${a.draft_price}/h drafter, "
          f"${a.verifier_price}/h verifier")
    for key, v in out.items():
        print(f"{key:>40}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
