"""Scheduling policies: the order of the waiting queue, which running request gives its
blocks back when memory is short, and (length_aware) lanes that cap long work per step.

A queue offers add / prepend (a preempted request goes back to the front of its class) /
peek / pop / remove, `len`, iteration in policy order, and `unordered()` (every request,
cheaply, in no promised order: for views). `pick_victim(running)` names the running
request to preempt: the one the policy would have admitted last.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from collections.abc import Callable, Iterator

from pagedserve.config import SchedulerConfig
from pagedserve.core.length_estimator import OutputLengthEstimator
from pagedserve.core.request import Request
from pagedserve.core.step_cost import OnlineStepCost, step_features

LONG_LANE_MIN_TOKENS = 64  # the long lane's least chunk in a step it runs in (long_lane_step_ms)


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

    unordered = __iter__


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

    def unordered(self) -> Iterator[Request]:
        """In heap order (no sort)."""
        return (e[3] for e in self._heap)


class LengthAwareQueue:
    """Waiting requests in length-aware order (see LengthAwarePolicy.key), re-sorted when
    the policy's clock moves (begin_step) or the queue changed."""

    def __init__(self, key: Callable[[Request], tuple]) -> None:
        self._items: list[Request] = []
        self._key = key
        self._dirty = False

    def touch(self) -> None:
        """The keys may have changed (time moved on): sort again before the next peek."""
        self._dirty = True

    def _sorted(self) -> list[Request]:
        if self._dirty:
            self._items.sort(key=self._key)
            self._dirty = False
        return self._items

    def add(self, req: Request) -> None:
        self._items.append(req)
        self._dirty = True

    prepend = add  # a preempted request takes its place by key like any other

    def peek(self) -> Request:
        return self._sorted()[0]

    def pop(self) -> Request:
        return self._sorted().pop(0)

    def remove(self, req: Request) -> None:
        self._items.remove(req)

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._sorted()))

    def unordered(self) -> Iterator[Request]:
        return iter(self._items)


