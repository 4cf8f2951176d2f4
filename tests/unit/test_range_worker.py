"""The checkpoint sequence of one key range, step by step, on a manual clock."""

import json

import pytest

from millwheel.clock import ManualClock
from millwheel.computation import Computation, Context
from millwheel.errors import FencedError, UserCodeError
from millwheel.record import Record, TimeDomain, Timer
from millwheel.runtime.crash import CrashSchedule, SimulatedCrash
from millwheel.runtime.range_worker import RangeWorker
from millwheel.runtime.routing import Router
from millwheel.sensors import CountingSensors
from millwheel.state.sqlite_store import SQLiteStore
from millwheel.topology import CodeRef, ComputationSpec, InjectorSpec, InputSpec, LatePolicy, Options, Topology


class Counter(Computation):
    """Counts records per key; a processing-time timer 10 µs later emits the count."""

    def process_record(self, ctx: Context, record: Record) -> None:
        n = int(ctx.state or b"0") + 1
        ctx.set_state(str(n).encode())
        ctx.set_timer("flush", ctx.processing_time + 10, TimeDomain.PROCESSING)
        ctx.set_timer("window", record.timestamp)
        if ctx.is_late:
            ctx.produce("out", ctx.key, b"late", record.timestamp)

    def process_timer(self, ctx: Context, timer: Timer) -> None:
        ctx.produce("out", ctx.key, json.dumps({"tag": timer.tag, "n": int(ctx.state or b"0")}).encode(), timer.time)


class Boom(Computation):
    def process_record(self, ctx: Context, record: Record) -> None:
        raise ValueError("bad input")


def make(
    store: SQLiteStore, code: Computation, options: Options | None = None, clock: ManualClock | None = None, crash=None
) -> tuple[RangeWorker, CountingSensors]:  # type: ignore[no-untyped-def]
    options = options or Options(key_ranges=1)
    spec = ComputationSpec("c", (InputSpec("in"),), ("out",), CodeRef("x:Y"), options)
    topo = Topology((spec,), (InjectorSpec("i", "in"),))
    sensors = CountingSensors()
    kwargs = {"crash": crash} if crash else {}
    worker = RangeWorker(spec, 0, store, code, Router(topo), clock or ManualClock(1_000), sensors, **kwargs)
    return worker, sensors


def rec(i: int, key: str = "k", ts: int = 100) -> Record:
    return Record(key, b"", ts, f"r{i}")


def test_a_batch_is_one_checkpoint_and_duplicates_are_dropped(sqlite_store: SQLiteStore) -> None:
    worker, sensors = make(sqlite_store, Counter())
    txn = worker.process_records([rec(1), rec(2), rec(2), rec(3, "j")], input_watermark=0)
    assert sqlite_store.read_state("c", ["k"]) == {}  # nothing durable before commit
    worker.commit(txn)
    assert sensors.counts["checkpoints:c"] == 1
    assert sqlite_store.read_state("c", ["k", "j"]) == {"k": b"2", "j": b"1"}
    worker.commit(worker.process_records([rec(1), rec(3, "j"), rec(4)], input_watermark=0))
    assert sqlite_store.read_state("c", ["k", "j"]) == {"k": b"3", "j": b"1"}
    assert sensors.counts["duplicates:c"] == 3


def test_timers_are_durable_fire_once_and_productions_wait_in_the_outbox(sqlite_store: SQLiteStore) -> None:
    clock = ManualClock(1_000)
    worker, _ = make(sqlite_store, Counter(), clock=clock)
    worker.commit(worker.process_records([rec(1, ts=500)], input_watermark=0))
    assert {t.tag for t in sqlite_store.read_timers("c", 0)} == {"flush", "window"}
    assert worker.hold() == 500  # the event-time timer holds the output watermark
    assert worker.fire_timers(input_watermark=500) is None  # watermark not past 500 yet
    txn = worker.fire_timers(input_watermark=501)
    assert txn is not None
    worker.commit(txn)
    assert [t.tag for t in sqlite_store.read_timers("c", 0)] == ["flush"]
    clock.advance(10)
    txn = worker.fire_timers(input_watermark=501)
    assert txn is not None
    worker.commit(txn)
    assert sqlite_store.read_timers("c", 0) == []
    pending = sqlite_store.read_outbox("c", 0)
    assert [json.loads(p.record.value)["tag"] for p in pending] == ["window", "flush"]
    assert [p.consumer for p in pending] == ["log:out", "log:out"]
    worker.outbox.ack(worker.token, [(p.consumer, p.record.record_id) for p in pending])
    assert sqlite_store.read_outbox("c", 0) == [] and worker.hold() > 10**15


def test_a_new_owner_fences_the_old_one_and_sees_only_committed_work(sqlite_store: SQLiteStore) -> None:
    old, _ = make(sqlite_store, Counter())
    old.commit(old.process_records([rec(1)], input_watermark=0))
    txn = old.process_records([rec(2)], input_watermark=0)
    new, _ = make(sqlite_store, Counter())  # takes the range: token bumped
    with pytest.raises(FencedError, match="lost the range"):
        old.commit(txn)
    assert sqlite_store.read_state("c", ["k"]) == {"k": b"1"}
    new.commit(new.process_records([rec(2)], input_watermark=0))
    assert sqlite_store.read_state("c", ["k"]) == {"k": b"2"}


