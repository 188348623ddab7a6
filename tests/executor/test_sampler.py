import math

import pytest
import torch

from pagedserve.executor.sampler import Sampler, SamplingBatch, apply_penalties

# chi-square critical values at alpha = 0.001, by degrees of freedom
CHI2_001 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88}

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.7, 0.2, 0.0, -0.5, -1.0, -2.0, -3.0])


def expected_probs(logits, temp=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """Reference filtering, in the order of transformers' warpers and vLLM:
    top-k, then top-p on the renormalised rest, then min-p."""
    p = torch.softmax(logits / temp, dim=-1)
    order = torch.argsort(p, descending=True).tolist()
    if top_k:
        order = order[:top_k]
    q = torch.zeros_like(p)
    q[order] = p[order]
    q = q / q.sum()
    keep, cum = [], 0.0
    for i in order:
        keep.append(i)
        cum += q[i].item()
        if cum >= top_p:
            break
    r = torch.zeros_like(q)
    r[keep] = q[keep]
    r = r / r.sum()
    if min_p:
        r = torch.where(r >= min_p * r.max(), r, torch.zeros_like(r))
        r = r / r.sum()
    return r


@pytest.mark.parametrize(
    "temp,top_k,top_p,min_p",
    [
        (1.0, 0, 1.0, 0.0),
        (0.7, 0, 1.0, 0.0),
        (1.0, 4, 1.0, 0.0),
        (1.3, 0, 0.8, 0.0),
        (1.0, 6, 0.9, 0.0),
        (1.0, 0, 1.0, 0.15),
    ],
)
def test_samples_follow_filtered_softmax(temp, top_k, top_p, min_p):
    n = 20_000
    b = SamplingBatch(temperature=torch.full((n,), temp))
    if top_k:
        b.top_k = torch.full((n,), top_k, dtype=torch.int64)
    if top_p < 1:
        b.top_p = torch.full((n,), top_p)
    if min_p:
        b.min_p = torch.full((n,), min_p)
    out = Sampler(seed=1234)(LOGITS.expand(n, -1).clone(), b)
    counts = torch.bincount(out.sampled, minlength=10).double()
    p = expected_probs(LOGITS, temp, top_k, top_p, min_p).double()
    assert counts[p == 0].sum() == 0  # filtered tokens never appear
    support = p > 0
    exp = p[support] * n
    chi2 = (((counts[support] - exp) ** 2) / exp).sum().item()
    df = int(support.sum()) - 1
    assert chi2 < CHI2_001[df], (chi2, df)


def test_greedy_rows_take_argmax_in_a_mixed_batch():
    logits = torch.randn(6, 50)
    b = SamplingBatch(temperature=torch.tensor([0.0, 1.0, 0.0, 1.0, 0.0, 0.5]))
    out = Sampler(seed=0)(logits, b)
    for i in (0, 2, 4):
        assert out.sampled[i] == logits[i].argmax()


def test_bf16_logits_sample_the_tokens_of_their_float32_copy():
    """Where a batch reads the model's dtype (greedy and plain temperature rows), bf16 logits
    give the tokens of their float32 copy for the same generator state; a batch that needs
    float32 says so."""
    logits = (torch.randn(8, 3000, generator=torch.Generator().manual_seed(3)) * 3).bfloat16()
    b = SamplingBatch(temperature=torch.tensor([0.0, 1.0, 0.7, 0.0, 1.3, 1.0, 0.0, 0.5]))
    assert b.reads_model_dtype
    for seed in range(5):
        assert torch.equal(Sampler(seed=seed)(logits, b).sampled, Sampler(seed=seed)(logits.float(), b).sampled)
    greedy = SamplingBatch(temperature=torch.zeros(8))
    assert torch.equal(Sampler(seed=0)(logits, greedy).sampled, logits.float().argmax(dim=-1))
    assert not SamplingBatch(temperature=torch.ones(8), top_k=torch.full((8,), 5)).reads_model_dtype
    assert not SamplingBatch(temperature=torch.ones(8), max_num_logprobs=2).reads_model_dtype


def test_seed_reproduces_whatever_the_batch():
    logits = torch.randn(1, 100)

    def draws(batch_size, row):
        g = torch.Generator().manual_seed(42)
        res = []
        for step in range(20):
            big = torch.randn(batch_size, 100, generator=torch.Generator().manual_seed(step))
            big[row] = logits[0]
            b = SamplingBatch(temperature=torch.ones(batch_size), generators={row: g})
            res.append(int(Sampler(seed=step)(big, b).sampled[row]))
        return res

    alone = draws(1, 0)
    assert alone == draws(7, 3) == draws(3, 2)
    assert len(set(alone)) > 1


def test_penalties_match_definitions():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    b = SamplingBatch(
        temperature=torch.zeros(1),
        presence_penalty=torch.tensor([0.5]),
        frequency_penalty=torch.tensor([0.25]),
        repetition_penalty=torch.tensor([2.0]),
        prompt_token_ids=torch.tensor([[1, 5]]),  # 5 = padding (vocab size)
        output_token_ids=torch.tensor([[0, 0, 3]]),
    )
    got = apply_penalties(logits.clone(), b)[0]
    # token 0: seen twice in output, positive: 2/2 - 0.25*2 - 0.5 = 0.0
    # token 1: in prompt only, negative: -1*2 = -2 (no presence/frequency: prompt only)
    # token 2: unseen: 0.5
    # token 3: once in output: 3/2 - 0.25 - 0.5 = 0.75
    # token 4: unseen: -2
    assert torch.allclose(got, torch.tensor([0.0, -2.0, 0.5, 0.75, -2.0]))


def test_logprobs_and_ranks_are_of_the_raw_distribution():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    b = SamplingBatch(
        temperature=torch.zeros(1),
        max_num_logprobs=2,
        repetition_penalty=torch.tensor([1.5]),
        output_token_ids=torch.tensor([[1]]),
    )
    out = Sampler()(logits, b)
    raw = torch.log_softmax(logits, -1)[0]
    # the penalty moves the argmax from token 1 (3/1.5 = 2.0 ties token 2) ...
    tok = int(out.sampled[0])
    assert math.isclose(out.sampled_logprobs[0].item(), raw[tok].item(), rel_tol=1e-6)
    assert out.sampled_ranks[0].item() == int((raw > raw[tok]).sum()) + 1
    assert out.topk_ids[0].tolist() == [1, 2]

