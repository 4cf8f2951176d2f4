"""One sink's trouble is that sink's alone (issue 34, items 3 and 9).

The worker's connectors part (services/worker/connectors.py) is constructed alone over a
real SQLite store, as the worker process constructs it; no gRPC, no controller:

* a sink no worker can build (its connector refuses its settings) is refused at
  registration already; one given to a worker all the same (a registry written before
  the check) leaves the heartbeat's ``keep`` answering and the sinks given with it
  taken, and shows as down;
* a sink whose connector raises an error it does not map is retried with back-off and
  shown as down, with one traceback in the log, not one per retry.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from millwheel.connectors.spec import ConnectorSpec, SinkSpec, sinks_from_list
from millwheel.errors import InvalidSpecError
from millwheel.nodes import sink_node
from millwheel.record import Record
from millwheel.runtime.sink_runner import SinkRunner
from millwheel.state.url import open_store
from millwheel.topology import Topology
from services.metrics import PrometheusSensors
from services.worker.connectors import Connectors
from services.worker.shared import Shared


def postgres(name: str, table: str) -> SinkSpec:
    settings = {"type": "postgres", "url": "postgresql://127.0.0.1:1/none", "table": table}
    return SinkSpec(name, "counts", ConnectorSpec("postgres", json.dumps(settings, sort_keys=True)))


@pytest.fixture
def connectors(tmp_path: Path) -> Iterator[Connectors]:
    store = open_store(f"sqlite:///{tmp_path}/s.db")
    stopped = threading.Event()
    c = Connectors(Shared(), store, PrometheusSensors("worker"), stopped, batch_size=100,
                   max_injector_outbox=1000, fenced=lambda _o, _e: None, report_fenced=lambda _e: None)
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