def test_crash_before_checkpoint_leaves_nothing_and_retry_is_exact(sqlite_store: SQLiteStore) -> None:
    worker, _ = make(sqlite_store, Counter(), crash=CrashSchedule("after_user_code", 1))
    with pytest.raises(SimulatedCrash):
        worker.process_records([rec(1), rec(2)], input_watermark=0)
    assert sqlite_store.read_state("c", ["k"]) == {} and sqlite_store.read_timers("c", 0) == []
    retry, _ = make(sqlite_store, Counter())
    retry.commit(retry.process_records([rec(1), rec(2)], input_watermark=0))
    assert sqlite_store.read_state("c", ["k"]) == {"k": b"2"}


@pytest.mark.parametrize(
    "policy,expect_state,expect_out",
    [
        (LatePolicy.PROCESS, b"1", [b"late"]),
        (LatePolicy.DROP, None, []),
        (LatePolicy.ROUTE, None, [b""]),
    ],
)
def test_late_data_policy(
    sqlite_store: SQLiteStore, policy: LatePolicy, expect_state: bytes | None, expect_out: list[bytes]
) -> None:
    options = Options(key_ranges=1, late_policy=policy, late_stream="late" if policy is LatePolicy.ROUTE else None)
    worker, sensors = make(sqlite_store, Counter(), options)
    worker.commit(worker.process_records([rec(1, ts=50)], input_watermark=100))
    assert sqlite_store.read_state("c", ["k"]).get("k") == expect_state
    assert [p.record.value for p in sqlite_store.read_outbox("c", 0)] == expect_out
    if policy is LatePolicy.DROP:
        assert sensors.counts["late_drop:c"] == 1
    if policy is LatePolicy.ROUTE:
        assert [p.stream for p in sqlite_store.read_outbox("c", 0)] == ["late"]


def test_allowed_lateness_lets_slightly_late_records_through(sqlite_store: SQLiteStore) -> None:
    options = Options(key_ranges=1, late_policy=LatePolicy.DROP, allowed_lateness_us=60)
    worker, _ = make(sqlite_store, Counter(), options)
    worker.commit(worker.process_records([rec(1, ts=50), rec(2, ts=30)], input_watermark=100))
    assert sqlite_store.read_state("c", ["k"]) == {"k": b"1"}  # 50 within lateness, 30 beyond


def test_user_code_errors_name_computation_key_and_record(sqlite_store: SQLiteStore) -> None:
    worker, _ = make(sqlite_store, Boom())
    with pytest.raises(UserCodeError, match=r"computation 'c' failed on key 'k' record r7: ValueError: bad input"):
        worker.process_records([rec(7)], input_watermark=0)


def test_at_least_once_skips_dedup(sqlite_store: SQLiteStore) -> None:
    worker, _ = make(sqlite_store, Counter(), Options(key_ranges=1, exactly_once=False))
    worker.commit(worker.process_records([rec(1)], input_watermark=0))
    worker.commit(worker.process_records([rec(1)], input_watermark=0))
    assert sqlite_store.read_state("c", ["k"]) == {"k": b"2"}
    assert list(sqlite_store.iter_ids("c", 0)) == []


def test_record_ids_expire_after_the_retention_window(sqlite_store: SQLiteStore) -> None:
    clock = ManualClock(1_000_000)
    options = Options(key_ranges=1, record_id_retention_us=100_000_000)
    worker, _ = make(sqlite_store, Counter(), options, clock=clock)
    worker.commit(worker.process_records([rec(1)], input_watermark=0))
    clock.advance(50_000_000)
    worker.commit(worker.process_records([rec(2)], input_watermark=0))
    assert worker.expire_record_ids(every_us=0) == 0  # both inside the window
    clock.advance(60_000_000)  # r1 is 110 s old, r2 60 s
    assert worker.expire_record_ids(every_us=0) == 1
    assert sorted(sqlite_store.iter_ids("c", 0)) == ["r2"]
    assert worker.dedup is not None and worker.dedup.seen(["r1", "r2"]) == {"r2"}


class FarTimer(Computation):
    """Sets a timer beyond what the store can keep (an int64)."""

    def process_record(self, ctx: Context, record: Record) -> None:
        ctx.set_timer("far", 10**30)


def test_a_timer_outside_int64_fails_its_record_not_every_checkpoint(sqlite_store: SQLiteStore) -> None:
    """Before, the timer went into the batch and the store refused every checkpoint of
    the range ("Python int too large to convert to SQLite INTEGER")."""
    worker, _ = make(sqlite_store, FarTimer())
    with pytest.raises(UserCodeError, match=r"timer 'far' time 10{30} is outside the int64 range"):
        worker.process_records([rec(1)], input_watermark=0)
    txn = make(sqlite_store, Counter())[0].process_records([rec(2)], input_watermark=0)
    assert txn.timer_ops  # an ordinary timer still goes through
