"""engine/progress.py: a stall is work in flight and no step for max(timeout, 4 x the
longest step seen); long legitimate steps raise the bar; idle is never a stall."""

from pagedserve.engine.progress import ProgressWatch


def test_quiet_past_the_timeout_with_work_is_a_stall_and_a_message_ends_it():
    w = ProgressWatch(timeout_s=30, now=0.0)
    assert w.quiet(100.0, busy=False) is None  # idle for ever: no stall
    w.work_begins(100.0)
    for t in (100.5, 101.0, 101.5):  # 0.5 s steps
        w.message(t, busy=True)
    assert w.quiet(131.0, busy=True) is None  # 29.5 s quiet: under the timeout
    assert w.quiet(132.0, busy=True) == 30.5
    w.stalled_for = 30.5  # reported
    assert w.message(140.0, busy=True) is True  # progress again
    assert w.longest_step == 0.5  # the stall itself is no step
    assert w.quiet(141.0, busy=True) is None


def test_long_steps_raise_the_bar():
    w = ProgressWatch(timeout_s=5, now=0.0)
    w.work_begins(0.0)
    w.message(4.0, busy=True)  # a 4 s prefill chunk: under the 5 s timeout
    assert w.limit == 16.0  # 4 x the longest step
    assert w.quiet(4.0 + 15.0, busy=True) is None  # another such chunk is no stall
    assert w.quiet(4.0 + 17.0, busy=True) == 17.0


def test_work_beginning_after_idle_restarts_the_clock():
    w = ProgressWatch(timeout_s=2, now=0.0)
    w.work_begins(50.0)  # the last message was long ago, while idle
    assert w.quiet(51.0, busy=True) is None
    assert w.quiet(53.0, busy=True) == 3.0
