"""A deterministic stand-in for the executor: next token = hash of all previous tokens.

Because the next token depends on the whole sequence, any bookkeeping error (a lost,
duplicated or reordered token, a wrong chunk) changes every later token.
"""

from __future__ import annotations

import hashlib

from pagedserve.messages import ModelRunnerOutput, SchedulerOutput


def next_token(tokens: list[int], vocab: int = 1000) -> int:
    digest = hashlib.blake2b(repr(tokens).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % vocab


class FakeRunner:
    """Keeps each request's token list like a real runner does, and checks what it is sent."""

    def __init__(self, vocab: int = 1000, block_size: int = 16) -> None:
        self.vocab = vocab
        self.block_size = block_size
        self.tokens: dict[str, list[int]] = {}  # tokens whose "K/V" were computed
        self.blocks: dict[str, list[int]] = {}

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for rid in out.finished_req_ids | out.preempted_req_ids:
            self.tokens.pop(rid, None)
            self.blocks.pop(rid, None)
        sampled = {}
        for sr in out.scheduled:
            if sr.is_new:
                known = list(sr.prompt_token_ids) + list(sr.output_token_ids)
                # a prefix-cache hit: computed tokens come from the cache
                self.tokens[sr.req_id] = known[: sr.num_computed_tokens]
                self.blocks[sr.req_id] = list(sr.block_ids)
            else:
                self.blocks[sr.req_id].extend(sr.block_ids)
            toks = self.tokens[sr.req_id]
            assert len(toks) == sr.num_computed_tokens, (sr.req_id, len(toks), sr.num_computed_tokens)
            toks.extend(sr.token_ids)
            # the request's blocks hold a slot for every computed token
            assert len(self.blocks[sr.req_id]) * self.block_size >= len(toks)
            if sr.sample:
                sampled[sr.req_id] = next_token(toks, self.vocab)
        return ModelRunnerOutput(sampled_token_ids=sampled)


def reference_output(prompt: list[int], max_tokens: int, vocab: int = 1000) -> list[int]:
    toks, out = list(prompt), []
    for _ in range(max_tokens):
        t = next_token(toks, vocab)
        out.append(t)
        toks.append(t)
    return out
