"""Per-key state TTL (Options.state_ttl_us) on a manual clock: the expiry is a durable
timer checkpointed with the state, fires without user code, deletes only the state,
never early, survives a restart, and holds no watermark."""

from __future__ import annotations

import pytest

from millwheel.clock import ManualClock
from millwheel.computation import Computation, Context
from millwheel.errors import InvalidSpecError
from millwheel.record import MAX_TIMESTAMP, Record, TimeDomain, Timer
from millwheel.runtime.range_worker import RangeWorker
from millwheel.runtime.routing import Router
from millwheel.runtime.ttl import TTL_TAG
from millwheel.sensors import CountingSensors
from millwheel.spec import computation_from_dict, computation_to_dict
from millwheel.state.sqlite_store import SQLiteStore
from millwheel.topology import CodeRef, ComputationSpec, InjectorSpec, InputSpec, Options, Topology

TTL = 1_600  # µs; expiry lands TTL + TTL/16 = 1,700 after the write that set it


class Remember(Computation):
    """Keeps the last value per key; value b"forget" deletes it, b"timer" also sets a timer."""

    fired: list[str]

    def __init__(self) -> None:
        self.fired = []

    def process_record(self, ctx: Context, record: Record) -> None:
        ctx.set_state(None if record.value == b"forget" else record.value)
        if record.value == b"timer":
            ctx.set_timer("mine", 10**12, TimeDomain.PROCESSING)

    def process_timer(self, ctx: Context, timer: Timer) -> None:
        self.fired.append(timer.tag)


def make(store: SQLiteStore, clock: ManualClock, code: Remember | None = None,
         ttl: int | None = TTL) -> tuple[RangeWorker, Remember]:
    spec = ComputationSpec("c", (InputSpec("in"),), ("out",), CodeRef("x:Y"),
                           Options(key_ranges=1, state_ttl_us=ttl))
    code = code or Remember()
    worker = RangeWorker(spec, 0, store, code, Router(Topology((spec,), (InjectorSpec("i", "in"),))),
                         clock, CountingSensors(), token=store.acquire("c", 0))
    return worker, code


def put(worker: RangeWorker, key: str, value: bytes, n: list[int] = [0]) -> None:  # noqa: B006
    n[0] += 1
    worker.commit(worker.process_records([Record(key, value, 100, f"r{n[0]}")], input_watermark=0))


def fire(worker: RangeWorker) -> int:
    txn = worker.fire_timers(input_watermark=0)
    if txn is None:
        return 0
    worker.commit(txn)
    return txn.expired


def ttl_timer(store: SQLiteStore, key: str) -> Timer | None:
    return next((t for t in store.read_key_timers("c", key) if t.tag == TTL_TAG), None)


