"""Log-probabilities the requests asked for, from one step's sampler results (sampled
tokens) and hidden states (prompt tokens), as the front end's `PositionLogprobs` dicts."""

from __future__ import annotations

import torch

from pagedserve.messages import Logprob, ModelRunnerOutput, PositionLogprobs


def collect_sampled_logprobs(order, rows, states, res, out: ModelRunnerOutput) -> None:
    """For each sampling row j (request order[rows[j]]) that asked for `logprobs=k`: its
    top k and the sampled token with its rank."""
    lps = res.sampled_logprobs.tolist()
    ranks = res.sampled_ranks.tolist()
    top_ids = res.topk_ids.tolist() if res.topk_ids is not None else None
    top_lps = res.topk_logprobs.tolist() if res.topk_logprobs is not None else None
    for j, i in enumerate(rows):
        k = states[j].params.logprobs
        if k is None:
            continue
        tok = out.sampled_token_ids[order[i].req_id]
        d: PositionLogprobs = {}
        for r in range(k):
            d[top_ids[j][r]] = Logprob(top_lps[j][r], r + 1)
        d[tok] = Logprob(lps[j], ranks[j])
        out.logprobs[order[i].req_id] = d


def collect_prompt_logprobs(model, order, states, cu, hidden, out: ModelRunnerOutput) -> None:
    """Log-probabilities of prompt tokens 1.. given their prefixes (chunk by chunk)."""
    for i, sr in enumerate(order):
        st = states[i]
        k = st.params.prompt_logprobs
        if k is None:
            continue
        n_prompt = len(st.prompt_token_ids)
        first = sr.num_computed_tokens  # position of the chunk's first token
        last = min(first + len(sr.token_ids), n_prompt - 1)  # positions predicting a prompt token
        if last <= first:
            continue
        h = hidden[int(cu[i]) : int(cu[i]) + (last - first)]
        logprobs = model.compute_logits(h).log_softmax(dim=-1)
        targets = torch.tensor(st.prompt_token_ids[first + 1 : last + 1], device=hidden.device)
        out.prompt_logprobs[sr.req_id] = _position_logprobs(logprobs, targets, k)


def _position_logprobs(logprobs: torch.Tensor, targets: torch.Tensor, k: int) -> list[PositionLogprobs]:
    tlp = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1)
    ranks = ((logprobs > tlp.unsqueeze(1)).sum(dim=-1) + 1).tolist()
    top_lp, top_id = logprobs.topk(k, dim=-1) if k > 0 else (None, None)
    tl, tg = tlp.tolist(), targets.tolist()
    entries = []
    for j in range(len(tg)):
        d: PositionLogprobs = {}
        if k > 0:
            for r, (tid, v) in enumerate(zip(top_id[j].tolist(), top_lp[j].tolist())):
                d[tid] = Logprob(v, r + 1)
        d[tg[j]] = Logprob(tl[j], ranks[j])
        entries.append(d)
    return entries
