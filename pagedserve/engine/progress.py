"""Forward progress of an engine core, as its front end sees it: a stall is requests in
flight and no message from the core (one arrives per step) for longer than
max(timeout, 4 x the longest step seen). The bar adapts upward once long legitimate
steps (big prefill chunks) have been seen, so they do not trip it; until then the
timeout alone (30 s by default, generous) decides. Pure bookkeeping over a clock the
caller passes, so it is tested with made-up times.
"""

from __future__ import annotations

STEP_FACTOR = 4.0


class ProgressWatch:
    def __init__(self, timeout_s: float, now: float) -> None:
        self.timeout_s = timeout_s
        self.last = now  # the last message, or when work began
        self.longest_step = 0.0
        self.stalled_for: float | None = None  # the quiet time when a stall was last reported

    def work_begins(self, now: float) -> None:
        """The first request after an idle period: progress is measured from here."""
        self.last = now

    def message(self, now: float, busy: bool) -> bool:
        """A message from the core; True if it ends a stall."""
        ended = self.stalled_for is not None
        if busy and not ended:
            self.longest_step = max(self.longest_step, now - self.last)
        self.last, self.stalled_for = now, None
        return ended

    @property
    def limit(self) -> float:
        return max(self.timeout_s, STEP_FACTOR * self.longest_step)

    def quiet(self, now: float, busy: bool) -> float | None:
        """Seconds without progress if that is a stall now (None: no stall)."""
        if not busy:
            return None
        q = now - self.last
        return q if q > self.limit else None
