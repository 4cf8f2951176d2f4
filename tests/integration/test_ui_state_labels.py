"""The console's labelled state (services/ui/state_view.py) over the state each built-in
operator really writes: each operator runs in :class:`millwheel.testing.PipelineTest`
(the runtime of ``millwheel run``, virtual time) and the key's stored state is labelled
as the console shows it. A shape change in an operator fails here, not silently in the
console (which would fall back to the bare JSON)."""

from __future__ import annotations

import json
from typing import Any

from millwheel.record import Record
from millwheel.spec import topology_from_dict
from millwheel.testing import PipelineTest
from services.ui.state_view import labelled, span, when

T0 = 1_700_000_000_000_000
S = 1_000_000


def state_of(computation: dict[str, Any], feeds: dict[str, list[Record]], key: str,
             watermark: int | None = None) -> tuple[Any, dict[str, Any] | None]:
    """Run ``computation`` over ``feeds`` (injector = stream name); (its decoded state of
    ``key``, the labelled view)."""
    topo = topology_from_dict({"injectors": [{"name": s, "stream": s} for s in feeds],
                               "computations": [computation]})
    with PipelineTest(topo) as t:
        for stream, records in feeds.items():
            t.add(stream, records)
            if watermark is not None:
                t.advance_watermark(stream, watermark)
        t.run()
        raw = t.state(computation["name"], key)
    assert raw is not None
    decoded = json.loads(raw)
    spec = topo.computations[0]
    return decoded, labelled(spec, decoded)


def rec(key: str, value: Any, t: int, rid: str) -> Record:
    return Record(key, json.dumps(value).encode(), t, rid)


def test_window_aggregate_names_count_sum_min_max_and_the_window() -> None:
    _, view = state_of({"name": "w", "inputs": ["nums"], "outputs": ["out"],
                        "code": {"name": "window_aggregate", "params": {"size_us": 10 * S, "aggregation": "mean"}}},
                       {"nums": [rec("k", 2, T0 + S, "a"), rec("k", 4, T0 + 2 * S, "b")]}, "k")
    assert view == {"operator": "window_aggregate", "entries": [{
        "label": f"window {span(T0, T0 + 10 * S)}",
        "fields": {"count": 2, "sum": 6.0, "min": 2.0, "max": 4.0, "mean": 3.0, "fired": False}}]}
    assert view["entries"][0]["label"] == "window 2023-11-14 22:13:20.000 – 22:13:30.000 UTC"


def test_session_window_names_end_count_and_the_session() -> None:
    _, view = state_of({"name": "s", "inputs": ["nums"], "outputs": ["out"],
                        "code": {"name": "session_window", "params": {"gap_us": 5 * S, "aggregation": "count"}}},
                       {"nums": [rec("k", 1, T0, "a"), rec("k", 1, T0 + 3 * S, "b")]}, "k")
    assert view == {"operator": "session_window", "entries": [{
        "label": f"session {span(T0, T0 + 8 * S)}",
        "fields": {"end": when(T0 + 8 * S), "count": 2, "fired": False}}]}


def test_window_top_names_the_maximum_and_its_records() -> None:
    _, view = state_of({"name": "top", "inputs": ["bids"], "outputs": ["out"],
                        "code": {"name": "window_top", "params": {"size_us": 10 * S, "field": "price"}}},
                       {"bids": [rec("all", {"price": 3}, T0, "a"), rec("all", {"price": 7}, T0 + S, "b")]}, "all")
    assert view is not None and len(view["entries"]) == 1
    fields = view["entries"][0]["fields"]
    assert fields["max"] == 7 and fields["fired"] is False
    assert [json.loads(v) for v in fields["top records"]] == [{"price": 7}]


def test_window_join_names_each_side_by_its_stream_with_readable_times() -> None:
    _, view = state_of({"name": "j", "inputs": ["people", "auctions"], "outputs": ["out"],
                        "code": {"name": "window_join", "params": {"size_us": 10 * S}}},
                       {"people": [rec("p1", {"id": "p1"}, T0 + S, "a")],
                        "auctions": [rec("p1", {"seller": "p1"}, T0 + 2 * S, "b")]}, "p1")
    assert view is not None
    (entry,) = view["entries"]
    assert entry["label"] == f"window {span(T0, T0 + 10 * S)}"
    assert entry["fields"]["left (people)"][0]["time"] == when(T0 + S)
    assert entry["fields"]["right (auctions)"][0]["time"] == when(T0 + 2 * S)
    assert entry["fields"]["fired"] is False


def test_interval_and_stream_join_name_the_records_kept_per_side() -> None:
    for code in ({"name": "interval_join", "params": {"lower_us": 0, "upper_us": 60 * S}},
                 {"name": "stream_join", "params": {}}):
        _, view = state_of({"name": "j", "inputs": ["views", "clicks"], "outputs": ["out"], "code": code},
                           {"views": [rec("u", "v1", T0, "a")], "clicks": []}, "u")
        assert view is not None, code
        (entry,) = view["entries"]
        assert entry["fields"]["left (views)"] == [{"time": when(T0), "value": "v1"}], (code, entry)
        assert entry["fields"]["right (clicks)"] == []


def test_user_state_and_other_shapes_are_left_as_they_are() -> None:
    topo = topology_from_dict({"injectors": [{"name": "x", "stream": "x"}], "computations": [
        {"name": "w", "inputs": ["x"], "outputs": ["o"],
         "code": {"name": "window_aggregate", "params": {"size_us": S}}}]})
    assert labelled(topo.computations[0], {"not": "a window"}) is None
    assert labelled(topo.computations[0], [1, 2]) is None
    assert when(-2**62) == "-inf (before any record)" and when(2**62) == "+inf (end of input)"
