"""The scheduler's side of speculative decoding: who gets draft tokens, how many, and
the acceptance counters (vLLM's metric meanings).

Eligible: running decodes whose sampling needs no penalties, logprobs or constraints
(their target distribution then depends on nothing but the position). Adaptive per
request: k halves after a step with no accepted guess (down to a pause of a few steps at
k = 1) and doubles back after a step with every guess accepted; for the whole batch,
the scheduler proposes only when at most `max_batch_size` requests run, because on a full
batch verifying guesses costs real compute.

Method "draft_model": the scheduler decides only how many guesses (k placeholders, whose
slots it allocates); the executor's draft model fills them in during the step.
"""

from __future__ import annotations

from pagedserve.config import SpeculativeConfig
from pagedserve.core.ngram_proposer import NgramProposer
from pagedserve.core.request import Request
from pagedserve.messages import DRAFT_PLACEHOLDER

PAUSE_STEPS = 8  # steps without guesses after repeated misses at k = 1


class SpecDecodeState:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.max_batch_size = config.max_batch_size
        self.proposer = (
            NgramProposer(self.k, config.prompt_lookup_min, config.prompt_lookup_max)
            if config.method == "ngram"
            else None  # draft_model: the executor guesses
        )
        self.num_drafts = 0  # verification steps of one request
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * self.k

    @staticmethod
    def eligible(req: Request) -> bool:
        p = req.sampling_params
        # constrained requests: each guess would need its own grammar mask
        return (
            not p.has_penalties
            and p.logprobs is None
            and p.structured_outputs is None
            and not p.has_token_constraints
        )

    def propose(self, req: Request, room: int) -> list[int] | None:
        """Up to k guesses for the request's next tokens (None: none this step)."""
        if req.spec_pause > 0:
            req.spec_pause -= 1
            return None
        if req.spec_k == 0:  # first time: decide eligibility once
            req.spec_k = self.k if self.eligible(req) else -1
        if req.spec_k < 0:
            return None
        k = min(req.spec_k, room, req.max_tokens - req.num_output_tokens - 1)
        if k <= 0:
            return None
        if self.proposer is None:
            return [DRAFT_PLACEHOLDER] * k
        return self.proposer.propose(req.all_token_ids, k) or None

    def record(self, req: Request, k: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += k
        self.num_accepted_tokens += accepted
        for i in range(accepted):
            self.accepted_per_position[i] += 1
        if accepted == 0:
            if req.spec_k == 1:
                req.spec_pause = PAUSE_STEPS
            req.spec_k = max(1, req.spec_k // 2)
        elif accepted == k:
            req.spec_k = min(self.k, req.spec_k * 2)
