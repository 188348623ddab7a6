"""Verification of draft tokens (Leviathan et al. 2023; Chen et al. 2023).

For one request with k draft tokens d_1..d_k, the target model gives k + 1 distributions
p_1..p_{k+1} (already processed: temperature, top-k/p, min-p, penalties) in one forward
pass. Draft token d_i is accepted with probability min(1, p_i(d_i) / q_i(d_i)), where q_i
is the draft's distribution (a point mass for n-gram lookup: q_i(d_i) = 1). At the first
rejection the output token is drawn from the residual max(0, p_i - q_i), normalized, and
the rest is dropped; if all k are accepted, a bonus token is drawn from p_{k+1}. The
output tokens are then distributed exactly as sampling from the target one token at a
time. Greedy requests accept while the target's argmax equals the draft, then emit the
argmax: token-identical to non-speculative greedy decoding.

A request's uniforms come from its own generator when it has one, so seeded requests
reproduce whatever else is in the batch.
"""

from __future__ import annotations

import torch

from pagedserve.executor import ops
from pagedserve.executor.sampler import sample_from_probs


def _sample(probs: torch.Tensor, u: torch.Tensor) -> int:
    """Inverse-CDF draw from one probability row with the uniform u."""
    return int(sample_from_probs(probs[None], u.reshape(1)))


def verify(
    target_probs: torch.Tensor,
    draft_token_ids: list[int],
    draft_probs: torch.Tensor | None = None,
    greedy: bool = False,
    generator: torch.Generator | None = None,
) -> list[int]:
    """One request: target_probs [k + 1, V] (or logits when greedy), draft_token_ids [k],
    draft_probs [k, V] or None (a point mass at each draft token). Returns the accepted
    draft tokens followed by one more token (recovered or bonus): 1 .. k + 1 tokens."""
    k = len(draft_token_ids)
    if greedy:  # the plain decode step's argmax (its tie rule), ~6x torch's on [k + 1, 49152] rows
        argmax = ops.argmax(target_probs).tolist()
        out = []
        for i in range(k):
            if argmax[i] != draft_token_ids[i]:
                break
            out.append(draft_token_ids[i])
        out.append(argmax[len(out)])
        return out
    # one uniform for each acceptance test and one for the final draw: the same count per
    # request whatever is accepted, so a seeded stream stays aligned
    u = torch.rand(k + 1, generator=generator, device=target_probs.device)
    out = []
    for i, d in enumerate(draft_token_ids):
        p = target_probs[i]
        q_d = 1.0 if draft_probs is None else float(draft_probs[i, d])
        p_d = float(p[d])
        if q_d > 0 and float(u[i]) * q_d < p_d:  # accept with probability min(1, p/q)
            out.append(d)
            continue
        residual = p.clone()
        if draft_probs is None:
            residual[d] = 0.0
        else:
            residual = torch.clamp(residual - draft_probs[i], min=0.0)
        if float(residual.sum()) <= 0.0:  # p == q: any draw from p is exact
            residual = p
        out.append(_sample(residual, u[k]))
        return out
    out.append(_sample(target_probs[k], u[k]))
    return out
