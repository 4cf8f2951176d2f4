"""One connector's trouble is that connector's alone (issue 34, items 2, 3 and 9).

The worker's connectors part (services/worker/connectors.py) is constructed alone over a
real SQLite store, as the worker process constructs it; no gRPC, no controller:

* a sink no worker can build (its connector refuses its settings) is refused at
  registration already; one given to a worker all the same (a registry written before
  the check) leaves the heartbeat's ``keep`` answering and the sinks given with it
  taken, and shows as down;
* a sink whose connector raises an error it does not map is retried with back-off and
  shown as down, with one traceback in the log, not one per retry;
* a source its connector cannot read (a Redis key that is not a stream raised WRONGTYPE)
  is its injector range's failure, reported and backed off, and the sources after it
  on the same worker go on reading.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from millwheel.connectors.pulled import PulledSource
from millwheel.connectors.spec import ConnectorSpec, SinkSpec, SourcePaths, sinks_from_list
from millwheel.errors import InvalidSpecError
from millwheel.nodes import injector_node, sink_node
from millwheel.record import Record
from millwheel.runtime.injector import CURSOR_KEY
from millwheel.runtime.routing import Router
from millwheel.runtime.sink_runner import SinkRunner
from millwheel.state.url import open_store
from millwheel.topology import InjectorSpec, Topology
from services.metrics import PrometheusSensors
from services.worker import connectors as connectors_module
from services.worker.connectors import Connectors
from services.worker.failing import RangeFailures
from services.worker.shared import Shared
from services.worker.units import OwnedRange


def postgres(name: str, table: str) -> SinkSpec:
    settings = {"type": "postgres", "url": "postgresql://127.0.0.1:1/none", "table": table}
    return SinkSpec(name, "counts", ConnectorSpec("postgres", json.dumps(settings, sort_keys=True)))


@pytest.fixture
def connectors(tmp_path: Path) -> Iterator[Connectors]:
    store = open_store(f"sqlite:///{tmp_path}/s.db")
    stopped = threading.Event()
    c = Connectors(Shared(), store, PrometheusSensors("worker"), stopped, batch_size=100,
                   max_injector_outbox=1000, fenced=lambda _o, _e: None, report_fenced=lambda _e: None,
                   failures=RangeFailures(), source_paths=SourcePaths.parse([str(tmp_path)]))  # its files source's
    try:
        yield c
    finally:
        stopped.set()
        for t in c.threads:
            t.join(10)
        store.close()


@pytest.mark.parametrize("table", ["a.b.c", ".x", "s.", "x" * 64])
def test_a_sink_table_no_worker_could_write_is_refused_at_registration(table: str) -> None:
    with pytest.raises(InvalidSpecError, match="expected NAME or SCHEMA.NAME"):
        sinks_from_list([{"stream": "counts", "type": "postgres", "url": "postgresql://h/db", "table": table}])
    assert sinks_from_list([{"stream": "counts", "type": "postgres", "url": "postgresql://h/db",
                             "table": "public.counts"}])  # a good one still passes


def test_a_sink_that_cannot_be_built_stops_nothing_else(connectors: Connectors,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    bad, good = postgres("bad", "a.b.c"), postgres("good", "public.counts")
    connectors.shared.topology = Topology(sinks=(bad, good))
    mine = {(sink_node("bad"), 0): 3, (sink_node("good"), 0): 4}
    with caplog.at_level(logging.ERROR, logger="millwheel.worker"):
        for _ in range(5):  # heartbeat after heartbeat: each answered, the bad one logged once
            connectors.keep(mine, set())
    assert set(connectors.sinks) == {(sink_node("good"), 0)}  # given with it, taken
    assert "bad" in connectors.down()
    assert sum("cannot be built here" in r.getMessage() for r in caplog.records) == 1
    connectors.keep({(sink_node("good"), 0): 4}, set())  # the bad one moved away: forgotten
    assert "bad" not in connectors.down()


class Exploding:
    """A sink connector that raises what no connector maps (a library's own error)."""

    def __init__(self) -> None:
        self.opens = 0

    def open(self, sink: str, range_id: int, token: int) -> int:
        self.opens += 1
        raise ValueError("the library broke")

    def write_batch(self, entries: list[tuple[int, Record]], token: int) -> int:
        raise AssertionError("never opened")

    def close(self) -> None:
        pass


def test_an_unmapped_sink_error_is_backed_off_and_shown_down(connectors: Connectors,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    spec = postgres("boom", "public.counts")
    exploding = Exploding()
    runner = SinkRunner(spec, connectors.store, 1, connector=exploding)  # type: ignore[arg-type]
    with caplog.at_level(logging.ERROR, logger="millwheel.worker"):
        with connectors._sinks_lock:
            connectors.sinks[(sink_node("boom"), 0)] = runner
        time.sleep(1.5)
    # Without a back-off the loop retried every 20 ms: ~75 opens and as many tracebacks.
    assert 2 <= exploding.opens <= 12
    assert "boom" in connectors.down()
    tracebacks: list[Any] = [r for r in caplog.records if "sink sink:boom failed" in r.getMessage()]
    assert len(tracebacks) == 1 and tracebacks[0].exc_info is not None


class WrongType:
    """A source connector whose reads fail as redis-py's do on a key that is not a
    stream: an error no connector maps."""

    def open(self, position: str | None) -> None:
        pass

    def read_batch(self, max_entries: int, wait_s: float) -> list[Any]:
        raise ValueError("WRONGTYPE Operation against a key holding the wrong kind of value")

    def record_id(self, entry: Any) -> str:
        raise AssertionError("nothing read")

    def finished(self) -> bool:
        return False

    def close(self) -> None:
        pass


def test_a_source_that_cannot_be_read_stops_no_other_source(connectors: Connectors, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    events = tmp_path / "in.jsonl"
    events.write_text("".join(json.dumps({"key": f"k{i}", "value": i, "timestamp": 1_000 * i}) + "\n"
                              for i in range(20)))
    files = ConnectorSpec("files", json.dumps({"type": "files", "path": str(events)}))
    redis = ConnectorSpec("redis-stream", json.dumps({"type": "redis-stream", "url": "redis://h/0", "stream": "s"}))
    bad, good = InjectorSpec("bad", "ev_bad", redis), InjectorSpec("good", "ev_good", files)
    real_open = connectors_module.open_source

    def open_source(name: str, settings: dict[str, Any], clock: Any, base: str = ".") -> PulledSource:
        if name == "bad":
            return PulledSource(name, WrongType(), settings, clock)  # type: ignore[arg-type]
        return real_open(name, settings, clock, base)

    monkeypatch.setattr(connectors_module, "open_source", open_source)
    shared, store = connectors.shared, connectors.store
    shared.topology = Topology(injectors=(bad, good))
    shared.router = Router(shared.topology)
    for spec in (bad, good):  # the bad one first: it used to end every pass before the good one
        node = injector_node(spec.name)
        shared.units[(node, 0)] = OwnedRange(node, 0, store.acquire(node, 0), store)
    deadline = time.monotonic() + 30
    while not store.read_state(injector_node("good"), [CURSOR_KEY]):
        assert time.monotonic() < deadline, "the good source was never read"
        time.sleep(0.05)
    time.sleep(1.0)
    failure = connectors.failures.get((injector_node("bad"), 0))
    assert failure is not None and failure.stage == "source" and "WRONGTYPE" in failure.message
    assert failure.attempts <= 6  # backed off (every 20 ms before)
    assert [r.node for r in connectors.failures.reports()] == [injector_node("bad")]  # what the heartbeat tells
