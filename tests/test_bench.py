"""`specdec bench` end to end on tiny random models, so the benchmark cannot rot: every output
file is written and the summary has the figures the README quotes."""
import json

import pytest
import torch

from conftest import tiny_head_dir
from specdec.bench.run import main


@pytest.fixture(autouse=True)
def _keep_threads():
    n = torch.get_num_threads()  # the bench sets its own thread count; later tests keep theirs
    yield
    torch.set_num_threads(n)

SUMMARY_KEYS = {"greedy_speedup_vs_k0", "sampled_speedup_vs_k0", "speedup_vs_hf_assisted", "speedup_vs_hf_plain",
                "acceptance_rate_k4", "best_k", "draft_cost_ratio_c", "verify_cost_ratio_5_vs_1", "realized_vs_predicted",
                "tokens_per_pass_default", "greedy_identical_to_k0"}


def test_quick_bench_on_tiny_models(tmp_path):
    out = tmp_path / "summary.json"
    head = tiny_head_dir(tmp_path / "head")  # a draft head: its token-tree rows too
    assert main(["--quick", "--verifier", "tiny", "--draft", str(head), "--threads", "1", "--max-tokens", "8",
                 "--reps", "2", "--name", "smoke", "--results-dir", str(tmp_path), "--out", str(out)]) == 0
    res = json.loads((tmp_path / "smoke.json").read_text())
    assert {r["row"] for r in res["greedy"]} == {"k0", "k1", "k2", "k4", "adaptive", "adaptive_w2", "adaptive_w4", "ngram"}
    assert res["config"]["reps"] == 2 and all(r["n"] == 2 * res["config"]["prompts"] for r in res["greedy"])  # every pass
    assert all(r["identical_to_k0"] for r in res["greedy"])  # greedy speculation is lossless, every row
    assert [int(t) for t in res["verify_cost_ms"]] == list(range(1, 10))
    assert (tmp_path / "smoke.png").stat().st_size > 0 and "| k0 |" in (tmp_path / "smoke.md").read_text()
    assert SUMMARY_KEYS <= set(json.loads(out.read_text()))
    # the targets table: each goal against the default row, and for the speedups the terms that
    # multiply back to the row's speedup by totals
    assert [t["target"] for t in res["targets"]][:2] == ["tokens per pass, greedy", "greedy speedup vs K=0"]
    terms = res["targets"][1]["terms"]
    assert terms["decode_speedup"] == pytest.approx(terms["tokens_per_pass"] / (terms["verify"] + terms["rest"]))
    f, f0 = terms["prefill_share"], terms["k0_prefill_share"]
    assert 0 < f < 1 and terms["speedup"] == pytest.approx(1 / (f + (1 - f0) / terms["decode_speedup"]))
    g = {r["row"]: r for r in res["greedy"]}
    assert terms["speedup"] == pytest.approx(g["adaptive"]["tokens_per_s"] / g["k0"]["tokens_per_s"], rel=0.01)
    assert "## Targets" in (tmp_path / "smoke.md").read_text()
