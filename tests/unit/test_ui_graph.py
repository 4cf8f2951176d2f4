"""The console's graph edges (services/ui/graph.py, issue 33): every edge carries its own
records/s, the edges into connector sinks and into a logged stream's log included."""

from __future__ import annotations

from typing import Any

from millwheel.spec import topology_from_dict
from millwheel.topology import Topology
from services.ui.graph import EdgeRates, graph, sink_edge

TOPOLOGY = topology_from_dict({
    "injectors": [{"name": "orders", "stream": "orders"}],
    "computations": [{"name": "pass", "inputs": ["orders"], "outputs": ["passed"],
                      "code": {"name": "filter", "params": {"expr": "True"}}}],
    "sinks": [{"stream": "passed", "name": "passed.redis", "type": "redis-stream",
               "url": "redis://127.0.0.1:1", "redis_stream": "out"},
              {"stream": "passed", "name": "passed.pg", "type": "postgres",
               "url": "postgresql://127.0.0.1:1/db", "table": "out"}],
})


def comps(topo: Topology) -> dict[str, Any]:
    return {c.name: {"health": "ok", "inputs": [i.stream for i in c.inputs], "outputs": list(c.written_streams()),
                     "ranges": [{"pending": 0}], "dead_lettered": 0} for c in topo.computations}


def sinks(down: dict[str, float] | None = None) -> dict[str, Any]:
    return {s.name: {"name": s.name, "stream": s.stream, "down_s": (down or {}).get(s.name)}
            for s in TOPOLOGY.sinks}


def rates_of(rates: EdgeRates | None, down: dict[str, float] | None = None) -> dict[str, Any]:
    g = graph(TOPOLOGY, comps(TOPOLOGY), {"orders": {"outbox": 0}}, sinks(down), rates)
    return {f"{e['from']} -> {e['to']}": e["per_s"] for e in g["edges"]}


def test_a_sink_edge_is_the_rows_its_sink_wrote_per_second() -> None:
    rates = {("injector:orders", "orders", "pass"): 20.0,
             ("pass", "passed", "log:passed"): 19.5,  # appended to the log (both sinks follow it)
             sink_edge("passed.redis", "passed"): 18.0,  # each sink: what it wrote out
             sink_edge("passed.pg", "passed"): 7.25}
    assert rates_of(rates) == {
        "i:orders -> s:orders": 20.0, "s:orders -> c:pass": 20.0,
        "c:pass -> s:passed": 19.5,  # into a stream no computation reads: its log's appends
        "s:passed -> k:passed.redis": 18.0, "s:passed -> k:passed.pg": 7.25}


def test_a_sink_edge_is_zero_when_nothing_was_written_and_none_before_any_counter() -> None:
    assert rates_of({})["s:passed -> k:passed.redis"] == 0.0
    assert set(rates_of(None).values()) == {None}  # not read yet: no figure, not 0


def test_a_sink_that_is_down_shows_zero_whatever_the_window_still_holds() -> None:
    rates = {sink_edge("passed.redis", "passed"): 12.0, sink_edge("passed.pg", "passed"): 3.0}
    got = rates_of(rates, down={"passed.pg": 4.0})
    assert got["s:passed -> k:passed.pg"] == 0.0
    assert got["s:passed -> k:passed.redis"] == 12.0
    assert rates_of(None, down={"passed.pg": 4.0})["s:passed -> k:passed.pg"] == 0.0
    nodes = {n["id"]: n["health"] for n in graph(TOPOLOGY, comps(TOPOLOGY), {}, sinks({"passed.pg": 4.0}),
                                                   rates)["nodes"]}
    assert nodes["k:passed.pg"] == "failing" and nodes["k:passed.redis"] == "ok"


def test_a_sinks_written_rate_is_not_counted_as_its_streams_producers() -> None:
    # the sink's edge comes out of the log: it adds nothing to what flows into the stream
    got = rates_of({("pass", "passed", "log:passed"): 5.0, sink_edge("passed.redis", "passed"): 40.0})
    assert got["c:pass -> s:passed"] == 5.0
    assert got["s:passed -> k:passed.redis"] == 40.0


def test_the_snapshot_averages_a_sinks_written_rows_over_the_edge_window() -> None:
    from services.ui.snapshot import EDGE_WINDOW_S, Snapshotter

    snap = Snapshotter(None, interval_s=1.0)  # type: ignore[arg-type]  # _edges reads no controller
    on = {"passed.redis": "passed"}  # registered sinks -> their streams

    def scrape(written: float, other: float = 0.0) -> dict[str, Any]:
        return {"w1": {("millwheel_sink_records_total", (("sink", "passed.redis"),)): written,
                       ("millwheel_sink_records_total", (("sink", "gone"),)): other,  # not registered
                       ("millwheel_edge_records_total", (("consumer", "log:passed"), ("producer", "pass"),
                                                         ("stream", "passed"))): written}}

    edge = sink_edge("passed.redis", "passed")
    assert snap._edges(scrape(1000.0), 0.0, on)[edge] == 0.0  # first seen: counted from there
    for t in range(1, 11):
        got = snap._edges(scrape(1000.0 + 20 * t, 50.0 * t), float(t), on)
    assert abs(got[edge] - 20.0) < 1e-9  # 20 rows/s, over the last EDGE_WINDOW_S
    assert got[("pass", "passed", "log:passed")] == got[edge]
    assert not any(e[2] == "sink:gone" for e in got)
    # the worker restarted (its counter went down): counted from its new value, and the
    # figure falls to 0 over one window once nothing more is written
    got = snap._edges(scrape(30.0), 11.0, on)
    assert got[edge] > 0
    for t in range(12, 12 + int(EDGE_WINDOW_S) + 1):
        got = snap._edges(scrape(30.0), float(t), on)
    assert got[edge] == 0.0
