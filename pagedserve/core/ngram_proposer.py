"""N-gram prompt lookup (vLLM's "ngram" method): guess the next k tokens by finding the
sequence's last n tokens earlier in the sequence and copying what followed them.

For each n from `max_n` down to `min_n`, the most recent earlier occurrence of the last
n tokens wins; the proposal is the (up to k) tokens that followed it. No match: no
proposal. Costs O(len * n) numpy work per request, no model.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, k: int, min_n: int = 1, max_n: int = 4, max_lookback: int = 4096) -> None:
        if k < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {k}.")
        if not 1 <= min_n <= max_n:
            raise ValueError(f"prompt_lookup_min/max must satisfy 1 <= min <= max, got {min_n}, {max_n}.")
        self.k, self.min_n, self.max_n, self.max_lookback = k, min_n, max_n, max_lookback

    def propose(self, token_ids, k: int | None = None) -> list[int]:
        """Up to k (default self.k) guessed next tokens for a sequence; [] if no match."""
        k = self.k if k is None else k
        toks = np.asarray(token_ids[-self.max_lookback :], dtype=np.int64)
        n_tok = len(toks)
        for n in range(min(self.max_n, n_tok - 1), self.min_n - 1, -1):
            suffix = toks[n_tok - n :]
            # windows starting at 0 .. n_tok - n - 1 (the suffix itself excluded)
            windows = sliding_window_view(toks[: n_tok - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # most recent occurrence
                return toks[start : start + k].tolist()
        return []
