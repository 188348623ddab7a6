"""Speculative decoding building blocks: n-gram lookup and distribution-preserving verification."""

import numpy as np
import pytest
import torch

from pagedserve.spec_decode.ngram_proposer import NgramProposer
from pagedserve.spec_decode.rejection_sampler import verify

# chi-square critical values at alpha = 0.001, by degrees of freedom
CHI2_001 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88}


def test_ngram_proposes_the_continuation_of_the_latest_match():
    p = NgramProposer(k=3, min_n=1, max_n=3)
    seq = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3]
    assert p.propose(seq) == [4, 5, 9]  # "1 2 3" seen before, followed by 4 5 9
    assert p.propose([7, 8, 9]) == []  # no earlier occurrence
    assert p.propose(seq, k=1) == [4]
    # the longest n wins over a more recent shorter match
    seq = [5, 6, 7, 1, 6, 7, 2, 5, 6, 7]
    assert NgramProposer(k=1, min_n=2, max_n=3).propose(seq) == [1]
    assert NgramProposer(k=1, min_n=2, max_n=2).propose(seq) == [2]  # most recent "6 7"
    # a match at the very end proposes what there is
    assert NgramProposer(k=4, min_n=1, max_n=1).propose([3, 3]) == [3]
    with pytest.raises(ValueError):
        NgramProposer(k=0)


def test_greedy_verification_accepts_while_argmax_agrees():
    logits = torch.full((4, 10), -5.0)
    for i, t in enumerate([4, 7, 1, 2]):
        logits[i, t] = 5.0
    assert verify(logits, [4, 7, 3], greedy=True) == [4, 7, 1]  # third draft wrong: argmax instead
    assert verify(logits, [4, 7, 1], greedy=True) == [4, 7, 1, 2]  # all accepted + bonus
    assert verify(logits, [0, 7, 1], greedy=True) == [4]


def _chi2_ok(counts, probs, n):
    keep = probs * n >= 5
    expected = probs[keep] * n
    observed = counts[keep]
    if (~keep).any():  # fold the rare cells together
        expected = np.append(expected, probs[~keep].sum() * n)
        observed = np.append(observed, counts[~keep].sum())
    chi2 = float((((observed - expected) ** 2) / expected).sum())
    return chi2 < CHI2_001[len(expected) - 1], chi2


@pytest.mark.parametrize("draft", ["point", "distribution"])
def test_verification_preserves_the_target_distribution(draft):
    torch.manual_seed(0)
    V, k, n = 8, 2, 12_000
    target = torch.softmax(torch.randn(k + 1, V) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(k, V) * 1.5, dim=-1) if draft == "distribution" else None
    g = torch.Generator().manual_seed(1)
    first = np.zeros(V)
    second_given_first = np.zeros(V)
    accepted = 0
    for _ in range(n):
        if q is None:
            d = [3, 5]
        else:
            d = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(k)]
        out = verify(target, d, q, greedy=False, generator=g)
        assert 1 <= len(out) <= k + 1
        first[out[0]] += 1
        accepted += len(out) - 1
        if len(out) >= 2:
            second_given_first[out[1]] += 1
    assert _chi2_ok(first, target[0].double().numpy(), n)[0]
    # when the first token came from an accepted draft, the next one is still ~ p_2
    m = int(second_given_first.sum())
    assert m > 500 and _chi2_ok(second_given_first, target[1].double().numpy(), m)[0]
    assert accepted > 0


def test_seeded_verification_reproduces():
    target = torch.softmax(torch.randn(3, 16), dim=-1)
    a = [verify(target, [1, 2], generator=torch.Generator().manual_seed(7)) for _ in range(3)]
    assert a[0] == a[1] == a[2]
