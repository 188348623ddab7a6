"""Verification of speculative guesses inside a step: logits at each request's last token
and at each of its k guesses (one forward pass, one logits pass), checked against the
target distribution (greedy: argmax agreement; sampled: rejection sampling,
executor/rejection_sampler.py)."""

from __future__ import annotations

import torch

from pagedserve.executor.rejection_sampler import verify
from pagedserve.executor.sampler import sampling_probs
from pagedserve.messages import ModelRunnerOutput
from pagedserve.sampling_params import SamplingParams


def verify_drafts(
    model, inp, hidden, spec_rows, block_size: int, generator, out: ModelRunnerOutput, num_groups: int = 1
) -> None:
    """For the requests at `spec_rows` of `inp.order`: the accepted guesses plus one more
    token into `out.spec_token_ids`, appended to their states' outputs. Their block tables
    drop blocks that held only rejected guesses, as the scheduler does (`num_groups` KV
    cache groups: the flat table has that many entries per block)."""
    order, states, cu = inp.order, inp.states, inp.cu
    spans = [(int(cu[i + 1]) - len(order[i].draft_token_ids) - 1, int(cu[i + 1])) for i in spec_rows]
    idx = torch.cat([torch.arange(a, b) for a, b in spans]).to(hidden.device)
    all_logits = model.compute_logits(hidden[idx])  # float32; weights read once for every guess
    offset = 0
    for i, (a, b) in zip(spec_rows, spans):
        sr, st = order[i], states[i]
        logits = all_logits[offset : offset + b - a]
        offset += b - a
        p = st.params
        if p.greedy:
            toks = verify(logits, sr.draft_token_ids, greedy=True)
        else:
            toks = verify(target_probs(logits, p), sr.draft_token_ids, None, False, st.generator or generator)
        out.spec_token_ids[sr.req_id] = toks
        st.output_token_ids.extend(toks)
        keep = -(-(sr.num_computed_tokens + len(toks)) // block_size)
        del st.block_ids[keep * num_groups :]  # the flat table: num_groups entries a block


def target_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """[n, V] logits of one request -> its sampling distribution at each position
    (temperature, top-k, top-p, min-p; speculation is off for penalties)."""
    n = logits.shape[0]
    return sampling_probs(
        logits,
        torch.full((n,), p.temperature),
        torch.full((n,), p.top_k, dtype=torch.int64) if p.top_k > 0 else None,
        torch.full((n,), p.top_p) if p.top_p < 1.0 else None,
        torch.full((n,), p.min_p) if p.min_p > 0 else None,
    )
