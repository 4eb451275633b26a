"""Forced-logit unit tests of the verifier step: exact outputs for each acceptance path."""
import torch

from specdec.rejection_sampler import PLACEHOLDER_TOKEN_ID as P
from specdec.rejection_sampler import rejection_sample

V = 6


def onehot_rows(tokens):
    """Target rows whose argmax (and whole probability mass) is the given token."""
    rows = torch.full((len(tokens), V), 1e-9)
    rows[torch.arange(len(tokens)), torch.tensor(tokens)] = 1.0
    return rows / rows.sum(-1, keepdim=True)


def run(drafts_per_req, target_tokens_per_req, greedy=True, draft_probs=None, seed=0):
    flat = torch.tensor([t for d in drafts_per_req for t in d], dtype=torch.long)
    target = torch.cat([onehot_rows(t) for t in target_tokens_per_req])
    B = len(drafts_per_req)
    gens = [torch.Generator().manual_seed(seed + b) for b in range(B)]
    return rejection_sample(flat, [len(d) for d in drafts_per_req], draft_probs or [None] * B, target,
                            [greedy] * B, gens).tolist()


def test_all_accepted_plus_bonus():
    assert run([[1, 2, 3]], [[1, 2, 3, 4]]) == [[1, 2, 3, 4]]
    assert run([[1, 2, 3]], [[1, 2, 3, 4]], greedy=False) == [[1, 2, 3, 4]]


def test_first_rejected_recovers_target_token():
    assert run([[1, 2, 3]], [[5, 2, 3, 4]]) == [[5, P, P, P]]
    assert run([[1, 2, 3]], [[5, 2, 3, 4]], greedy=False) == [[5, P, P, P]]


def test_middle_rejected():
    assert run([[1, 2, 3]], [[1, 0, 3, 4]]) == [[1, 0, P, P]]
    assert run([[1, 2, 3]], [[1, 0, 3, 4]], greedy=False) == [[1, 0, P, P]]


def test_empty_draft_is_plain_decoding():
    assert run([[]], [[4]]) == [[4]]
    assert run([[]], [[4]], greedy=False) == [[4]]


def test_ragged_batch_exact():
    drafts = [[1, 2, 3], [], [4, 4], [5]]
    targets = [[1, 2, 0, 5], [3], [4, 4, 1], [2, 2]]
    assert run(drafts, targets) == [[1, 2, 0, P], [3, P, P, P], [4, 4, 1, P], [2, P, P, P]]
    assert run(drafts, targets, greedy=False) == [[1, 2, 0, P], [3, P, P, P], [4, 4, 1, P], [2, P, P, P]]


def test_residual_excludes_rejected_draft_when_q_covers_p():
    # p = q except that p has no mass on the draft's token 1: the recovered token comes from
    # max(0, p - q) renormalised, which puts all mass on token 2
    p = torch.tensor([[0.0, 0.0, 0.5, 0.5, 0, 0], [0.2] * 5 + [0.0]])
    q = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0, 0]])
    out = rejection_sample(torch.tensor([1]), [1], [q], p, [False], [torch.Generator().manual_seed(0)])
    assert out.tolist() == [[2, P]]


def test_greedy_and_sampled_mixed_in_one_batch():
    p = torch.cat([onehot_rows([1, 2]), onehot_rows([3, 0])])
    out = rejection_sample(torch.tensor([1, 3]), [1, 1], [None, None], p, [True, False],
                           [None, torch.Generator().manual_seed(0)])
    assert out.tolist() == [[1, 2], [3, 0]]