def test_the_expiry_is_checkpointed_with_the_state_and_deletes_only_the_state(sqlite_store: SQLiteStore) -> None:
    clock = ManualClock(10_000)
    worker, code = make(sqlite_store, clock)
    put(worker, "a", b"timer")
    put(worker, "b", b"kept")
    t = ttl_timer(sqlite_store, "a")
    assert t is not None and t.time == 10_000 + TTL + TTL // 16
    assert t.domain is TimeDomain.PROCESSING and not t.hold
    assert worker.hold() == MAX_TIMESTAMP  # an expiry never holds the watermark
    clock.set(10_000 + TTL)  # idle for exactly the TTL: not yet
    assert fire(worker) == 0
    assert sqlite_store.read_state("c", ["a"]) == {"a": b"timer"}
    clock.set(10_000 + TTL + TTL // 16)
    put(worker, "b", b"written-again")  # b was written later: it lives on
    assert fire(worker) == 1
    assert sqlite_store.read_state("c", ["a", "b"]) == {"b": b"written-again"}
    assert code.fired == []  # user code never sees the runtime's timer
    assert [x.tag for x in sqlite_store.read_key_timers("c", "a")] == ["mine"]  # its own timer stays
    assert ttl_timer(sqlite_store, "a") is None


def test_a_write_moves_the_expiry_only_when_due_within_the_ttl(sqlite_store: SQLiteStore) -> None:
    clock = ManualClock(0)
    worker, _ = make(sqlite_store, clock)
    put(worker, "k", b"1")
    first = ttl_timer(sqlite_store, "k")
    assert first is not None
    clock.advance(TTL // 16)  # still due at or after now + TTL: the timer is not rewritten
    txn = worker.process_records([Record("k", b"2", 100, "x1")], input_watermark=0)
    assert (("k", TTL_TAG) not in txn.timer_ops)
    worker.commit(txn)
    clock.advance(1)  # now it would come too soon: moved to now + TTL + TTL/16
    put(worker, "k", b"3")
    moved = ttl_timer(sqlite_store, "k")
    assert moved is not None and moved.time == clock.now_us() + TTL + TTL // 16
    clock.set(first.time)
    assert fire(worker) == 0  # the old expiry is gone with the move
    clock.set(moved.time)
    assert fire(worker) == 1
    assert sqlite_store.read_state("c", ["k"]) == {}


def test_deleting_the_state_clears_its_expiry(sqlite_store: SQLiteStore) -> None:
    clock = ManualClock(0)
    worker, _ = make(sqlite_store, clock)
    put(worker, "k", b"v")
    assert ttl_timer(sqlite_store, "k") is not None
    put(worker, "k", b"forget")
    assert ttl_timer(sqlite_store, "k") is None
    assert sqlite_store.read_state("c", ["k"]) == {}


def test_the_expiry_survives_a_restart(tmp_path: pytest.TempPathFactory) -> None:
    path = f"{tmp_path}/s.db"
    store = SQLiteStore(path)
    clock = ManualClock(5_000)
    worker, _ = make(store, clock)
    put(worker, "k", b"v")
    store.close()
    store = SQLiteStore(path)  # a new owner of the range, after a crash
    try:
        again, _ = make(store, clock)
        clock.set(5_000 + TTL + TTL // 16 - 1)
        assert fire(again) == 0
        clock.advance(1)
        assert fire(again) == 1
        assert store.read_state("c", ["k"]) == {}
    finally:
        store.close()


def test_without_a_ttl_no_expiry_is_written(sqlite_store: SQLiteStore) -> None:
    clock = ManualClock(0)
    worker, _ = make(sqlite_store, clock, ttl=None)
    put(worker, "k", b"v")
    assert sqlite_store.read_key_timers("c", "k") == []
    clock.advance(10**12)
    assert fire(worker) == 0 and sqlite_store.read_state("c", ["k"]) == {"k": b"v"}


def test_user_code_may_not_use_the_runtime_tags(sqlite_store: SQLiteStore) -> None:
    class Sneaky(Remember):
        def process_record(self, ctx: Context, record: Record) -> None:
            ctx.clear_timer(TTL_TAG)

    worker, _ = make(sqlite_store, ManualClock(0), code=Sneaky())
    with pytest.raises(Exception, match="'millwheel:' are the runtime's own"):
        worker.process_records([Record("k", b"v", 100, "r")], input_watermark=0)


@pytest.mark.parametrize("bad", [0, 999, -5, True, 1.5, "1000", 10**30])
def test_bad_ttls_are_refused_at_registration(bad: object) -> None:
    with pytest.raises(InvalidSpecError, match="state_ttl_us"):
        computation_from_dict({"name": "c", "inputs": [{"stream": "in"}], "outputs": [],
                               "code": {"name": "filter", "params": {"expr": "True"}},
                               "options": {"state_ttl_us": bad}})


def test_the_ttl_round_trips_through_spec_files_and_the_wire() -> None:
    from services.rpc.convert import spec_from_proto, spec_to_proto

    spec = computation_from_dict({"name": "c", "inputs": [{"stream": "in"}], "outputs": ["o"],
                                  "code": {"name": "filter", "params": {"expr": "True"}},
                                  "options": {"state_ttl_us": 86_400_000_000}})
    assert spec.options.state_ttl_us == 86_400_000_000
    assert computation_from_dict(computation_to_dict(spec)) == spec
    assert spec_from_proto(spec_to_proto(spec)) == spec
    plain = computation_from_dict({**computation_to_dict(spec), "options": {}})
    assert spec_from_proto(spec_to_proto(plain)).options.state_ttl_us is None
