"""The executor's persistent batch: per-request state kept across steps and updated from
the scheduler's deltas (a running request costs only its new tokens and new block ids to
send), and the flattening of one step into model inputs.

KV cache groups (sliding-window models): a request's `block_ids` is the scheduler's flat
table, `num_groups` entries per block (entry j * G + g: group g's block j); each group gets
its own block table and slot mapping, `meta.groups[g]`. Entries a sliding group gave back
(the null block, or a stale id: the scheduler does not resend them) lie before every
window and are never read.

Invariants: `requests` holds exactly the requests scheduled since they were last new
(first scheduling or resumption) and not finished or preempted since; a request's
`block_ids` is its whole block table; its `output_token_ids` are the tokens sampled so
far (appended by the runner as it samples, so penalties see them next step).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedserve.executor.attention import AttentionMetadata
from pagedserve.lora import LoRARequest
from pagedserve.messages import PositionLogprobs, ScheduledRequest, SchedulerOutput
from pagedserve.sampling_params import SamplingParams


@dataclass
class RequestState:
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    block_ids: list[int]
    generator: torch.Generator | None = None
    prompt_logprobs: list[PositionLogprobs] = field(default_factory=list)
    # greedy, no penalties, no logprobs, no token mask: a batch of only these samples with
    # one argmax (Sampler.greedy); anything that changes logits must clear it
    plain_greedy: bool = False
    lora_request: LoRARequest | None = None  # its adapter (None: the base model)

    def __post_init__(self) -> None:
        p = self.params
        self.plain_greedy = p.greedy and not p.has_penalties and p.logprobs is None and p.structured_outputs is None


@dataclass
class StepInputs:
    order: list[ScheduledRequest]  # the scheduled requests, decodes first
    states: list[RequestState]
    cu: np.ndarray  # [n + 1] query start offsets
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata


class InputBatch:
    def __init__(self, device: torch.device, block_size: int) -> None:
        self.device = device
        self.block_size = block_size
        self.num_groups = 1  # KV cache groups (set with the KV cache)
        self.requests: dict[str, RequestState] = {}
        # seeded generators survive preemption (so seeds stay exact); dropped at the end
        self.generators: dict[str, torch.Generator] = {}

    def update(self, so: SchedulerOutput) -> None:
        """Apply one step's deltas: forget finished and preempted requests, (re)create the
        new ones, extend the block tables of the others."""
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
            self.generators.pop(rid, None)
        for rid in so.preempted_req_ids:
            self.requests.pop(rid, None)
        for sr in so.scheduled:
            if sr.is_new:
                self.requests[sr.req_id] = RequestState(
                    list(sr.prompt_token_ids),
                    list(sr.output_token_ids),
                    sr.sampling_params,
                    list(sr.block_ids),
                    self._generator(sr.req_id, sr.sampling_params),
                    lora_request=sr.lora_request,
                )
            elif sr.block_ids:
                self.requests[sr.req_id].block_ids.extend(sr.block_ids)

    def _generator(self, req_id: str, params: SamplingParams) -> torch.Generator | None:
        gen = self.generators.get(req_id)
        if gen is None and params.seed is not None:
            gen = self.generators[req_id] = torch.Generator(device=self.device)
            gen.manual_seed(params.seed % 2**63)  # any int64 (or larger) seed
        return gen

    def _block_tables(self, states: list[RequestState], max_blocks: int) -> np.ndarray:
        """[G, n, max_blocks] block tables, one per KV cache group (zeros: the null block)."""
        G = self.num_groups
        tables = np.zeros((G, len(states), max_blocks), dtype=np.int64)
        for i, st in enumerate(states):
            ids = st.block_ids[: max_blocks * G]  # a draft pass may see fewer positions than allocated
            if G == 1:
                tables[0, i, : len(ids)] = ids
            else:
                m = len(ids) // G
                tables[:, i, :m] = np.asarray(ids, dtype=np.int64).reshape(m, G).T
        return tables

    def prepare(self, so: SchedulerOutput) -> StepInputs:
        """Flatten the scheduled requests (decodes first, as the attention contract wants)
        into token ids, positions and attention metadata."""
        order = sorted(so.scheduled, key=lambda sr: len(sr.token_ids) != 1)
        num_decodes = sum(1 for sr in order if len(sr.token_ids) == 1)
        states = [self.requests[sr.req_id] for sr in order]
        bs, n = self.block_size, len(order)
        q_lens = np.fromiter((len(sr.token_ids) for sr in order), dtype=np.int64, count=n)
        starts = np.fromiter((sr.num_computed_tokens for sr in order), dtype=np.int64, count=n)
        cu = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(q_lens, out=cu[1:])
        total = int(cu[-1])
        seq_lens = starts + q_lens
        input_ids = np.fromiter(itertools.chain.from_iterable(sr.token_ids for sr in order), np.int64, total)
        req_idx = np.repeat(np.arange(n), q_lens)
        positions = np.arange(total, dtype=np.int64) - cu[:-1][req_idx] + starts[req_idx]
        max_blocks = int((seq_lens.max() + bs - 1) // bs)
        tables = self._block_tables(states, max_blocks)
        block_table = tables[0]
        slots = block_table[req_idx, positions // bs] * bs + positions % bs
        dev = self.device
        meta = AttentionMetadata(
            num_reqs=n,
            num_decodes=num_decodes,
            query_start_loc=torch.from_numpy(cu).to(dev),
            seq_lens=torch.from_numpy(seq_lens).to(dev),
            block_tables=torch.from_numpy(block_table).to(dev),
            slot_mapping=torch.from_numpy(slots).to(dev),
            max_query_len=int(q_lens.max()),
            max_seq_len=int(seq_lens.max()),
            max_decode_seq_len=int(seq_lens[:num_decodes].max()) if num_decodes else 0,
            query_start_loc_list=cu.tolist(),
            seq_lens_list=seq_lens.tolist(),
        )
        if len(tables) > 1:
            meta.groups = [meta] + [
                dataclasses.replace(
                    meta,
                    block_tables=torch.from_numpy(t).to(dev),
                    slot_mapping=torch.from_numpy(t[req_idx, positions // bs] * bs + positions % bs).to(dev),
                    backend_cache={},
                )
                for t in tables[1:]
            ]
        return StepInputs(
            order, states, cu, torch.from_numpy(input_ids).to(dev), torch.from_numpy(positions).to(dev), meta
        )
