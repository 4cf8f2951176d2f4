"""Stream-log retention's options and policy (millwheel/runtime/retention.py): bounds
refused like every other option, which limits a logged stream gets, and local mode
trimming its own sinks. (Trimming on every backend: tests/contract; in a running
service: tests/integration/test_service_log_retention.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from millwheel.clock import ManualClock
from millwheel.errors import InvalidSpecError
from millwheel.keys import KeyExtractor
from millwheel.record import Record
from millwheel.runtime.local_runner import LocalRunner
from millwheel.runtime.retention import META_PREFIX, Retention, retention_of
from millwheel.sources import ListSource
from millwheel.spec import computation_from_dict, computation_to_dict
from millwheel.state import open_store
from millwheel.topology import (
    DEFAULT_LOG_RETENTION_BYTES,
    DEFAULT_LOG_RETENTION_US,
    CodeRef,
    ComputationSpec,
    ErrorPolicy,
    InjectorSpec,
    InputSpec,
    Options,
    Topology,
)
from services.rpc.convert import spec_from_proto, spec_to_proto

S = 1_000_000


def spec(name: str = "c", **options: object) -> dict[str, object]:
    return {"name": name, "inputs": ["in"], "outputs": ["out"], "code": {"name": "filter", "params": {"expr": "True"}},
            "options": options}


@pytest.mark.parametrize("field,bad", [
    ("log_retention_us", 999_999), ("log_retention_us", -1), ("log_retention_us", 1 << 63),
    ("log_retention_us", True), ("log_retention_us", "1d"), ("log_retention_us", 1.5e6),
    ("log_retention_bytes", 1023), ("log_retention_bytes", (1 << 50) + 1), ("log_retention_bytes", False),
])
def test_out_of_range_retentions_are_refused_naming_the_option(field: str, bad: object) -> None:
    with pytest.raises(InvalidSpecError, match=field):
        computation_from_dict(spec(**{field: bad}))


def test_retention_options_round_trip_through_files_and_the_wire() -> None:
    assert computation_from_dict(spec()).options.log_retention_us == DEFAULT_LOG_RETENTION_US
    assert computation_from_dict(spec()).options.log_retention_bytes == DEFAULT_LOG_RETENTION_BYTES
    for us, size in ((0, 0), (S, 1024), (7 * 86_400 * S, 1 << 50)):
        parsed = computation_from_dict(spec(log_retention_us=us, log_retention_bytes=size))
        assert computation_from_dict(computation_to_dict(parsed)) == parsed
        assert spec_from_proto(spec_to_proto(parsed)) == parsed
        assert (parsed.options.log_retention_us, parsed.options.log_retention_bytes) == (us, size)


def test_a_logged_stream_keeps_what_its_most_demanding_writer_asks_for() -> None:
    def comp(name: str, inp: str, out: str, us: int, size: int) -> ComputationSpec:
        return ComputationSpec(name, (InputSpec(inp, KeyExtractor("key")),), (out,),
                               CodeRef("filter", {"expr": "True"}),
                               Options(log_retention_us=us, log_retention_bytes=size))

    topology = Topology(
        (comp("a", "in", "shared", 10 * S, 0), comp("b", "in", "shared", 20 * S, 4096),
         comp("c", "in", "mid", 5 * S, 2048), comp("d", "mid", "last", 30 * S, 8192)),
        (InjectorSpec("in", "in"), InjectorSpec("raw", "raw_sink")), log_streams=("mid",))
    got = retention_of(topology)
    assert got["shared"] == Retention(20 * S, 0)  # the longest age, and 0 (no limit) beats any size
    assert got["mid"] == Retention(5 * S, 2048)  # logged although consumed: its writer's
    assert got["last"] == Retention(30 * S, 8192)
    assert got["c.dead_letters"] == Retention(5 * S, 2048)  # the dead letters: their computation's
    assert got["raw_sink"] == Retention()  # written by an injector only: the defaults
    assert "in" not in got  # consumed and not in log_streams: not logged
    no_dead_letters = comp("e", "in", "e_out", S, 1024)
    skip = Topology((ComputationSpec(no_dead_letters.name, no_dead_letters.inputs, no_dead_letters.outputs,
                                     no_dead_letters.code, Options(on_error=ErrorPolicy.SKIP)),),
                    (InjectorSpec("in", "in"),))
    assert set(retention_of(skip)) == {"e_out"}


def test_local_mode_trims_its_sinks_and_keeps_its_marks(tmp_path: Path) -> None:
    store = open_store(f"sqlite:///{tmp_path}/local.db")
    clock = ManualClock(1_000 * S)
    topology = Topology(
        (ComputationSpec("echo", (InputSpec("in"),), ("out",), CodeRef("filter", {"expr": "True"}),
                         Options(key_ranges=2, log_retention_us=S)),),
        (InjectorSpec("in", "in"),))
    records = [Record(f"k{i % 3}", f"v{i}".encode(), 1_000 * S + i, f"r{i}") for i in range(50)]
    runner = LocalRunner(topology, store, {"in": ListSource(records)}, clock=clock)
    runner.run()
    assert len(store.read_log("out", 0, 100)) == 50
    clock.advance(S)
    runner.step()  # a pass a second: measures the 50 records, seen now
    assert store.log_start("out") == 0
    clock.advance(S - 1)
    runner.step()
    assert store.log_start("out") == 0  # a second after they were seen: not yet
    clock.advance(1)
    runner.step()
    assert store.read_log("out", 0, 100) == [] and store.log_start("out") > 0
    runner.run()
    assert store.get_meta(META_PREFIX + "out") is not None  # the next run resumes from the marks
    store.close()
