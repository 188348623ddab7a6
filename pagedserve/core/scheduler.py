"""Iteration-level (continuous-batching) scheduler.

There are no prefill and decode phases. Every request has `num_computed_tokens`; each
step hands out `num_new_tokens` per request under a token budget, in two named phases
over one `StepState`: running requests first (a decode costs one token; speculative
guesses come from one hook), then waiting requests in policy order (core/policies.py),
their prompts cut into chunks when the budget is short (chunked prefill). When a running
request cannot get a block, the policy's victim is preempted (its blocks are freed; it is
recomputed later; if it was already scheduled this step, that share is undone) and no
new request is admitted in that step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from pagedserve.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from pagedserve.core.admission import check_fits
from pagedserve.core.kv_cache_manager import make_kv_cache_manager
from pagedserve.core.kv_offload import KVOffloadManager
from pagedserve.core.policies import POLICIES
from pagedserve.core.request import Request, RequestStatus
from pagedserve.core.spec_decode import SpecDecodeState
from pagedserve.messages import (
    CachedRequestData,
    EngineCoreOutput,
    EngineStats,
    ModelRunnerOutput,
    NewRequestData,
    ScheduledRequest,
    SchedulerOutput,
)

# (request, token budget left) -> guesses to verify this step, or None
DraftProposer = Callable[[Request, int], "list[int] | None"]


@dataclass
class StepState:
    """What one `schedule()` has handed out so far. Invariants: `reqs[i]` is the request of
    `scheduled[i]`; `budget` = the step's budget minus the tokens of `scheduled`; each
    scheduled request's `num_computed_tokens` already counts its share (so the next
    schedule() may run before this step's results arrive: overlapped scheduling)."""

    budget: int
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    reqs: list[Request] = field(default_factory=list)
    preempted: bool = False  # memory was short: nothing new is admitted

    def add(self, req: Request, share: ScheduledRequest) -> None:
        n = len(share.token_ids)
        self.scheduled.append(share)
        self.reqs.append(req)
        self.budget -= n
        req.num_computed_tokens = share.num_computed_tokens + n

    def take_back(self, req: Request) -> None:
        """Undo `req`'s share, if it has one (it is being preempted; a running request
        the policy held back this step has none)."""
        j = next((j for j, r in enumerate(self.reqs) if r is req), None)
        if j is None:
            return
        self.budget += len(self.scheduled[j].token_ids)
        del self.scheduled[j], self.reqs[j]


