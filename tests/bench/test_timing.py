"""pagedserve.bench.timing: the benchmarks' one sampling loop."""

import time

from pagedserve.bench.timing import sample_times


def test_warmup_calls_are_untimed_and_every_timed_call_is_one_sample():
    calls = []

    def fn():
        calls.append(len(calls))
        time.sleep(0.02 if len(calls) > 2 else 0)  # the two warm-up calls return at once

    times = sample_times(fn, 3, warmup=2)
    assert len(calls) == 5 and len(times) == 3
    assert all(t >= 0.02 for t in times)
