"""Weight-only int4 (specdec/models/quant.py): the shipped Q4_1-style weights survive quantisation,
a row's result does not depend on the rows beside it, and so speculative greedy output equals
plain greedy output in int4, at batch 1 and in a ragged batch."""
import pytest
import torch

from conftest import make_engine, ragged_prompts
from specdec.models import quant
from specdec.models.tiny import build_tiny, noisy_copy, tiny_args
from specdec.sampling import SamplingParams

pytestmark = pytest.mark.skipif(not quant.available(), reason="torch lacks its CPU int4 kernel")
GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)


def q4_1_like(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """A weight as a de-quantised Q4_1 tensor is: per 32 inputs w = d q + m, q in 0..15 (0 and 15 used)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g)
    q[..., 0], q[..., 1] = 0, 15
    d = torch.rand(n, k // 32, 1, generator=g) * 0.01 + 1e-3
    m = -8 * d + torch.randn(n, k // 32, 1, generator=g) * 1e-3
    return (d * q + m).reshape(n, k)


def test_q4_1_weights_round_trip_to_the_kernel_within_bfloat16_scales():
    w = q4_1_like(96, 128)
    packed, sz = quant.quantize(w)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(0)).bfloat16()
    want = x.float() @ w.t()
    got = quant.matmul(x, packed, sz).float()
    assert torch.allclose(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("shape", [(96, 64), (576, 128), (320, 64)])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(shape):
    packed, sz = quant.quantize(torch.randn(*shape))
    x = torch.randn(17, shape[1]).bfloat16()
    alone = torch.cat([quant.matmul(x[i : i + 1], packed, sz) for i in range(17)])
    for m in (2, 5, 9, 17):
        assert torch.equal(quant.matmul(x[:m], packed, sz), alone[:m])


def test_the_bfloat16_lm_head_computes_each_row_on_its_own():
    """The LM head stays bfloat16 (models.quant.quantize_model): its rows must not depend on
    their neighbours either."""
    w_t = torch.randn(576, 4096).bfloat16()
    x = torch.randn(17, 576).bfloat16()
    alone = torch.cat([x[i : i + 1] @ w_t for i in range(17)])
    for m in (2, 5, 9, 16, 17):
        assert torch.equal(x[:m] @ w_t, alone[:m])


@pytest.fixture(scope="module")
def int4_target():
    base = build_tiny(tiny_args(vocab_size=320), seed=0)  # widths divisible by the kernel's tiles
    draft = noisy_copy(base, 0.3).to(quant.ACT_DTYPE)
    target = base.to(quant.ACT_DTYPE)
    quant.quantize_model(target)
    return target, draft


def test_int4_speculative_greedy_equals_int4_plain_greedy(int4_target):
    target, draft = int4_target
    prompts = ragged_prompts()
    plain = [c.token_ids for c in make_engine(target, k=0).generate(prompts, GREEDY)]
    for p, want in zip(prompts[:3], plain):  # batch 1
        assert make_engine(target, draft, k=4).generate([p], GREEDY)[0].token_ids == want
    outs = make_engine(target, draft, k=4).generate(prompts, GREEDY)  # one ragged batch
    assert [o.token_ids for o in outs] == plain
    assert 0 < sum(o.metrics.num_accepted for o in outs) < sum(o.metrics.num_drafted for o in outs)


def test_compiled_passes_run_past_dynamo_with_its_bits(int4_target):
    """After its first call a compiled pass runs dynamo's rewritten code directly (models.compiled)
    and computes the same bits as through dynamo; a new cache shape or feature layers go through
    dynamo again (a recompile) rather than into code compiled for the old ones."""
    from specdec.models.runner import ModelRunner

    target, _ = int4_target
    fn = target.token_pass._fn
    prompts = ragged_prompts(3)

    def hidden(max_len):
        runner = ModelRunner(target, 4, max_len)
        ids = [f"s{i}" for i in range(len(prompts))]
        runner.sync(ids, prompts, [0] * len(ids))
        h, valid = runner.forward(ids, prompts)
        return h[valid]

    first = hidden(256)
    assert any(f is not None for f in fn._direct.values())  # dynamo found the code to call directly
    assert torch.equal(hidden(256), first)  # the direct call
    fn._direct.clear()
    assert torch.equal(hidden(256), first)  # through dynamo
    keys = len(fn._direct)
    assert torch.equal(hidden(192), first) and len(fn._direct) == keys + 1  # other caches: their own code
    target.feature_layers = (0,)
    assert hidden(256).shape[1] == 2 * target.args.dim and len(fn._direct) == keys + 2
    target.feature_layers = ()