class Scheduler:
    def __init__(
        self,
        sched_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        speculative: SpeculativeConfig | None = None,
        kv_cache_groups: tuple[int | None, ...] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`kv_cache_groups`: per KV cache group, its sliding window or None (full
        attention); None: one full-attention group (the hybrid KV cache manager's input).
        `clock`: the wall clock the policy ages and meets deadlines by (tests pass a fake)."""
        self.config = sched_config.resolved()
        self.spec = SpecDecodeState(speculative) if speculative is not None else None
        self.block_size = cache_config.block_size
        self.kv = make_kv_cache_manager(
            num_blocks,
            cache_config.block_size,
            cache_config.enable_prefix_caching,
            kv_cache_groups,
            self.config.max_num_batched_tokens,
        )
        self.policy = POLICIES[sched_config.scheduling_policy](self.config, clock)
        self.waiting = self.policy.waiting
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_since_last_step: set[str] = set()
        self._preempted_since_last_step: set[str] = set()
        self._grammar_failed: list[EngineCoreOutput] = []  # reported by the next update_from_output
        self.offload: KVOffloadManager | None = None  # the disk KV tier (attach_kv_offload)
        # counters
        self.num_preemptions = 0
        self.num_steps = 0
        self.num_prompt_tokens = 0  # prompt tokens of admitted requests
        self.num_generation_tokens = 0
        self.num_computed_tokens_total = 0  # tokens run through the model (prefill + decode)
        self.last_batch_size = 0
        self.last_num_scheduled_tokens = 0
        self.max_loras = 0  # LoRA: the most adapters among running requests (0: adapters off)
        self.lora_ready: Callable[[int], bool] = lambda lora_int_id: True  # its weights are read

    def attach_kv_offload(self, connector) -> None:
        """Put the disk KV tier (an executor's KVOffloadConnector) under the prefix cache."""
        self.offload = KVOffloadManager(self.kv, connector)

    # -- admission --------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        """Queue a request, or raise ValueError if it could never run."""
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use.")
        cap = self.kv.request_capacity_blocks
        check_fits(req.num_prompt_tokens, req.max_tokens, self.config.max_model_len, self.block_size, cap)
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
        self.policy.on_added(req)

    # -- one step ---------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """One step: running requests first, then waiting ones unless memory ran short."""
        step = StepState(self.config.max_num_batched_tokens)
        offload = self.offload
        if offload is not None:  # reads finished since the last step: their blocks are cached now
            offload.poll()
        self.policy.begin_step(self.running, step.budget)
        self._schedule_running(step)
        if not step.preempted:
            self._schedule_waiting(step)
        if offload is not None:  # blocks evicted this step: K/V copied out before the forward
            offload.flush_evictions()
        total = self.config.max_num_batched_tokens - step.budget
        self.num_computed_tokens_total += total
        self.num_steps += 1
        self.last_batch_size = len(step.scheduled)
        self.last_num_scheduled_tokens = total
        finished, preempted = self._finished_since_last_step, self._preempted_since_last_step
        self._finished_since_last_step, self._preempted_since_last_step = set(), set()
        return SchedulerOutput(step.scheduled, total, finished, preempted)

    def _schedule_running(self, step: StepState) -> None:
        """Decodes and unfinished prefill chunks of the running requests, in order (the hot
        loop: about 2 us per request). A request that cannot get its blocks preempts the
        policy's victims until it can, or until it is the victim itself."""
        running, allocate = self.running, self.kv.allocate_slots
        propose = self._draft_proposer()
        i = 0
        while i < len(running) and step.budget > 0:
            req = running[i]
            start = req.num_computed_tokens
            num_new = len(req.all_token_ids) - start
            if num_new > 1:  # a prefill chunk (or a recompute): the caps apply
                chunk = self._prefill_chunk(req, num_new, step.budget)
                if chunk == 0:  # the policy holds this prefill back for a step
                    i += 1
                    continue
                num_new = chunk or min(num_new, step.budget)
            drafts = propose(req, step.budget) if propose is not None and num_new == 1 and req.in_executor else None
            if drafts:
                num_new += len(drafts)
            new_blocks = allocate(req, num_new)
            if new_blocks is None:
                new_blocks, i = self._preempt_until_fits(req, num_new, i, step)
                if new_blocks is None:
                    continue  # req itself was preempted; the list shifted under index i
            step.add(req, self._running_share(req, start, num_new, new_blocks, drafts))
            i += 1

    def _preempt_until_fits(self, req: Request, num_new: int, i: int, step: StepState) -> tuple:
        """Preempt victims until `req` (running[i]) gets blocks for `num_new` tokens:
        (its new blocks, i), or (None, i) when `req` itself was preempted. A victim
        before `req` in the running list has its share (if any) undone and i moves back."""
        while True:
            victim = self.policy.pick_victim(self.running)
            if self.running.index(victim) < i:
                step.take_back(victim)
                i -= 1
            self._preempt(victim)
            step.preempted = True
            if victim is req:
                return None, i
            new_blocks = self.kv.allocate_slots(req, num_new)
            if new_blocks is not None:
                return new_blocks, i

    def _draft_proposer(self) -> DraftProposer | None:
        """The speculative-decoding hook for this step, or None (off, or the batch is
        larger than speculation pays for)."""
        spec = self.spec
        if spec is None or len(self.running) > spec.max_batch_size:
            return None
        max_len = self.config.max_model_len
        return lambda req, budget: spec.propose(req, min(budget - 1, max_len - req.num_tokens - 1))

    def _running_share(self, req: Request, start: int, num_new: int, new_blocks, drafts) -> ScheduledRequest:
        if not req.in_executor:  # admitted without tokens (a static batch): first time the executor sees it
            return self._new_share(req, start, num_new)
        toks = req.all_token_ids
        block_ids = [b.block_id for b in new_blocks] if new_blocks else []
        if drafts:  # the last token, then the guesses to verify; always samples
            return CachedRequestData(
                req_id=req.request_id,
                token_ids=toks[start:] + drafts,
                num_computed_tokens=start,
                block_ids=block_ids,
                sample=True,
                draft_token_ids=drafts,
            )
        end = start + num_new
        return CachedRequestData(
            req_id=req.request_id,
            token_ids=toks[start:end],
            num_computed_tokens=start,
            block_ids=block_ids,
            sample=end == len(toks),
        )

    def _new_share(self, req: Request, start: int, num_new: int) -> NewRequestData:
        """The executor (re)creates its state for the request from this message."""
        req.in_executor = True
        return NewRequestData(
            req_id=req.request_id,
            token_ids=req.all_token_ids[start : start + num_new],
            num_computed_tokens=start,
            block_ids=self.kv.get_block_ids(req.request_id),
            sample=start + num_new == req.num_tokens,
            sampling_params=req.sampling_params,
            prompt_token_ids=req.prompt_token_ids,
            output_token_ids=list(req.output_token_ids),
            lora_request=req.lora_request,
        )

    def _schedule_waiting(self, step: StepState) -> None:
        """Admit waiting requests in policy order while seats, budget and blocks last.
        (The benchmarks' StaticScheduler overrides this.)"""
        skipped: list[Request] = []  # grammars still compiling: they keep their places
        while self.waiting and len(self.running) < self.config.max_num_seqs and step.budget > 0:
            req = self.waiting.peek()
            if req.status is RequestStatus.WAITING_FOR_GRAMMAR and not self._grammar_ready(req, skipped):
                continue
            if self.offload is not None and self._waits_for_kv(req, skipped):
                continue
            if not self.policy.may_admit(req, len(self.running)):
                if self._steps_aside(req, skipped):
                    continue
                break
            if req.lora_request is not None and not self._lora_fits(req):
                skipped.append(self.waiting.pop())  # its adapter waits for a free slot
                continue
            hit_blocks, num_hit = self.kv.get_computed_blocks(req) if not req.whole_prompt else ([], 0)
            num_new = self._prefill_chunk(req, req.num_tokens - num_hit, step.budget)
            if num_new == 0 and self._steps_aside(req, skipped):
                continue
            if not num_new or not self._admit(req, hit_blocks, num_hit, num_new, step):
                if self.offload is not None and not self.running:  # nothing runs: no hold may block the head
                    self.offload.release_others(req)
                break
        for req in reversed(skipped):
            self.waiting.prepend(req)

    def _steps_aside(self, req: Request, skipped: list[Request]) -> bool:
        """The policy holds the head of the queue back this step: whether it lets the
        requests behind it go first (it leaves the head into `skipped`, keeping its place)."""
        if not self.policy.lets_others_pass(req):
            return False
        skipped.append(self.waiting.pop())
        return True

    def _waits_for_kv(self, req: Request, skipped: list[Request]) -> bool:
        """The disk KV tier: whether the head of the queue must wait for a read of its
        prefix (just queued, or still in flight); if so it leaves the head into `skipped`."""
        offload = self.offload
        if req.status is RequestStatus.WAITING_FOR_KV:
            if not offload.ready(req):
                skipped.append(self.waiting.pop())
                return True
            req.status = RequestStatus.WAITING
            return False
        if req.whole_prompt or not offload.start_load(req):
            return False
        req.status = RequestStatus.WAITING_FOR_KV
        skipped.append(self.waiting.pop())
        return True

    def _lora_fits(self, req: Request) -> bool:
        """Whether `req`'s adapter is read (else it waits, the others run) and admitting it
        keeps the running requests' adapters within max_loras."""
        if not self.lora_ready(req.lora_int_id):
            return False
        loras = {r.lora_int_id for r in self.running if r.lora_request is not None}
        return req.lora_int_id in loras or len(loras) < self.max_loras

    def _prefill_chunk(self, req: Request, num_left: int, budget: int) -> int | None:
        """Tokens of `req`'s prompt (or recompute) to run this step, under the threshold,
        the policy's lane cap and the budget (None: without chunked prefill it must wait
        for a step with room for all of it; 0: the policy holds it back this step)."""
        cfg = self.config
        if cfg.long_prefill_token_threshold and num_left > cfg.long_prefill_token_threshold:
            num_left = cfg.long_prefill_token_threshold
        cap = self.policy.prefill_cap(req, num_left)
        if cap == 0:
            return 0
        if cap is not None and num_left > cap and cfg.enable_chunked_prefill:
            num_left = cap
        if num_left > budget:
            if not cfg.enable_chunked_prefill:
                return None
            num_left = budget
        return num_left

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

    def _admit(self, req: Request, hit_blocks: list, num_hit: int, num_new: int, step: StepState) -> bool:
        """Move the head of the waiting queue to running with `num_new` tokens scheduled
        after its `num_hit` prefix-cache hit; False (nothing changed) if blocks are short."""
        new_blocks = self.kv.allocate_slots(req, num_new, hit_blocks, num_hit)
        if new_blocks is None:
            return False
        if self.offload is not None:  # it holds its restored prefix itself now
            self.offload.on_admitted(req, num_hit)
        self.waiting.pop()
        self.running.append(req)
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = num_hit
        if req.num_cached_tokens < 0:  # first admission (not a resumption)
            req.num_cached_tokens = num_hit
            self.num_prompt_tokens += req.num_prompt_tokens
        self.kv.record_prefix_query(req.num_tokens, num_hit)
        if num_new:
            step.add(req, self._new_share(req, num_hit, num_new))
        return True

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
    def update_from_output(self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply stop conditions, free finished requests."""
        outputs: list[EngineCoreOutput] = []
        if self._grammar_failed:
            outputs, self._grammar_failed = self._grammar_failed, []
        requests, running = self.requests, RequestStatus.RUNNING
        any_finished = False
        for sr in sched_out.scheduled:
            req = requests.get(sr.req_id)
            if req is None or req.status is not running:
                continue  # aborted or preempted meanwhile
            out = self._request_output(req, sr, runner_out)
            if out is not None:
                outputs.append(out)
                any_finished |= out.finish_reason is not None
        self.num_generation_tokens += len(runner_out.sampled_token_ids)
        if any_finished:
            self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]
        return outputs

    def observe_step_seconds(self, sched_out: SchedulerOutput, seconds: float) -> None:
        """The step `sched_out` took `seconds` (schedule, forward, update): for the policy's
        step-time model (length_aware's long_lane_step_ms)."""
        if sched_out.scheduled:
            self.policy.observe_step(sched_out.scheduled, seconds)

    def _request_output(self, req: Request, sr: ScheduledRequest, ro: ModelRunnerOutput) -> EngineCoreOutput | None:
        """What `sr`'s results change for `req` (None: nothing to report)."""
        rid = sr.req_id
        prompt_lps = ro.prompt_logprobs.get(rid) if ro.prompt_logprobs else None
        if not sr.sample:
            return EngineCoreOutput(rid, [], new_prompt_logprobs=prompt_lps) if prompt_lps else None
        if req.sampling_params.pooling is not None:  # an embedding: the prompt's pooled vector, and done
            out = EngineCoreOutput(rid, [], num_cached_tokens=req.num_cached_tokens, pooled=ro.pooled.get(rid))
            self._finish(req, RequestStatus.FINISHED_STOPPED, out)
            return out
        if req.max_tokens == 0:  # prompt logprobs only (echo)
            out = EngineCoreOutput(rid, [], new_prompt_logprobs=prompt_lps)
            self._finish(req, RequestStatus.FINISHED_LENGTH, out)
            return out
        if sr.draft_token_ids is not None:
            return self._apply_verified(req, sr, ro.spec_token_ids[rid])
        token = ro.sampled_token_ids[rid]
        req.output_token_ids.append(token)
        req.all_token_ids.append(token)
        if req.structured_output_request is not None:  # advance its grammar's matcher
            req.structured_output_request.accept(token)
        lp = ro.logprobs.get(rid) if ro.logprobs else None
        # positional (the once-per-token hot path; keywords cost ~0.4 us more):
        # req_id, new_token_ids, new_logprobs, new_prompt_logprobs, finish_reason, stop_reason, num_cached_tokens
        out = EngineCoreOutput(rid, [token], [lp] if lp is not None else None, prompt_lps, None, None, req.num_cached_tokens)
        # cheap pre-check; the exact rules live in _check_stop
        if (
            token in req.stop_token_set
            or len(req.output_token_ids) >= req.max_tokens
            or len(req.all_token_ids) >= self.config.max_model_len
        ):
            status = self._check_stop(req, token)
            if status is not None:
                self._finish(req, status, out)
        return out

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
        out = EngineCoreOutput(sr.req_id, [], num_cached_tokens=req.num_cached_tokens)
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
        if self.offload is not None:
            self.offload.release(req)
        self.policy.on_finished(req, status is not RequestStatus.FINISHED_ABORTED)
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

    def fail_requests(self, req_ids: Iterable[str]) -> None:
        """Abort requests the engine cannot run (their LoRA adapter failed to load); the
        next update_from_output reports them finished ("abort") to the front end."""
        for req in self.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED):
            self._grammar_failed.append(EngineCoreOutput(req.request_id, [], finish_reason="abort"))

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
