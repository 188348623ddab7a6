"""Static batching, the baseline of `pagedserve bench serve --compare-static`: a batch of
up to max_num_seqs requests is admitted when nothing runs (even past the token budget:
its prefill then proceeds in chunks through the running loop), and nothing joins until
every member has finished. Not for production: it exists to measure what continuous
batching gains.

Select it with `--scheduler-cls pagedserve.bench.static_scheduler.StaticScheduler`.
"""

from __future__ import annotations

from pagedserve.core.scheduler import Scheduler, StepState

STATIC_SCHEDULER_CLS = f"{__name__}.StaticScheduler"


class StaticScheduler(Scheduler):
    def _schedule_waiting(self, step: StepState) -> None:
        if self.running:
            return
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.peek()
            hit_blocks, num_hit = self.kv.get_computed_blocks(req)
            num_new = min(req.num_tokens - num_hit, max(step.budget, 0))
            if not self._admit(req, hit_blocks, num_hit, num_new, step):
                break
