"""What the console draws and summarises from a snapshot, as pure functions: the
topology graph's layers and edges, and the checkpoint latency quantiles read from the
workers' histogram buckets (services/ui/snapshot.py gathers the figures)."""

from __future__ import annotations

from typing import Any

from millwheel.nodes import injector_node, sink_node
from millwheel.topology import Topology


def quantile_ms(d: dict[str, float], q: float) -> float | None:
    """The ``q`` quantile of the checkpoints since the last refresh, in ms, as the upper
    bound of the histogram bucket it falls in (so "under 5 ms", not an exact figure);
    None without checkpoints; above the largest bucket, that bucket's bound (2.5 s)."""
    buckets = sorted((float(k[3:]), n) for k, n in d.items() if k.startswith("le:"))
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return None
    finite = [b for b, _ in buckets if b != float("inf")]
    for bound, n in buckets:
        if n >= q * total:
            return bound * 1000 if bound != float("inf") else (finite[-1] * 1000 if finite else None)
    return None


EdgeRates = dict[tuple[str, str, str], float]  # (producer node, stream, consumer) -> records/s


def sink_edge(sink: str, stream: str) -> tuple[str, str, str]:
    """The edge a connector sink takes its stream on, as :data:`EdgeRates` keys it: from
    the stream's log (``log:STREAM``) to the sink's node (``sink:NAME``). Its rate is
    what the sink wrote (``millwheel_sink_records_total{sink}``), not an ack."""
    return "log:" + stream, stream, sink_node(sink)


def edge_rates(rates: EdgeRates | None) -> tuple[dict[tuple[str, str], float], dict[tuple[str, str], float]]:
    """From the records/s each consumer acknowledged per (producer, stream, consumer):
    what goes out of a producer into a stream (the most any consumer of it took: each
    consumer gets every record, and a failing consumer must not hide the others'
    traffic) and what comes out of a stream into a consumer (summed over the stream's
    producers: an injector and a computation may write one stream). A connector sink's
    edge (:func:`sink_edge`) comes out of the stream's log: only its stream-to-sink rate
    counts (the producers' edges into a logged stream count their ``log:`` appends)."""
    out: dict[tuple[str, str], float] = {}
    into: dict[tuple[str, str], float] = {}
    for (producer, stream, consumer), r in (rates or {}).items():
        out[(producer, stream)] = max(out.get((producer, stream), 0.0), r)
        if not consumer.startswith("log:"):
            into[(stream, consumer)] = into.get((stream, consumer), 0.0) + r
    return out, into


def graph(topo: Topology, comps: dict[str, Any], injectors: dict[str, Any],
          connectors: dict[str, Any] | None = None, rates: EdgeRates | None = None) -> dict[str, Any]:
    """Nodes (injectors, computations, streams; a stream no computation consumes is a
    sink; a connector sink after its stream, failing while it cannot write) in layers
    left to right, and edges with the records per second they carry and,
    out of a producer, the records it has checkpointed that its consumers have not
    acknowledged yet (``queued``: backpressure shows there first).

    An edge's rate is its own (issue 33: they were the consumer's whole input rate,
    retries counted, on every edge of it): what the consumer acknowledged on that edge
    (:func:`edge_rates`), 0 for an edge nothing crossed, None before the workers'
    counters were read once (``rates`` None). A connector sink's edge: the records it
    wrote out per second (:func:`sink_edge`), 0 while it is down (it writes nothing; the
    node shows ``failing``); the edge into a logged stream no computation reads: what
    its producers appended to the stream's log."""
    out_rate, in_rate = edge_rates(rates)
    known = rates is not None

    def rate(table: dict[tuple[str, str], float], key: tuple[str, str]) -> float | None:
        return round(table.get(key, 0.0), 2) if known else None

    nodes: list[dict[str, Any]] = []
    edges: list[dict[str, Any]] = []
    layer: dict[str, int] = {}
    sinks = set(topo.sink_streams())
    streams = sorted({inj.stream for inj in topo.injectors}
                     | {s for c in topo.computations for s in [*c.written_streams(), *(i.stream for i in c.inputs)]})
    for inj in topo.injectors:
        layer["i:" + inj.name] = 0
    changed = True
    guard = 0
    while changed and guard < 200:  # longest path; the registry is acyclic
        changed, guard = False, guard + 1
        for inj in topo.injectors:
            changed |= _at_least(layer, "s:" + inj.stream, 1)
        for c in topo.computations:
            depth = max((layer.get("s:" + i.stream, 1) for i in c.inputs), default=1) + 1
            changed |= _at_least(layer, "c:" + c.name, depth)
            for s in c.written_streams():
                changed |= _at_least(layer, "s:" + s, depth + 1)
    for inj in topo.injectors:
        info = injectors.get(inj.name, {})
        nodes.append({"id": "i:" + inj.name, "kind": "injector", "name": inj.name, "layer": 0,
                      "health": "lagging" if info.get("outbox", 0) else "ok"})
        edges.append({"from": "i:" + inj.name, "to": "s:" + inj.stream,
                      "per_s": rate(out_rate, (injector_node(inj.name), inj.stream)),
                      "queued": info.get("outbox", 0)})
    for name, info in comps.items():
        nodes.append({"id": "c:" + name, "kind": "computation", "name": name,
                      "layer": layer.get("c:" + name, 2), "health": info["health"]})
        for s in info["inputs"]:
            edges.append({"from": "s:" + s, "to": "c:" + name, "per_s": rate(in_rate, (s, name))})
        queued = sum(r["pending"] for r in info["ranges"])  # checkpointed, not yet acked downstream
        for s in info["outputs"]:
            edges.append({"from": "c:" + name, "to": "s:" + s, "per_s": rate(out_rate, (name, s)), "queued": queued})
    dead_streams = {c.dead_letter_stream: name for name, c in
                    ((c.name, c) for c in topo.computations)}
    hidden = {s for s, name in dead_streams.items()
              if s in sinks and not comps.get(name, {}).get("dead_lettered")}
    edges = [e for e in edges if e["to"][2:] not in hidden or not e["to"].startswith("s:")]
    for s in streams:
        if s in hidden:  # an empty dead-letter stream: shown once something is in it
            continue
        nodes.append({"id": "s:" + s, "kind": "sink" if s in sinks else "stream", "name": s,
                      "layer": layer.get("s:" + s, 1), "health": "ok"})
    for name, info in (connectors or {}).items():
        nodes.append({"id": "k:" + name, "kind": "sink", "name": name, "layer": layer.get("s:" + info["stream"], 1) + 1,
                      "health": "ok" if info["down_s"] is None else "failing"})
        _log, stream, node = sink_edge(name, info["stream"])
        written = 0.0 if info["down_s"] is not None else rate(in_rate, (stream, node))
        edges.append({"from": "s:" + info["stream"], "to": "k:" + name, "per_s": written})
    return {"nodes": nodes, "edges": edges}


def _at_least(layer: dict[str, int], node: str, depth: int) -> bool:
    if layer.get(node, -1) < depth:
        layer[node] = depth
        return True
    return False
