"""Fan-out addresses one production per consumer (and the log), re-keyed per consumer;
the batch form is the per-record form concatenated."""

from millwheel.keys import KeyExtractor
from millwheel.record import Record
from millwheel.runtime.routing import Router, production
from millwheel.state.protocol import Production
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
