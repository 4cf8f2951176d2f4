"""Fan-out addresses one production per consumer (and the log), re-keyed per consumer;
the batch form is the per-record form concatenated; produce checks what it builds."""

import pytest

from millwheel.clock import ManualClock
from millwheel.computation import Computation, Context
from millwheel.errors import InvalidSpecError, UserCodeError
from millwheel.keys import KeyExtractor
from millwheel.record import Record, derive_record_id, well_formed
from millwheel.runtime.range_worker import RangeWorker
from millwheel.runtime.routing import Router, production
from millwheel.sensors import CountingSensors
from millwheel.state.protocol import Production
from millwheel.state.sqlite_store import SQLiteStore
from millwheel.topology import CodeRef, ComputationSpec, InjectorSpec, InputSpec, Options, Topology


def test_fan_out_many_is_fan_out_of_each_record_in_order() -> None:
    opts = Options(key_ranges=1)
    topo = Topology(
        computations=(
            ComputationSpec("a", (InputSpec("s"),), ("x",), CodeRef("x:Y"), opts),
            ComputationSpec("b", (InputSpec("s", KeyExtractor("json:k")),), ("y",), CodeRef("x:Y"), opts),
        ),
        injectors=(InjectorSpec("i", "s"),),
        log_streams=("s",),
    )
    router = Router(topo)
    records = [Record("k1", b'{"k": "u"}', 1, "r1"), Record("u", b'{"k": "u"}', 2, "r2")]
    many = router.fan_out_many("s", records)
    assert many == [p for r in records for p in router.fan_out("s", r)]
    assert [(p.consumer, p.record.key) for p in many] == [
        ("a", "k1"), ("b", "u"), ("log:s", "k1"), ("a", "u"), ("b", "u"), ("log:s", "u")]
    assert many[3].record is records[1] and many[4].record is records[1]  # key kept: same record
    assert router.fan_out_many("nobody-reads", records) == []


def test_production_helper_builds_the_same_frozen_value() -> None:
    rec = Record("k", b"v", 1, "r")
    p = production("c", "s", rec)
    assert p == Production("c", "s", rec) and hash(p) == hash(Production("c", "s", rec))
    assert type(p) is Production


class _Produces(Computation):
    def __init__(self, value: object, ts: object = 5) -> None:
        self.value, self.ts = value, ts

    def process_record(self, ctx: Context, record: Record) -> None:
        ctx.produce("x", ctx.key, self.value, self.ts)  # type: ignore[arg-type]


@pytest.mark.parametrize("value,ts,message", [
    ("text", 5, "value must be bytes"), (b"ok", True, "timestamp must be integer"),
    (b"ok", 2**63, "out of range"), (b"ok", 5, None),
])
def test_produce_checks_the_record_it_builds(
    sqlite_store: SQLiteStore, value: object, ts: object, message: str | None
) -> None:
    spec = ComputationSpec("a", (InputSpec("s"),), ("x",), CodeRef("x:Y"), Options(key_ranges=1))
    topo = Topology((spec,), (InjectorSpec("i", "s"),))
    worker = RangeWorker(spec, 0, sqlite_store, _Produces(value, ts), Router(topo), ManualClock(1), CountingSensors())
    if message is None:
        txn = worker.process_records([Record("k", b"", 1, "r1")], 0)
        assert [p.record for p in txn.productions] == [Record("k", b"ok", 5, derive_record_id("a", "r1", 0))]
        return
    with pytest.raises(UserCodeError, match=f"production to 'x'.*{message}"):
        worker.process_records([Record("k", b"", 1, "r1")], 0)


@pytest.mark.parametrize("fields", [
    ("k", b"v", 1, "r"), ("", b"", -(2**62), "r"), (1, b"v", 1, "r"), ("k", "v", 1, "r"), ("k", b"v", True, "r"),
    ("k", b"v", 1.0, "r"), ("k", b"v", 2**62 + 1, "r"), ("k", b"v", 1, ""), ("k", bytearray(b"v"), 1, "r"),
])
def test_well_formed_agrees_with_validate(fields: tuple[object, object, object, object]) -> None:
    try:
        Record(*fields).validate()  # type: ignore[arg-type]
        valid = True
    except InvalidSpecError:
        valid = False
    assert well_formed(*fields) == valid
