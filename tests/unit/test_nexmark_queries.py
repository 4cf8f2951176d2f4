"""The Nexmark query specs build as shipped, render for a data set, and q4's running
aggregate gives each key's aggregate so far, exactly once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from millwheel.errors import InvalidSpecError
from millwheel.nexmark.generate import write
from millwheel.nexmark.generator import GeneratorConfig
from millwheel.nexmark.queries import QUERIES, render, spec_path, write_specs
from millwheel.nexmark.running import RunningAggregate
from millwheel.operators import build_computation
from millwheel.record import Record
from millwheel.spec import load_spec_file, topology_from_dict
from millwheel.testing import PipelineTest, every_crash
from millwheel.topology import CodeRef, ComputationSpec, InjectorSpec, InputSpec, Options, Topology


@pytest.mark.parametrize("query", QUERIES)
def test_every_shipped_spec_is_a_topology_whose_operators_build(query: str) -> None:
    topology = topology_from_dict(load_spec_file(spec_path(query)))
    for computation in topology.computations:
        build_computation(computation)
    assert query in topology.sink_streams()  # the query's result is the stream named for it


def test_an_unknown_query_is_refused_with_the_list() -> None:
    with pytest.raises(InvalidSpecError, match="q0, q1"):
        spec_path("q6")


def test_rendered_specs_read_the_data_with_its_disorder_and_auction_length(tmp_path: Path) -> None:
    config = GeneratorConfig(events=500, rate=100, out_of_order_group_size=10)
    write(config, tmp_path)
    q4 = render("q4", tmp_path)
    assert {i["name"]: i["file"] for i in q4["injectors"]} == {
        "auction": str(tmp_path.resolve() / "auction.jsonl"), "bid": str(tmp_path.resolve() / "bid.jsonl")}
    assert {i["max_disorder_us"] for i in q4["injectors"]} == {config.max_disorder_us} != {0}
    join = next(c for c in q4["computations"] if c["name"] == "q4-join")
    assert join["code"]["params"]["upper_us"] == config.max_auction_length_us == (2 * (1666 * 10 + 2) + 1) * 1000
    written = write_specs(tmp_path, tmp_path)
    assert [p.name for p in written] == [f"{q}.yaml" for q in QUERIES]
    assert load_spec_file(tmp_path / "q4.yaml") == q4
    assert (tmp_path / "q4.yaml").read_text().startswith("# Nexmark q4")  # the SQL comment kept


def _records(values: list[tuple[str, int]]) -> list[Record]:
    return [Record(k, json.dumps({"price": v}).encode(), i * 1000, f"r{i}") for i, (k, v) in enumerate(values)]


TOPOLOGY = Topology(
    computations=(ComputationSpec("means", (InputSpec("prices"),), ("means",),
                                  CodeRef("millwheel.nexmark.running:RunningAggregate",
                                          {"aggregation": "mean", "field": "price"}),
                                  Options(key_ranges=2)),),
    injectors=(InjectorSpec("prices", "prices"),),
)
VALUES = [("a", 10), ("b", 1), ("a", 20), ("a", 33), ("b", 2)]


def test_the_running_mean_is_each_keys_mean_so_far_with_every_record() -> None:
    with PipelineTest(TOPOLOGY) as t:
        t.add("prices", _records(VALUES))
        t.run()
        out = [json.loads(r.value) for r in t.output("means")]
    assert sorted((o["key"], o["count"], o["value"]) for o in out) == [
        ("a", 1, 10.0), ("a", 2, 15.0), ("a", 3, 21.0), ("b", 1, 1.0), ("b", 2, 1.5)]


def test_the_running_mean_survives_a_crash_at_every_point() -> None:
    def script(t: PipelineTest) -> None:
        t.add("prices", _records(VALUES[:3]))
        t.run()
        t.add("prices", _records(VALUES)[3:])
        t.done("prices")
        t.run()

    assert every_crash(TOPOLOGY, script, outputs=["means"], max_visits=2) > 1


def test_a_running_aggregate_refuses_what_it_cannot_compute() -> None:
    with pytest.raises(InvalidSpecError, match="median"):
        RunningAggregate(aggregation="median")
