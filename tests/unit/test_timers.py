from millwheel.record import MAX_TIMESTAMP, TimeDomain, Timer
from millwheel.timers import TimerQueue


def test_event_timers_fire_in_timestamp_order_once_the_watermark_passes() -> None:
    q = TimerQueue([Timer("k1", "a", 30), Timer("k2", "b", 10), Timer("k1", "c", 20)])
    assert q.pop_due_event(10) is None  # watermark must be past the time
    fired = []
    while (t := q.pop_due_event(31)) is not None:
        fired.append((t.time, t.key, t.tag))
    assert fired == [(10, "k2", "b"), (20, "k1", "c"), (30, "k1", "a")]
    assert len(q) == 0


def test_setting_a_timer_again_moves_it_and_clearing_removes_it() -> None:
    q = TimerQueue()
    q.set(Timer("k", "t", 100))
    q.set(Timer("k", "t", 5))
    assert q.hold() == 5
    t = q.pop_due_event(6)
    assert t is not None and t.time == 5
    assert q.pop_due_event(1000) is None  # the old position (100) is gone too
    q.set(Timer("k", "u", 50))
    q.clear("k", "u")
    assert q.pop_due_event(1000) is None and q.hold() == MAX_TIMESTAMP


def test_hold_ignores_non_holding_and_processing_timers() -> None:
    q = TimerQueue([
        Timer("k", "gc", 5, hold=False),
        Timer("k", "p", 1, TimeDomain.PROCESSING),
        Timer("k", "end", 40),
    ])
    assert q.hold() == 40
    assert q.pop_due_processing(0) is None
    p = q.pop_due_processing(1)
    assert p is not None and p.tag == "p"
    gc = q.pop_due_event(6)
    assert gc is not None and gc.tag == "gc"
