"""Scheduling policies: the order of the waiting queue, and which running request gives
its blocks back when memory is short.

A queue offers add / prepend (a preempted request goes back to the front of its class) /
peek / pop / remove, `len`, iteration in policy order, and `unordered()` (every request,
cheaply, in no promised order: for views). `pick_victim(running)` names the running
request to preempt: the one the policy would have admitted last.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from pagedserve.core.request import Request


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


@dataclass(frozen=True)
class SchedulingPolicy:
    queue_cls: type
    pick_victim: Callable[[list[Request]], Request]


POLICIES = {
    "fcfs": SchedulingPolicy(FCFSQueue, lambda running: running[-1]),  # the latest admitted
    "priority": SchedulingPolicy(PriorityQueue, lambda running: max(running, key=lambda r: (r.priority, r.arrival_time))),
}