class SchedulingPolicy:
    """The scheduler's policy hooks, with first come, first served behaviour: the waiting
    queue's order, the preemption victim (the latest admitted), and no lanes (`prefill_cap`
    None, every admission allowed). Subclasses change what they need."""

    queue_cls: type = FCFSQueue

    def __init__(self, config: SchedulerConfig, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.clock = clock
        self.waiting = self.make_queue()

    def make_queue(self):
        return self.queue_cls()

    def pick_victim(self, running: list[Request]) -> Request:
        return running[-1]

    def on_added(self, req: Request) -> None:
        """A request entered the waiting queue for the first time."""

    def begin_step(self, running: list[Request], budget: int) -> None:
        """Called once at the start of every schedule()."""

    def prefill_cap(self, req: Request, num_left: int) -> int | None:
        """The most of its `num_left` prompt tokens `req` may compute this step (None: no
        cap of the policy's; 0: none this step). Asked once per request and step, in the
        order the scheduler considers them."""
        return None

    def may_admit(self, req: Request, num_running: int) -> bool:
        """Whether the head of the waiting queue may take a running seat now."""
        return True

    def lets_others_pass(self, req: Request) -> bool:
        """The head of the queue is held back this step (may_admit False, or a prefill cap
        of 0): whether the requests behind it may be admitted before it (else they wait)."""
        return False

    def on_finished(self, req: Request, completed: bool) -> None:
        """A request left (completed: it stopped or reached its length; else aborted)."""

    def observe_step(self, scheduled, seconds: float) -> None:
        """A step ran: its scheduled requests' shares and the seconds it took (schedule,
        forward, update)."""


class PriorityPolicy(SchedulingPolicy):
    """Lowest `priority` first (then arrival); the victim is the lowest-priority, latest request."""

    queue_cls = PriorityQueue

    def pick_victim(self, running: list[Request]) -> Request:
        return max(running, key=lambda r: (r.priority, r.arrival_time))


class LengthAwarePolicy(SchedulingPolicy):
    """Short work first, without starving long work (the seed's advice: serve short and
    long requests apart).

    Order of the waiting queue (`key`):
      1. requests that waited `max_wait_s` or longer, oldest first: the aging bound (once a
         request is overdue, no request that arrived after it is admitted before it);
      2. requests with a time-to-first-token target, earliest deadline first;
      3. the rest by expected work, least first: prompt tokens + expected output tokens
         (`max_tokens` when the client gave it, else OutputLengthEstimator's estimate).
    Lanes: a request whose expected work is under `short_request_tokens` is short. While
    any short request waits or runs, long requests compute at most (1 - share) of a step's
    token budget of prompt, and at most `long_lane_chunk_tokens`, all of them together (the
    step a short request waits behind, and decodes with, stays short however many documents
    are in prefill), and hold at most (1 - share) of the running seats; with no short work
    they take every seat and up to `long_solo_chunk_tokens` a step together (a short request
    arriving then waits behind one such step, not a whole budget's; beside short work the
    allowance is never above it either). With `long_lane_step_ms`, the allowance is also
    cut, chunk by chunk, to what keeps the step within that time on the step-time model
    fitted online (core/step_cost.py) on this engine's own steps (their decodes counted, a
    chunk's cost growing with its context), but never below LONG_LANE_MIN_TOKENS: a long
    prompt's late chunks, which attend to more context, get fewer tokens, and a slow CPU
    gets smaller chunks than a fast one. The allowance goes to long prefills in the order
    the scheduler meets them (running ones first). Lanes off (share 0): no cap either way.
    Steps, too: while short work exists, long prefill chunks run in at most one step of
    `long_lane_period` (P; the steps between decode without them, so a short request's
    tokens mostly come from short steps), and a step whose queue starts with a short
    request (admitted now: this step makes its first token) carries none unless 2P steps
    passed: the long lane advances at least once every 2P steps, and a long prefill in
    every step once it has waited `max_wait_s` since it arrived (the aging bound covers its
    first token). A long request held back this step at the head of the queue steps aside
    for those behind it when it is there for its TTFT deadline (short requests may follow
    it); an overdue one, or one in its place by expected work, keeps them waiting.
    Victim: the running request whose preemption costs least, computed tokens to redo
    per expected remaining token (ties: the latest admitted).
    """

    def __init__(self, config: SchedulerConfig, clock: Callable[[], float] = time.time) -> None:
        self.estimator = OutputLengthEstimator(config.expected_output_tokens)
        self.now = clock()
        self.num_short = 0  # short requests waiting or running
        self.long_cap: int | None = None  # this step's prompt tokens for all long requests together
        self.long_left: int | None = None  # what is left of it while the step is scheduled
        self.long_running = 0
        self.long_yields = False  # this step: long prefill chunks wait (long_lane_period)
        self.since_long = 1 << 30  # steps since long prefill chunks last could run
        self.step_cost = OnlineStepCost() if config.long_lane_step_ms else None
        self.totals: tuple[int, int, int, float] | None = None  # this step so far, for step_cost
        super().__init__(config, clock)
        self.long_seats = max(1, int(config.max_num_seqs * (1 - config.short_budget_share)))

    def make_queue(self):
        return LengthAwareQueue(self.key)

    def overdue(self, r: Request) -> bool:
        """It has waited max_wait_s since it arrived (the aging bound)."""
        return self.now - r.arrival_time >= self.config.max_wait_s

    def key(self, r: Request) -> tuple:
        if self.overdue(r):
            return (0, r.arrival_time, 0)
        if r.ttft_deadline is not None:
            return (1, r.ttft_deadline, r.arrival_time)
        return (2, r.expected_work, r.arrival_time)

    def on_added(self, req: Request) -> None:
        out = self.estimator.expected_output(req.num_prompt_tokens, req.sampling_params.max_tokens)
        req.expected_work = req.num_prompt_tokens + min(out, req.max_tokens)
        req.is_short = req.expected_work < self.config.short_request_tokens
        self.num_short += req.is_short

    def begin_step(self, running: list[Request], budget: int) -> None:
        self.now = self.clock()
        self.waiting.touch()
        share = self.config.short_budget_share
        self.long_cap = None
        solo = self.config.long_solo_chunk_tokens
        if self.num_short and share:
            caps = (max(1, int(budget * (1 - share))), self.config.long_lane_chunk_tokens, solo)
            self.long_cap = min(c for c in caps if c)
        elif share and solo:  # no short work: bounded chunks all the same
            self.long_cap = solo
        self.long_left = self.long_cap
        self.totals = None
        if self.long_cap is not None and self.step_cost is not None and self.step_cost.ready:
            decodes = [r.num_computed_tokens for r in running if r.num_tokens - r.num_computed_tokens == 1]
            self.totals = (len(decodes), sum(decodes), 0, 0.0)
        self.long_running = sum(1 for r in running if not r.is_short)
        self.since_long += 1
        self.long_yields = self._long_yields()
        if not self.long_yields:
            self.since_long = 0

    def _long_yields(self) -> bool:
        """Whether long prefill chunks sit this step out (see the class's Lanes)."""
        p = self.config.long_lane_period
        if not p or not self.num_short:
            return False
        head_short = len(self.waiting) > 0 and self.waiting.peek().is_short
        return self.since_long < p or (head_short and self.since_long < 2 * p)

    def prefill_cap(self, req: Request, num_left: int) -> int | None:
        if req.is_short:
            self._count_chunk(req, num_left)
            return None
        if self.long_yields and not self.overdue(req):
            return 0
        if self.long_left is None:
            return None
        n = min(self.long_left, num_left)  # counted as taken even if the budget or blocks cut it
        if self.totals is not None and n > LONG_LANE_MIN_TOKENS:
            fit = self.step_cost.prefill_within(self.config.long_lane_step_ms / 1e3, self.totals, req.num_computed_tokens, n)
            n = max(fit, LONG_LANE_MIN_TOKENS)
        self.long_left -= n
        self._count_chunk(req, n)
        return n

    def _count_chunk(self, req: Request, n: int) -> None:
        """Add a prefill chunk of `n` tokens to this step's totals (long_lane_step_ms)."""
        if self.totals is not None:
            rows, ctx, prefill, attn = self.totals
            c = req.num_computed_tokens
            self.totals = (rows, ctx, prefill + n, attn + n * (c + n / 2))

    def observe_step(self, scheduled, seconds: float) -> None:
        if self.step_cost is not None:
            self.step_cost.observe(step_features((len(s.token_ids), s.num_computed_tokens) for s in scheduled), seconds)

    def may_admit(self, req: Request, num_running: int) -> bool:
        if req.is_short or not self.num_short:
            return True
        if self.long_running >= self.long_seats:
            return False
        self.long_running += 1  # the scheduler admits it unless its blocks are short
        return True

    def lets_others_pass(self, req: Request) -> bool:
        # its TTFT deadline put it before requests of less work; overdue ones keep the aging order
        return req.ttft_deadline is not None and not self.overdue(req)

    def pick_victim(self, running: list[Request]) -> Request:
        def cost(i: int) -> tuple:
            r = running[i]
            return (r.num_computed_tokens / max(1, r.expected_work - r.num_tokens), -i)

        return running[min(range(len(running)), key=cost)]

    def on_finished(self, req: Request, completed: bool) -> None:
        self.num_short -= req.is_short
        if completed:
            self.estimator.observe(req.num_prompt_tokens, req.num_output_tokens)


POLICIES: dict[str, type[SchedulingPolicy]] = {
    "fcfs": SchedulingPolicy,
    "priority": PriorityPolicy,
    "length_aware": LengthAwarePolicy,
}
