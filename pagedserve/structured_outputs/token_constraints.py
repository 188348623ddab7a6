"""Per-row token constraints on the logits, before sampling: `logit_bias` (added),
`allowed_token_ids` (every other token -inf) and bad words (the last token of a bad word
gets -inf when the output so far ends with the word's other tokens), as vLLM."""

from __future__ import annotations

import torch


def apply_token_constraints(logits: torch.Tensor, states) -> None:
    """In place on logits [B, V]; row i follows states[i] (`.params`, `.output_token_ids`).
    Costs one pass over the rows' params when no row has a constraint."""
    if not any(s.params.has_token_constraints for s in states):
        return
    vocab = logits.shape[1]
    bias_rows: list[int] = []
    bias_cols: list[int] = []
    bias_vals: list[float] = []
    ban_rows: list[int] = []
    ban_cols: list[int] = []
    for i, s in enumerate(states):
        p = s.params
        if not p.has_token_constraints:
            continue
        if p.allowed_token_ids is not None:
            keep = torch.tensor(
                [t for t in p.allowed_token_ids if t < vocab], dtype=torch.long, device=logits.device
            )
            row = torch.full((vocab,), float("-inf"), dtype=logits.dtype, device=logits.device)
            row[keep] = logits[i, keep]
            logits[i] = row
        if p.logit_bias:
            for t, v in p.logit_bias.items():
                if t < vocab:
                    bias_rows.append(i)
                    bias_cols.append(t)
                    bias_vals.append(v)
        if p.bad_words_token_ids:
            out = s.output_token_ids
            for word in p.bad_words_token_ids:
                head = len(word) - 1
                if word[-1] < vocab and (head == 0 or (len(out) >= head and out[-head:] == word[:-1])):
                    ban_rows.append(i)
                    ban_cols.append(word[-1])
    dev = logits.device
    if bias_rows:
        idx = (torch.tensor(bias_rows, device=dev), torch.tensor(bias_cols, device=dev))
        logits.index_put_(idx, torch.tensor(bias_vals, dtype=logits.dtype, device=dev), accumulate=True)
    if ban_rows:
        logits[torch.tensor(ban_rows, device=dev), torch.tensor(ban_cols, device=dev)] = float("-inf")
