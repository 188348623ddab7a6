"""Iteration-level (continuous-batching) scheduler.

There are no prefill and decode phases. Every request has `num_computed_tokens`; each
step hands out `num_new_tokens` per request under a token budget: running requests first
(a decode costs one token), then waiting requests in policy order, their prompts cut into
chunks when the budget is short (chunked prefill). When a running request cannot get a
block, the lowest-priority running request is preempted (its blocks are freed; it is
recomputed later) and no new request is admitted in that step.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from pagedserve.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from pagedserve.core.admission import check_fits
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.request import Request, RequestStatus
from pagedserve.core.spec_decode import SpecDecodeState
from pagedserve.messages import (
    EngineCoreOutput,
    EngineStats,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)


# -- waiting-queue policies -----------------------------------------------------
class FCFSQueue:
    """First come, first served. Preempted requests go back to the front."""

    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, req: Request) -> None:
        self._q.append(req)

    def prepend(self, req: Request) -> None:
        self._q.appendleft(req)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, req: Request) -> None:
        self._q.remove(req)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class PriorityQueue:
    """Lowest `priority` value first, then earliest arrival (vLLM's convention)."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._count = itertools.count()

    def add(self, req: Request) -> None:
        heapq.heappush(self._heap, (req.priority, req.arrival_time, next(self._count), req))

    prepend = add

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, req: Request) -> None:
        self._heap = [e for e in self._heap if e[3] is not req]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (e[3] for e in sorted(self._heap))


@dataclass(frozen=True)
class SchedulingPolicy:
    """A policy: the order of the waiting queue, and which running request gives its
    blocks back when memory is short (the one the policy would have admitted last)."""

    queue_cls: type
    pick_victim: Callable[[list[Request]], Request]


POLICIES = {
    "fcfs": SchedulingPolicy(FCFSQueue, lambda running: running[-1]),  # the latest admitted
    "priority": SchedulingPolicy(PriorityQueue, lambda running: max(running, key=lambda r: (r.priority, r.arrival_time))),
}


