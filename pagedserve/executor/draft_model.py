"""The draft model of speculative method "draft_model": a smaller model with the target's
vocabulary that guesses the next k tokens greedily, inside the step that verifies them.

Its paged KV cache mirrors the target's: the same number of blocks and the same block
tables (a request's block ids index both caches), so the scheduler allocates once for
both and frees both at once. Per step, for each request the scheduler gave k guess
slots (DRAFT_PLACEHOLDER), with `start` = the request's computed tokens (its last known
token sits at position `start`):
  1. one batched forward over each request's catch-up chunk: the tokens from its first
     position without draft K/V through position `start` (the whole prompt the first
     time, usually one or two tokens after), argmax at the last one: guess 1;
  2. k - 1 batched single-token forwards: guess j at position start + j gives guess j + 1.
Guesses written K/V at positions up to start + k - 1, inside the slots the scheduler
allocated for the target's start .. start + k.

Invariant: the draft K/V of request r is valid at every position below
min(computed[r], start), where `computed[r]` = the positions its last proposal wrote and
`start` = its computed tokens now: guesses the target rejected lie at or past `start`
(progress was rolled back to the last accepted one) and are overwritten by the next
catch-up chunk before anything attends to them. A request new to the executor (first
scheduled, or resumed after preemption) starts from 0.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from pagedserve.executor import ops
from pagedserve.executor.loader import build_model, load_hf_config_dict, resolve_model_path
from pagedserve.executor.model_config import ModelConfig
from pagedserve.messages import DRAFT_PLACEHOLDER, CachedRequestData, ScheduledRequest, SchedulerOutput


def _share(req_id: str, token_ids: list[int], start: int) -> CachedRequestData:
    """A draft forward's share: the request's tokens from `start`, sampled at the last."""
    return CachedRequestData(req_id=req_id, token_ids=token_ids, num_computed_tokens=start, block_ids=[], sample=True)


def has_placeholder_drafts(sr: ScheduledRequest) -> bool:
    d = sr.draft_token_ids
    return bool(d) and d[0] == DRAFT_PLACEHOLDER


class DraftModelProposer:
    def __init__(
        self,
        model: str,
        target: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        backend,
        quantization=None,
        weight_copies=None,
    ) -> None:
        path = resolve_model_path(model)
        self.model_config = ModelConfig.from_hf_dict(load_hf_config_dict(path))
        if self.model_config.vocab_size != target.vocab_size:
            raise ValueError(
                f"speculative_config model: the draft's vocabulary ({self.model_config.vocab_size} tokens) "
                f"differs from the target's ({target.vocab_size}); a draft model must share the tokenizer."
            )
        self.dtype = dtype
        self.model = build_model(path, self.model_config, dtype, device, backend, "auto", quantization, weight_copies)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.computed: dict[str, int] = {}

    # -- KV cache (the target's block layout, the draft's heads and layers) ---------------
    def kv_bytes_per_block(self, block_size: int, elem: int) -> int:
        """Bytes of one block over the draft's layers, `elem` bytes per K/V element (the
        target's KV cache dtype: the caches come from its `zeros`)."""
        c = self.model_config
        return 2 * c.num_hidden_layers * block_size * c.num_key_value_heads * c.head_dim * elem

    def initialize_kv_cache(self, num_blocks: int, block_size: int, zeros) -> None:
        c = self.model_config
        shape = (num_blocks, block_size, c.num_key_value_heads, c.head_dim)
        self.kv_caches = [(zeros(shape), zeros(shape)) for _ in range(c.num_hidden_layers)]

    def update(self, so: SchedulerOutput) -> None:
        """Forget what the step's deltas end: finished and preempted requests, and the
        draft K/V of requests that start over (new, or resumed after preemption)."""
        for rid in (*so.finished_req_ids, *so.preempted_req_ids):
            self.computed.pop(rid, None)
        for sr in so.scheduled:
            if sr.is_new:
                self.computed.pop(sr.req_id, None)

    # -- one step ---------------------------------------------------------------------------
    @torch.inference_mode()
    def fill_drafts(self, runner, so: SchedulerOutput) -> SchedulerOutput:
        """A copy of `so` whose placeholder guesses are the draft model's (the scheduler's
        own objects are left as they are)."""
        todo = [sr for sr in so.scheduled if has_placeholder_drafts(sr)]
        if not todo:
            return so
        guesses = self._propose(runner, todo)
        scheduled = []
        for sr in so.scheduled:
            g = guesses.get(sr.req_id)
            if g is not None:
                n_real = len(sr.token_ids) - len(g)
                sr = replace(sr, token_ids=sr.token_ids[:n_real] + g, draft_token_ids=g)
            scheduled.append(sr)
        return replace(so, scheduled=scheduled)

    def _propose(self, runner, todo: list[ScheduledRequest]) -> dict[str, list[int]]:
        ks = {sr.req_id: len(sr.draft_token_ids) for sr in todo}
        starts = {sr.req_id: sr.num_computed_tokens for sr in todo}
        # 1) catch-up chunks through each request's last known token (position start)
        chunks = []
        for sr in todo:
            st, start = runner.requests[sr.req_id], sr.num_computed_tokens
            done = min(self.computed.get(sr.req_id, 0), start)  # rejected guesses lie past start
            prompt, n_prompt = st.prompt_token_ids, len(st.prompt_token_ids)
            toks = prompt[done : start + 1] + st.output_token_ids[max(0, done - n_prompt) : start + 1 - n_prompt]
            chunks.append(_share(sr.req_id, toks, done))
        guesses: dict[str, list[int]] = {sr.req_id: [] for sr in todo}
        last = self._forward_argmax(runner, chunks)
        kmax = max(ks.values())
        for j in range(1, kmax + 1):
            for rid, tok in last.items():
                guesses[rid].append(tok)
            if j == kmax:
                break
            # 2) guess j at position start + j, for requests that want more than j guesses
            step = [_share(rid, [g[-1]], starts[rid] + j) for rid, g in guesses.items() if ks[rid] > j]
            last = self._forward_argmax(runner, step)
        for rid, k in ks.items():
            self.computed[rid] = starts[rid] + k  # positions .. start + k - 1 written
        return guesses

    def _forward_argmax(self, runner, reqs: list[ScheduledRequest]) -> dict[str, int]:
        inp = runner.input_batch.prepare(SchedulerOutput(reqs, sum(len(r.token_ids) for r in reqs)))
        hidden = self.model(inp.input_ids, inp.positions, self.kv_caches, inp.meta)
        idx = torch.from_numpy(inp.cu[1:] - 1).to(hidden.device)
        toks = ops.argmax(self.model.compute_logits(hidden[idx])).tolist()
        return {sr.req_id: t for sr, t in zip(inp.order, toks)}
