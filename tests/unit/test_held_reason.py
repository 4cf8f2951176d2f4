"""What a range names as holding its watermark below its input (``WatermarkReport.held``,
shown by ``millwheel watermark --why`` as held_by's rule 5): its earliest holding timer,
else its oldest production not yet acked, from what the range keeps in memory."""

from __future__ import annotations

from millwheel.clock import ManualClock
from millwheel.computation import Computation, Context
from millwheel.record import Record, TimeDomain, Timer
from millwheel.runtime.range_worker import HELD_REASON_CHARS, RangeWorker
from millwheel.runtime.routing import Router
from millwheel.sensors import CountingSensors
from millwheel.state.sqlite_store import SQLiteStore
from millwheel.timers import TimerQueue
from millwheel.topology import CodeRef, ComputationSpec, InjectorSpec, InputSpec, Options, Topology
from services.worker.units import OwnedRange

T0 = 1_767_225_600_000_000  # 2026-01-01T00:00:00Z
HOUR = 3_600_000_000


class EchoAndRemind(Computation):
    """Forwards each record and sets an event-time timer an hour after it (tag 'remind'),
    and a garbage-collection timer earlier that does not hold the watermark."""

    def process_record(self, ctx: Context, record: Record) -> None:
        ctx.produce("out", ctx.key, record.value, record.timestamp)
        ctx.set_timer("remind", record.timestamp + HOUR)
        ctx.set_timer("gc", record.timestamp + 1, hold=False)
        ctx.set_timer("tick", 0, TimeDomain.PROCESSING)

    def process_timer(self, ctx: Context, timer: Timer) -> None:
        pass


def make(store: SQLiteStore) -> RangeWorker:
    spec = ComputationSpec("c", (InputSpec("in"),), ("out",), CodeRef("x:Y"), Options(key_ranges=1))
    down = ComputationSpec("d", (InputSpec("out"),), (), CodeRef("x:Y"), Options(key_ranges=1))
    topo = Topology((spec, down), (InjectorSpec("i", "in"),))
    return RangeWorker(spec, 0, store, EchoAndRemind(), Router(topo), ManualClock(1_000), CountingSensors())


def test_nothing_pending_names_nothing(sqlite_store: SQLiteStore) -> None:
    assert make(sqlite_store).held_reason() == ""


def test_the_oldest_production_then_the_earliest_timer_are_named(sqlite_store: SQLiteStore) -> None:
    rw = make(sqlite_store)
    rw.commit(rw.process_records([Record("k7", b"a", T0 + 5, "r1"), Record("k3", b"b", T0 + 9, "r2")],
                                 input_watermark=T0))
    assert rw.held_reason() == ("production at 2026-01-01T00:00:00.000Z for key 'k7' on stream 'out' "
                                "not yet acked by 'd'")
    rw.outbox.ack(rw.token, [("d", p.record.record_id) for p in rw.outbox.pending(10)])
    # The timers of both keys hold it; the earlier one (k7's) is named; "gc" holds nothing.
    assert rw.held_reason() == "timer at 2026-01-01T01:00:00.000Z for key 'k7' (tag 'remind') not yet fired"
    assert rw.hold() == T0 + 5 + HOUR


def test_a_timer_older_than_every_production_is_named_first(sqlite_store: SQLiteStore) -> None:
    rw = make(sqlite_store)
    rw.timers.set(Timer("early", "t", T0 - HOUR))
    rw.commit(rw.process_records([Record("k", b"", T0, "r1")], input_watermark=T0))
    assert rw.held_reason().startswith("timer at 2025-12-31T23:00:00.000Z for key 'early' (tag 't')")


def test_a_long_key_is_cut_and_the_reason_bounded(sqlite_store: SQLiteStore) -> None:
    rw = make(sqlite_store)
    rw.timers.set(Timer("x" * 5000, "y" * 5000, T0))
    said = rw.held_reason()
    assert len(said) <= HELD_REASON_CHARS and said.startswith("timer at 2026-01-01T00:00:00.000Z for key 'xxx")
    assert "…" in said


def test_the_timer_queue_names_the_timer_at_its_hold() -> None:
    q = TimerQueue([Timer("b", "t", 20), Timer("a", "t", 20), Timer("c", "gc", 5, hold=False)])
    assert q.holding() == Timer("a", "t", 20)
    q.clear("a", "t")
    assert q.holding() == Timer("b", "t", 20)
    q.set(Timer("b", "t", 30))  # moved: its old heap entry is stale
    assert q.holding() == Timer("b", "t", 30) and q.hold() == 30
    q.clear("b", "t")
    assert q.holding() is None


def test_a_range_reports_a_reason_only_while_below_its_input(sqlite_store: SQLiteStore) -> None:
    rw = make(sqlite_store)
    owned = OwnedRange("c", 0, rw.token, sqlite_store, worker=rw)
    with owned.lock:
        rw.commit(rw.process_records([Record("k7", b"", T0, "r1")], input_watermark=T0))
        rw.outbox.ack(rw.token, [("d", p.record.record_id) for p in rw.outbox.pending(10)])
        owned.changed()
    assert owned.report_nowait(T0 + 10) == T0 + 10 and owned.held == ""  # the timer is ahead of its input
    assert owned.report_nowait(T0 + 2 * HOUR) == T0 + HOUR
    assert owned.held == "timer at 2026-01-01T01:00:00.000Z for key 'k7' (tag 'remind') not yet fired"