class Scheduler:
    def __init__(
        self,
        sched_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        speculative: SpeculativeConfig | None = None,
    ) -> None:
        self.config = sched_config.resolved()
        self.spec = SpecDecodeState(speculative) if speculative is not None else None
        self.block_size = cache_config.block_size
        self.kv = KVCacheManager(num_blocks, cache_config.block_size, cache_config.enable_prefix_caching)
        self.policy = POLICIES[sched_config.scheduling_policy]
        self.waiting = self.policy.queue_cls()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_since_last_step: set[str] = set()
        self._preempted_since_last_step: set[str] = set()
        self._grammar_failed: list[EngineCoreOutput] = []  # reported by the next update_from_output
        # counters
        self.num_preemptions = 0
        self.num_steps = 0
        self.num_prompt_tokens = 0  # prompt tokens of admitted requests
        self.num_generation_tokens = 0
        self.num_computed_tokens_total = 0  # tokens run through the model (prefill + decode)
        self.last_batch_size = 0
        self.last_num_scheduled_tokens = 0

    # -- admission --------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        """Queue a request, or raise ValueError if it could never run."""
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use.")
        check_fits(req.num_prompt_tokens, req.max_tokens, self.config.max_model_len, self.block_size, self.kv.num_total_blocks)
        params = req.sampling_params
        req.stop_token_set = frozenset(params.stop_token_ids).union(
            () if params.ignore_eos else req.eos_token_ids
        )
        # a constrained request waits until its grammar (compiled off the step loop) is ready
        if req.structured_output_request is None:
            req.status = RequestStatus.WAITING
        else:
            req.status = RequestStatus.WAITING_FOR_GRAMMAR
        self.requests[req.request_id] = req
        self.waiting.add(req)

    # -- one step ---------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        threshold = cfg.long_prefill_token_threshold
        scheduled: list[ScheduledRequest] = []
        scheduled_reqs: list[Request] = []
        preempted = False

        # 1) running requests: decodes and unfinished prefill chunks (the hot loop:
        #    locals and positional construction keep it near 2 us per request)
        running = self.running
        allocate = self.kv.allocate_slots
        spec = self.spec if self.spec is not None and len(running) <= self.spec.max_batch_size else None
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            toks = req.all_token_ids
            start = req.num_computed_tokens
            num_new = len(toks) - start
            if threshold and num_new > threshold:
                num_new = threshold
            if num_new > budget:
                num_new = budget
            drafts = None
            if spec is not None and num_new == 1 and req.in_executor:  # eligibility: spec.propose
                drafts = spec.propose(req, min(budget - 1, self.config.max_model_len - len(toks) - 1))
                num_new += len(drafts) if drafts else 0
            while True:
                new_blocks = allocate(req, num_new)
                if new_blocks is not None:
                    break
                victim = self.policy.pick_victim(running)
                if running.index(victim) < i:  # already scheduled this step: take its slot back
                    j = scheduled_reqs.index(victim)
                    budget += len(scheduled[j].token_ids)
                    del scheduled[j], scheduled_reqs[j]
                    i -= 1
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if new_blocks is None:
                continue  # req itself was preempted; the list shifted under index i
            end = start + num_new
            if drafts:  # the last token, then the guesses to verify; always samples
                scheduled.append(
                    ScheduledRequest(
                        req.request_id,
                        toks[start:] + drafts,
                        start,
                        [b.block_id for b in new_blocks] if new_blocks else [],
                        True,
                        draft_token_ids=drafts,
                    )
                )
            elif req.in_executor:
                scheduled.append(
                    ScheduledRequest(
                        req.request_id,
                        toks[start:end],
                        start,
                        [b.block_id for b in new_blocks] if new_blocks else [],
                        end == len(toks),
                    )
                )
            else:  # admitted without tokens (a static batch): first time the executor sees it
                scheduled.append(self._first_schedule(req, start, num_new))
            scheduled_reqs.append(req)
            # Progress advances now, so that the next schedule() could run before this
            # step's results arrive (overlapped scheduling).
            req.num_computed_tokens = end
            budget -= num_new
            i += 1

        # 2) waiting requests, unless memory was short this step
        if not preempted:
            budget = self._schedule_waiting(budget, scheduled, scheduled_reqs)

        total = cfg.max_num_batched_tokens - budget
        self.num_computed_tokens_total += total
        finished, preempted_ids = self._finished_since_last_step, self._preempted_since_last_step
        self._finished_since_last_step, self._preempted_since_last_step = set(), set()
        self.num_steps += 1
        self.last_batch_size = len(scheduled)
        self.last_num_scheduled_tokens = total
        return SchedulerOutput(scheduled, total, finished, preempted_ids)

    def _schedule_waiting(
        self, budget: int, scheduled: list[ScheduledRequest], scheduled_reqs: list[Request]
    ) -> int:
        """Admit waiting requests in policy order while seats, budget and blocks last;
        returns the budget left. (The benchmarks' StaticScheduler overrides this.)"""
        cfg = self.config
        skipped: list[Request] = []  # grammars still compiling: they keep their places
        while self.waiting and len(self.running) < cfg.max_num_seqs and budget > 0:
            req = self.waiting.peek()
            if req.status is RequestStatus.WAITING_FOR_GRAMMAR and not self._grammar_ready(req, skipped):
                continue
            hit_blocks, num_hit = self.kv.get_computed_blocks(req)
            num_new = req.num_tokens - num_hit
            if cfg.long_prefill_token_threshold and num_new > cfg.long_prefill_token_threshold:
                num_new = cfg.long_prefill_token_threshold
            if num_new > budget:
                if not cfg.enable_chunked_prefill:
                    break
                num_new = budget
            if not self._admit(req, hit_blocks, num_hit, num_new, scheduled, scheduled_reqs):
                break
            budget -= num_new
        for req in reversed(skipped):
            self.waiting.prepend(req)
        return budget

    def _grammar_ready(self, req: Request, skipped: list[Request]) -> bool:
        """Whether the head of the queue, waiting for its grammar, may be admitted now. If
        not, it leaves the head: into `skipped` while its grammar compiles, or finished
        (aborted, reported by the next update_from_output) if the grammar failed."""
        so_req = req.structured_output_request
        if not so_req.ready():
            skipped.append(self.waiting.pop())
            return False
        req.status = RequestStatus.WAITING
        if so_req.error is None:
            return True
        self.waiting.pop()
        out = EngineCoreOutput(req.request_id, [])
        self._finish(req, RequestStatus.FINISHED_ABORTED, out)
        self._grammar_failed.append(out)
        return False

    def _admit(
        self,
        req: Request,
        hit_blocks: list,
        num_hit: int,
        num_new: int,
        scheduled: list[ScheduledRequest],
        scheduled_reqs: list[Request],
    ) -> bool:
        """Move the head of the waiting queue to running with `num_new` tokens scheduled
        after its `num_hit` prefix-cache hit; False (nothing changed) if blocks are short."""
        new_blocks = self.kv.allocate_slots(req, num_new, hit_blocks, num_hit)
        if new_blocks is None:
            return False
        self.waiting.pop()
        self.running.append(req)
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = num_hit
        if req.num_cached_tokens < 0:  # first admission (not a resumption)
            req.num_cached_tokens = num_hit
            self.num_prompt_tokens += req.num_prompt_tokens
        self.kv.record_prefix_query(req.num_tokens, num_hit)
        if num_new:
            scheduled.append(self._first_schedule(req, num_hit, num_new))
            scheduled_reqs.append(req)
            req.num_computed_tokens = num_hit + num_new
        return True

    def _first_schedule(self, req: Request, start: int, num_new: int) -> ScheduledRequest:
        """The executor (re)creates its state for the request from this message."""
        req.in_executor = True
        return ScheduledRequest(
            req_id=req.request_id,
            token_ids=req.all_token_ids[start : start + num_new],
            num_computed_tokens=start,
            block_ids=self.kv.get_block_ids(req.request_id),
            sample=start + num_new == req.num_tokens,
            is_new=True,
            sampling_params=req.sampling_params,
            prompt_token_ids=req.prompt_token_ids,
            output_token_ids=list(req.output_token_ids),
        )

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.in_executor = False
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(req)
        self._preempted_since_last_step.add(req.request_id)

    # -- results ----------------------------------------------------------------
    def update_from_output(
        self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply stop conditions, free finished requests."""
        outputs: list[EngineCoreOutput] = []
        if self._grammar_failed:
            outputs, self._grammar_failed = self._grammar_failed, []
        sampled = runner_out.sampled_token_ids
        all_prompt_lps = runner_out.prompt_logprobs
        all_lps = runner_out.logprobs
        requests = self.requests
        running = RequestStatus.RUNNING
        max_model_len = self.config.max_model_len
        any_finished = False
        for sr in sched_out.scheduled:
            req = requests.get(sr.req_id)
            if req is None or req.status is not running:
                continue  # aborted or preempted meanwhile
            prompt_lps = all_prompt_lps.get(sr.req_id) if all_prompt_lps else None
            if not sr.sample:
                if prompt_lps:
                    outputs.append(EngineCoreOutput(sr.req_id, [], new_prompt_logprobs=prompt_lps))
                continue
            if req.max_tokens == 0:  # prompt logprobs only (echo)
                out = EngineCoreOutput(sr.req_id, [], new_prompt_logprobs=prompt_lps)
                self._finish(req, RequestStatus.FINISHED_LENGTH, out)
                outputs.append(out)
                any_finished = True
                continue
            if sr.draft_token_ids is not None:
                out = self._apply_verified(req, sr, runner_out.spec_token_ids[sr.req_id])
                any_finished |= out.finish_reason is not None
                outputs.append(out)
                continue
            token = sampled[sr.req_id]
            req.output_token_ids.append(token)
            req.all_token_ids.append(token)
            if req.structured_output_request is not None:  # advance its grammar's matcher
                req.structured_output_request.accept(token)
            lp = all_lps.get(sr.req_id) if all_lps else None
            out = EngineCoreOutput(
                sr.req_id,
                [token],
                [lp] if lp is not None else None,
                prompt_lps,
                None,
                None,
                req.num_cached_tokens,
            )
            # cheap pre-check; the exact rules live in _check_stop
            if (
                token in req.stop_token_set
                or len(req.output_token_ids) >= req.max_tokens
                or len(req.all_token_ids) >= max_model_len
            ):
                status = self._check_stop(req, token)
                if status is not None:
                    self._finish(req, status, out)
                    any_finished = True
            outputs.append(out)
        self.num_generation_tokens += len(sampled)
        if any_finished:
            self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]
        return outputs

    def _apply_verified(self, req: Request, sr: ScheduledRequest, tokens: list[int]) -> EngineCoreOutput:
        """Speculative step: `tokens` are the accepted drafts and one more. Progress rolls
        back past the rejected guesses (their K/V slots are simply overwritten later),
        tokens are appended one at a time with the stop rules of a normal step (so stops and
        max_tokens land where they would without speculation), and blocks holding only
        rejected guesses go back to the pool."""
        k = len(sr.draft_token_ids)
        accepted = len(tokens) - 1
        req.num_computed_tokens -= k - accepted
        self.spec.record(req, k, accepted)
        out = EngineCoreOutput(sr.req_id, [], None, None, None, None, req.num_cached_tokens)
        for token in tokens:
            req.output_token_ids.append(token)
            req.all_token_ids.append(token)
            out.new_token_ids.append(token)
            self.num_generation_tokens += 1
            status = self._check_stop(req, token)
            if status is not None:
                self._finish(req, status, out)
                return out
        self.kv.trim(req, req.num_computed_tokens)
        return out

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        params = req.sampling_params
        n_out = len(req.output_token_ids)
        if n_out >= params.min_tokens:
            if not params.ignore_eos and token in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if n_out >= req.max_tokens or req.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, req: Request, status: RequestStatus, out: EngineCoreOutput | None = None) -> None:
        req.status = status
        self.kv.free(req)
        del self.requests[req.request_id]
        self._finished_since_last_step.add(req.request_id)
        if out is not None:
            out.finish_reason = status.finish_reason
            out.stop_reason = req.stop_reason

    # -- outside events ---------------------------------------------------------
    def finish_requests(self, req_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """End requests from any state (abort, or a stop string found by the detokenizer).
        Their blocks are freed at once. Unknown ids are ignored."""
        done = []
        for rid in req_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            if req.status is RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            self._finish(req, status)
            done.append(req)
        return done

    def abort_requests(self, req_ids: Iterable[str]) -> list[Request]:
        return self.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)

    # -- state --------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def kv_stored_tokens(self) -> int:
        """Tokens whose K/V occupy the cache, each shared block counted once."""
        return (
            sum(r.num_computed_tokens for r in self.running) - self.kv.pool.num_shared_refs * self.block_size
        )

    def kv_utilization(self) -> float:
        """Stored tokens / allocated token slots (1.0 when nothing is allocated)."""
        used = self.kv.num_used_blocks
        return self.kv_stored_tokens() / (used * self.block_size) if used else 1.0

    def reset_prefix_cache(self) -> None:
        """Forget every cached-but-free block (held blocks are untouched)."""
        self.kv.reset_prefix_cache()

    def make_stats(self) -> EngineStats:
        kv = self.kv
        spec = self.spec
        return EngineStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_blocks_total=kv.num_total_blocks,
            kv_blocks_used=kv.num_used_blocks,
            kv_cache_usage=kv.usage,
            kv_utilization=self.kv_utilization(),
            num_preemptions=self.num_preemptions,
            prompt_tokens=self.num_prompt_tokens,
            generation_tokens=self.num_generation_tokens,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_steps=self.num_steps,
            computed_tokens=self.num_computed_tokens_total,
            last_batch_size=self.last_batch_size,
            last_num_scheduled_tokens=self.last_num_scheduled_tokens,
            block_size=self.block_size,
            spec_num_drafts=spec.num_drafts if spec else 0,
            spec_num_draft_tokens=spec.num_draft_tokens if spec else 0,
            spec_num_accepted_tokens=spec.num_accepted_tokens if spec else 0,
            spec_accepted_per_position=list(spec.accepted_per_position) if spec else [],
        )
