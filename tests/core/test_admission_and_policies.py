"""core/admission.py (can a request ever run) and core/policies.py (queue order, victims)."""

import pytest

from pagedserve.config import SchedulerConfig
from pagedserve.core.admission import check_fits, kv_blocks_needed
from pagedserve.core.policies import POLICIES, FCFSQueue, PriorityQueue
from pagedserve.core.request import Request
from pagedserve.errors import InvalidRequestError
from pagedserve.sampling_params import SamplingParams


def test_blocks_needed_never_counts_the_last_sampled_token():
    assert kv_blocks_needed(16, 1, 16) == 1  # 16 prompt + 1 sampled: the sample is never written
    assert kv_blocks_needed(16, 2, 16) == 2
    assert kv_blocks_needed(1, 0, 16) == 1  # prompt logprobs only


@pytest.mark.parametrize(
    "args,param,match",
    [
        ((0, 5, 100, 16, None), "prompt", "at least one token"),
        ((90, 11, 100, 16, None), "max_tokens", "needs 101"),
        ((10, 50, 100, 16, 3), "max_tokens", "needs up to 4 KV blocks"),
    ],
)
def test_check_fits_refuses_with_the_param(args, param, match):
    with pytest.raises(InvalidRequestError, match=match) as e:
        check_fits(*args)
    assert e.value.param == param


def test_check_fits_accepts_the_limits_exactly():
    check_fits(90, 10, 100, 16, None)
    check_fits(10, 39, 100, 16, 3)  # 48 tokens written: exactly 3 blocks


def req(rid, priority=0, arrival=1.0):
    return Request(rid, [1, 2], SamplingParams(), arrival_time=arrival, priority=priority)


def test_fcfs_order_and_preempted_back_to_the_front():
    q = FCFSQueue()
    a, b, c = req("a"), req("b"), req("c")
    for r in (a, b):
        q.add(r)
    q.prepend(c)
    assert [r.request_id for r in q] == ["c", "a", "b"] == [r.request_id for r in q.unordered()]
    assert q.pop() is c and q.peek() is a
    q.remove(b)
    assert len(q) == 1
    assert POLICIES["fcfs"](SchedulerConfig()).pick_victim([a, b, c]) is c  # the latest admitted


def test_priority_order_then_arrival():
    q = PriorityQueue()
    rs = [req("late_high", 0, 3.0), req("low", 5, 1.0), req("early_high", 0, 2.0)]
    for r in rs:
        q.add(r)
    assert [r.request_id for r in q] == ["early_high", "late_high", "low"]
    assert sorted(r.request_id for r in q.unordered()) == ["early_high", "late_high", "low"]
    assert q.pop().request_id == "early_high"
    q.remove(rs[1])
    assert [r.request_id for r in q] == ["late_high"]
    assert POLICIES["priority"](SchedulerConfig()).pick_victim(rs).request_id == "low"
