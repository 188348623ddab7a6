"""Wall-clock samples of a callable, for the benchmarks that time one operation (a forward
step, a kernel, a product): `warmup` calls untimed, then one `time.perf_counter` interval per
call. Callers reduce the samples as their figure needs (median, best, mean)."""

from __future__ import annotations

import time
from collections.abc import Callable


def sample_times(fn: Callable[[], object], n: int, warmup: int = 1) -> list[float]:
    """Seconds of each of n calls of fn, after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times
