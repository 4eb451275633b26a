"""Microbenchmark: ms per call of the wq kernel (specdec/models/kernels; 4- and 8-bit weights)
against torch's int4 kernel (_weight_int4pack_mm_for_cpu, group 32, bfloat16 activations, as
specdec/models/quant.py calls it) and a bfloat16 `x @ w.t()`, over a few layer shapes and row
counts M.

    flock /tmp/timing.lock .venv/bin/python bench/kernel_bench.py [--threads 2] [--cold] [--shapes 576x3072]

--cold cycles through enough copies of each weight to overflow the last-level cache, so every
call reads its weights from memory (as a decode step over a whole model does); the default
repeats one weight (cache-hot)."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specdec.models import kernels, quant  # noqa: E402

SHAPES = [(576, 960), (576, 3072), (1536, 576), (576, 49152)]  # (K in, N out)
ROWS = "1,2,5,9,16"  # rows per call (--rows)


def burst_ms(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for i in range(calls):
        fn(i)
    return (time.perf_counter() - t0) / calls * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--rows", default=ROWS, help="M,M,...: rows per call")
    ap.add_argument("--shapes", default=",".join(f"{k}x{n}" for k, n in SHAPES), help="KxN,KxN,...")
    ap.add_argument("--cold", action="store_true", help="read weights from memory, not cache")
    ap.add_argument("--cold-bytes", type=float, default=4e8, help="bytes of weight copies per method with --cold")
    ap.add_argument("--out", default=None, help="also write the table as JSON here (e.g. bench/results/kernels.json)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not kernels.load():
        sys.exit(f"wq kernels unavailable: {kernels.unavailable_reason()}")
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    counts = [int(m) for m in args.rows.split(",")]  # rows per call; 1 must be among them
    cols = ["wq4", "wq8", "torch_int4", "bf16"]
    cells = {}  # (k, n, m, name) -> [fn, calls, best ms]
    for k, n in shapes:
        torch.manual_seed(0)
        w = torch.randn(n, k) * 0.05
        made = {"wq4": kernels.quantize_q4(w), "wq8": kernels.quantize_q8(w), "torch_int4": quant.quantize(w),
                "bf16": (w.bfloat16(),)}
        copies = {}
        for name, ts in made.items():
            nbytes = sum(t.numel() * t.element_size() for t in ts)
            c = max(1, int(args.cold_bytes // nbytes)) if args.cold else 1
            copies[name] = [ts] + [tuple(t.clone() for t in ts) for _ in range(c - 1)]
        for m in counts:
            x = torch.randn(m, k).bfloat16()
            fns = {
                "wq4": lambda i, c=copies["wq4"], x=x, n=n: kernels.matmul(x, *c[i % len(c)], 4, n),
                "wq8": lambda i, c=copies["wq8"], x=x, n=n: kernels.matmul(x, *c[i % len(c)], 8, n),
                "torch_int4": lambda i, c=copies["torch_int4"], x=x: quant.matmul(x, *c[i % len(c)]),
                "bf16": lambda i, c=copies["bf16"], x=x: x @ c[i % len(c)][0].t(),
            }
            for name, fn in fns.items():
                per = min(burst_ms(fn, 5) for _ in range(3))  # a first guess at the cost, for the call count
                calls = max(len(copies[name]) if args.cold else 5, min(2000, int(5 / max(per, 1e-3))))
                cells[(k, n, m, name)] = [fn, calls, float("inf")]
    # rounds over all cells, keeping each cell's least burst mean: on a shared 2-core machine another
    # process stalls a 2-thread call's team for a scheduler tick (~6 ms) now and then, and spreading
    # a cell's bursts over the whole run lets every cell catch the quiet moments
    for _ in range(args.rounds):
        for cell in cells.values():
            cell[2] = min(cell[2], burst_ms(cell[0], cell[1]))
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, wq path {kernels.isa()}, "
          f"{'cold (weights cycled through ~%.0f MB of copies)' % (args.cold_bytes / 1e6) if args.cold else 'hot (one weight, cached)'}")
    print(f"{'K->N':>12} {'M':>3} " + " ".join(f"{c + ' ms':>13}" for c in cols) + f" {'wq4/int4':>9} {'wq4 M/M1':>9}")
    rows = []
    for k, n in shapes:
        for m in counts:
            row = {c: cells[(k, n, m, c)][2] for c in cols}
            base = cells[(k, n, 1, "wq4")][2]
            rows.append({"k": k, "n": n, "m": m, **{c + "_ms": round(row[c], 4) for c in cols}})
            print(f"{f'{k}->{n}':>12} {m:>3} " + " ".join(f"{row[c]:>13.4f}" for c in cols)
                  + f" {row['wq4'] / row['torch_int4']:>9.2f} {row['wq4'] / base:>9.2f}")
    if args.out:
        meta = {"torch": torch.__version__, "threads": torch.get_num_threads(), "wq_path": kernels.isa(),
                "cold": args.cold}
        Path(args.out).write_text(json.dumps({"config": meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
