"""window_top, window_join and stream_join through the local runner, against plain-Python
references (tests/support/window_refs.py) on seeded out-of-order and late records, and
crashed at every point of the exactly-once sequence (millwheel.testing.every_crash)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

import pytest

from millwheel.errors import InvalidSpecError
from millwheel.limits import MAX_DURATION_US
from millwheel.operators import build_computation
from millwheel.operators.schema import validate_spec
from millwheel.record import Record
from millwheel.runtime.local_runner import LocalRunner
from millwheel.sources import ListSource
from millwheel.spec import load_spec_file, topology_from_dict
from millwheel.state.sqlite_store import SQLiteStore
from millwheel.testing import PipelineTest, every_crash
from millwheel.topology import CodeRef, ComputationSpec, InjectorSpec, InputSpec, LatePolicy, Options, Topology
from tests.support import operator_refs as ref
from tests.support import window_refs as wref
from tests.support.operator_refs import DISORDER, LATENESS, S

SIZE = 10 * S
ROUTED = Options(key_ranges=2, allowed_lateness_us=LATENESS, late_policy=LatePolicy.ROUTE, late_stream="late")


def run(tmp_path: Path, topo: Topology, sources: dict[str, list[Record]], batch_size: int = 7
        ) -> dict[str, list[Record]]:
    store = SQLiteStore(tmp_path / "s.db")
    try:
        LocalRunner(topo, store, {k: ListSource(v, DISORDER) for k, v in sources.items()},
                    batch_size=batch_size).run()
        return {s: [r for _seq, r in store.read_log(s, 0, 10**6)] for s in topo.sink_streams()}
    finally:
        store.close()


def fields(records: Iterable[Record]) -> list[tuple[str, bytes, int]]:
    return sorted((r.key, r.value, r.timestamp) for r in records)


def with_ties(records: list[Record], values: int = 4) -> list[Record]:
    """The records with a number from a few values (so windows have ties) and their ID
    in the value (so each is told apart in the output)."""
    return [Record(r.key, json.dumps({"x": json.loads(r.value)["x"] % values, "id": r.record_id}).encode(),
                   r.timestamp, r.record_id) for r in records]


# -- window_top ------------------------------------------------------------------------

def top_topology(options: Options, **params: Any) -> Topology:
    code = CodeRef("window_top", {"size_us": SIZE, "field": "x", **params})
    return Topology((ComputationSpec("top", (InputSpec("in"),), ("out",), code, options),),
                    (InjectorSpec("src", "in"),))


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("offset", [0, 3 * S])
def test_window_top_with_late_records_matches_the_reference(tmp_path: Path, seed: int, offset: int) -> None:
    records, beyond = ref.timeline(seed, 400, "r", keys=2)
    records = with_ties(records)
    out = run(tmp_path, top_topology(ROUTED, offset_us=offset), {"src": records})
    assert fields(out["late"]) == fields(r for r in records if r.record_id in beyond)
    kept = [r for r in records if r.record_id not in beyond]
    want = wref.tops(kept, SIZE, "x", offset)
    assert wref.final_tops(out["out"], "x") == want
    assert any(len(v) > 1 for v in want.values()), "windows with ties"
    assert len(out["out"]) > sum(len(v) for v in want.values()), "late records reached produced maxima"
    assert len({r.record_id for r in out["out"]}) == len(out["out"])
    by_window: dict[tuple[str, int], list[int]] = {}
    for r in out["out"]:  # a key's window is produced in order: maxima, then late equal or greater
        by_window.setdefault((r.key, r.timestamp), []).append(json.loads(r.value)["x"])
    assert all(xs == sorted(xs) for xs in by_window.values())


@pytest.mark.parametrize("policy", [LatePolicy.DROP, LatePolicy.PROCESS])
def test_window_top_without_lateness_produces_each_maximum_once(tmp_path: Path, policy: LatePolicy) -> None:
    records, beyond = ref.timeline(5, 300, "r", keys=3, late=False)
    records = with_ties(records, 3)
    out = run(tmp_path, top_topology(Options(key_ranges=2, late_policy=policy)), {"src": records})
    want = wref.tops([r for r in records if r.record_id not in beyond], SIZE, "x")
    assert wref.final_tops(out["out"], "x") == want
    assert len(out["out"]) == sum(len(v) for v in want.values()), "without lateness each top record once"


def test_window_top_keeps_only_the_maximum_and_produces_values_unchanged(tmp_path: Path) -> None:
    values = [5, 3, 9, 9, 1, 9, 2, 7, 0, 4]
    records = [Record("all", json.dumps({"bid": {"price": p, "n": i}}).encode(), i * S, f"b{i}")
               for i, p in enumerate(values)]
    records += [Record("all", b'{"bid": {"price": 8, "n": 10}}', 15 * S, "b10"),
                Record("all", b'{"bid": {"price": 8.0, "n": 11}}', 16 * S, "b11")]
    topo = top_topology(Options(key_ranges=1), field="bid.price")
    store = SQLiteStore(tmp_path / "s.db")
    try:
        runner = LocalRunner(topo, store, {"src": ListSource(records, 0)}, batch_size=1)
        held = []
        while runner.step():
            state = store.read_state("top", ["all"], 0).get("all")
            if state:
                held.append(json.loads(state))
        assert {"0": [9, [records[i].value.decode() for i in (2, 3, 5)], False]} in held
        assert all(len(w[1]) <= 3 for h in held for w in h.values()), "no record below the maximum is kept"
        assert store.read_state("top", ["all"], 0).get("all") is None, "a finished run leaves no state"
        out = [r for _s, r in store.read_log("out", 0, 100)]
        assert [(r.value, r.timestamp) for r in out] == [
            (records[2].value, SIZE - 1), (records[3].value, SIZE - 1), (records[5].value, SIZE - 1),
            (records[10].value, 2 * SIZE - 1), (records[11].value, 2 * SIZE - 1)]
    finally:
        store.close()


def test_a_late_record_replaces_or_joins_a_produced_maximum() -> None:
    """The rule a consumer relies on: per window, the produced records with the greatest number."""
    topo = top_topology(Options(key_ranges=1, allowed_lateness_us=30 * S))
    with PipelineTest(topo) as t:
        t.add("src", [Record("k", b'{"x": 5, "i": 0}', 1 * S, "a"), Record("k", b'{"x": 2, "i": 1}', 2 * S, "b")])
        t.advance_watermark("src", 20 * S)
        t.run()
        assert [r.value for r in t.output("out")] == [b'{"x": 5, "i": 0}']
        t.add("src", [Record("k", b'{"x": 4, "i": 2}', 3 * S, "c"),     # below: nothing
                      Record("k", b'{"x": 5, "i": 3}', 4 * S, "d"),     # equal: joins the top
                      Record("k", b'{"x": 7, "i": 4}', 5 * S, "e")])    # greater: replaces it
        t.run()
        out = t.output("out")
        assert [r.value for r in out] == [b'{"x": 5, "i": 0}', b'{"x": 5, "i": 3}', b'{"x": 7, "i": 4}']
        assert {r.timestamp for r in out} == {SIZE - 1}
        assert wref.final_tops(out, "x") == {("k", SIZE - 1): [b'{"x": 7, "i": 4}']}
        t.advance_watermark("src", SIZE - 1 + 30 * S + 1)  # past the lateness: the window is gone
        t.run()
        assert t.state("top", "k") is None
        t.add("src", [Record("k", b'{"x": 99}', 6 * S, "f")])
        t.run()
        assert len(t.output("out")) == 3


def test_window_top_without_field_ranks_the_value_itself() -> None:
    code = CodeRef("window_top", {"size_us": SIZE})
    topo = Topology((ComputationSpec("top", (InputSpec("in"),), ("out",), code, Options(key_ranges=1)),),
                    (InjectorSpec("src", "in"),))
    values = [b"3", b"12", b"-1", b"12.0", b'"12"', b"11.5", b"9007199254740993", b"9007199254740992"]
    with PipelineTest(topo) as t:
        t.add("src", [Record("k", v, i, f"r{i}") for i, v in enumerate(values[:6])])
        t.add("src", [Record("k", v, SIZE + i, f"s{i}") for i, v in enumerate(values[6:])])
        t.done()
        t.run()
        assert [r.value for r in t.output("out")] == [b"12", b"12.0", b'"12"', b"9007199254740993"]


def test_a_value_that_is_not_a_number_is_dead_lettered() -> None:
    topo = top_topology(Options(key_ranges=1, max_attempts=1))
    with PipelineTest(topo) as t:
        t.add("src", [Record("k", b'{"x": 1}', 1, "a"), Record("k", b'{"x": "lots"}', 2, "b"),
                      Record("k", b'{"y": 1}', 3, "c"), Record("k", b'{"x": true}', 4, "d"),
                      Record("k", b'{"x": "3"}', 5, "e")])
        t.done()
        t.run()
        assert [r.value for r in t.output("out")] == [b'{"x": "3"}']
        letters = [json.loads(r.value) for r in t.output("top.dead_letters")]
        assert len(letters) == 3
        assert all("value is not a number at field 'x'" in m["message"] for m in letters)


# -- window_join -----------------------------------------------------------------------

def window_join_topology(options: Options, **params: Any) -> Topology:
    code = CodeRef("window_join", {"size_us": SIZE, **params})
    return Topology((ComputationSpec("j", (InputSpec("a"), InputSpec("b")), ("out",), code, options),),
                    (InjectorSpec("ia", "a"), InjectorSpec("ib", "b")))


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize(("mode", "offset"), [("inner", 0), ("inner", 4 * S), ("semi", 0)])
def test_window_join_with_late_records_matches_the_reference(tmp_path: Path, seed: int, mode: str,
                                                             offset: int) -> None:
    left, beyond_l = ref.timeline(seed, 200, "a", keys=3)
    right, beyond_r = ref.timeline(seed + 100, 200, "b", keys=3)
    out = run(tmp_path, window_join_topology(ROUTED, offset_us=offset, mode=mode), {"ia": left, "ib": right})
    assert fields(out["late"]) == fields(r for r in left + right if r.record_id in beyond_l | beyond_r)
    assert all(not r.value.startswith(b"\x00") for r in out["late"]), "routed records are as produced"
    semi = mode == "semi"
    want = wref.window_pairs([r for r in left if r.record_id not in beyond_l],
                             [r for r in right if r.record_id not in beyond_r], SIZE, offset, semi)
    assert len(want) > 50
    assert wref.window_join_outputs(out["out"], semi) == want
    assert len({r.record_id for r in out["out"]}) == len(out["out"])


def test_window_join_without_lateness_drops_each_window_at_its_end(tmp_path: Path) -> None:
    left, _ = ref.timeline(8, 300, "a", keys=2, late=False, beyond_too=False)
    right, _ = ref.timeline(9, 300, "b", keys=2, late=False, beyond_too=False)
    topo = window_join_topology(Options(key_ranges=1))
    store = SQLiteStore(tmp_path / "s.db")
    try:
        runner = LocalRunner(topo, store, {"ia": ListSource(left, DISORDER), "ib": ListSource(right, DISORDER)},
                             batch_size=7)
        while runner.step():
            for key in ("k0", "k1"):
                state = store.read_state("j", [key], 0).get(key)
                if state:  # only the windows the watermark has not passed
                    assert len(json.loads(state)) <= 3
        assert store.read_state("j", ["k0", "k1"], 0) == {}, "a finished run leaves no join state"
        out = [r for _s, r in store.read_log("out", 0, 10**6)]
        assert wref.window_join_outputs(out) == wref.window_pairs(left, right, SIZE)
    finally:
        store.close()


def test_a_late_record_joins_only_the_records_kept_for_its_window() -> None:
    topo = window_join_topology(Options(key_ranges=1, allowed_lateness_us=30 * S))
    with PipelineTest(topo) as t:
        t.add("ia", [Record("k", b'"l1"', 1 * S, "l1")])
        t.add("ib", [Record("k", b'"r1"', 2 * S, "r1"), Record("k", b'"r2"', 3 * S, "r2")])
        t.advance_watermark("ia", 20 * S)
        t.advance_watermark("ib", 20 * S)
        t.run()
        pairs = [(v["left"], v["right"]) for v in map(json.loads, (r.value for r in t.output("out")))]
        assert pairs == [("l1", "r1"), ("l1", "r2")]
        t.add("ia", [Record("k", b'"l2"', 4 * S, "l2")])  # late: its two pairs, at once
        t.add("ib", [Record("k", b'"r3"', 12 * S, "r3")])  # another window: nothing to join
        t.run()
        out = [json.loads(r.value) for r in t.output("out")]
        assert [(v["left"], v["right"]) for v in out[2:]] == [("l2", "r1"), ("l2", "r2")]
        assert all((v["start"], v["end"]) == (0, SIZE) for v in out)
        assert {r.timestamp for r in t.output("out")} == {SIZE - 1}


# -- stream_join -----------------------------------------------------------------------

def stream_join_topology(options: Options, **params: Any) -> Topology:
    code = CodeRef("stream_join", params)
    return Topology((ComputationSpec("j", (InputSpec("a"), InputSpec("b")), ("out",), code, options),),
                    (InjectorSpec("ia", "a"), InjectorSpec("ib", "b")))


UNBOUNDED = 10**18


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("retention", [None, 15 * S])
def test_stream_join_with_late_records_matches_the_reference(tmp_path: Path, seed: int,
                                                             retention: int | None) -> None:
    left, beyond_l = ref.timeline(seed, 150, "a", keys=5)
    right, beyond_r = ref.timeline(seed + 100, 150, "b", keys=5)
    params = {} if retention is None else {"retention_us": retention}
    out = run(tmp_path, stream_join_topology(ROUTED, **params), {"ia": left, "ib": right})
    assert fields(out["late"]) == fields(r for r in left + right if r.record_id in beyond_l | beyond_r)
    bound = UNBOUNDED if retention is None else retention
    want = ref.joined([r for r in left if r.record_id not in beyond_l],
                      [r for r in right if r.record_id not in beyond_r], -bound, bound)
    assert len(want) > 100
    assert ref.join_outputs(out["out"]) == want
    assert len({r.record_id for r in out["out"]}) == len(out["out"])


def test_unbounded_stream_join_joins_every_record_however_late(tmp_path: Path) -> None:
    """Under late_policy process nothing is too late for it: every record it could match is kept."""
    left, beyond_l = ref.timeline(3, 150, "a", keys=5)
    right, beyond_r = ref.timeline(4, 150, "b", keys=5)
    assert beyond_l and beyond_r
    out = run(tmp_path, stream_join_topology(Options(key_ranges=2)), {"ia": left, "ib": right})
    assert ref.join_outputs(out["out"]) == ref.joined(left, right, -UNBOUNDED, UNBOUNDED)


def test_stream_join_state_grows_without_retention_and_is_expired_with_it(tmp_path: Path) -> None:
    left = [Record("k", json.dumps(i).encode(), i * S, f"a{i}") for i in range(40)]
    right = [Record("k", b'"r"', i * S + S // 2, f"b{i}") for i in range(40)]
    for params, kept in (({}, 80), ({"retention_us": S}, 0)):
        store = SQLiteStore(tmp_path / f"s{kept}.db")
        try:
            LocalRunner(stream_join_topology(Options(key_ranges=1), **params), store,
                        {"ia": ListSource(left, 0), "ib": ListSource(right, 0)}, batch_size=7).run()
            state = store.read_state("j", ["k"], 0).get("k")
            held = json.loads(state) if state else {"l": [], "r": []}
            assert len(held["l"]) + len(held["r"]) == kept
            out = [json.loads(r.value) for _s, r in store.read_log("out", 0, 10**6)]
            assert len(out) == (1600 if not params else 79)  # |t_b - t_a| <= 1 s: i with i, and i + 1 with i
        finally:
            store.close()


# -- exactly once under crashes ----------------------------------------------------------

def crash_script(injectors: dict[str, list[Record]], late: dict[str, list[Record]]) -> Any:
    """Phase 1 on time, up to a watermark of 40 s; phase 2 the rest and late records
    (30..40 s, within the lateness), to a watermark of 50 s; then done.

    Each watermark is given three times, each followed by a run: an injector crashed
    right after checkpointing a batch announces that batch's watermark again only with
    its next batch, and a late record that reached a window before the watermark closed
    it would not be late (another output, as right as the first). The repeats keep the
    outputs decided by the data, whichever one step a run crashes at."""
    def settle(t: PipelineTest, watermark: int) -> None:
        for _ in range(3):
            for name in injectors:
                t.advance_watermark(name, watermark)
            t.run()

    def script(t: PipelineTest) -> None:
        for name, records in injectors.items():
            t.add(name, records[:len(records) // 2])
        settle(t, 40 * S)
        for name, records in injectors.items():
            t.add(name, records[len(records) // 2:] + late[name])
        settle(t, 50 * S)
        t.done()
        t.run()
    return script


def crash_records(prefix: str, seed: int) -> tuple[list[Record], list[Record]]:
    """On-time records (event time 0..80 s, three keys) and late ones (0..40 s)."""
    import random
    rng = random.Random(seed)
    on_time = [Record(f"k{rng.randrange(3)}", json.dumps({"x": rng.randrange(4), "i": i}).encode(),
                      i * 400_000 + rng.randrange(S), f"{prefix}{i}") for i in range(200)]
    late = [Record(f"k{rng.randrange(3)}", json.dumps({"x": rng.randrange(5), "i": 1000 + i}).encode(),
                   rng.randrange(30 * S, 40 * S), f"{prefix}late{i}") for i in range(10)]
    return on_time, late


@pytest.mark.parametrize("operator", ["window_top", "window_join", "stream_join"])
def test_every_crash_point_gives_the_same_output(operator: str) -> None:
    opts = Options(key_ranges=2, allowed_lateness_us=30 * S)
    a, a_late = crash_records("a", 1)
    if operator == "window_top":
        topo = top_topology(opts)
        script = crash_script({"src": a}, {"src": a_late})
    else:
        b, b_late = crash_records("b", 2)
        topo = (window_join_topology(opts, mode="inner") if operator == "window_join"
                else stream_join_topology(opts, retention_us=5 * S))
        script = crash_script({"ia": a, "ib": b}, {"ia": a_late, "ib": b_late})
    assert every_crash(topo, script, outputs=["out"], max_visits=6, batch_size=25) > 30


# -- parameters ------------------------------------------------------------------------

def spec_of(code: dict[str, object], inputs: tuple[str, ...] = ("a", "b"), outputs: tuple[str, ...] = ("out",)
            ) -> ComputationSpec:
    return ComputationSpec("c", tuple(InputSpec(s) for s in inputs), outputs,
                           CodeRef(str(code.pop("name")), code))


@pytest.mark.parametrize(("code", "inputs", "outputs", "message"), [
    ({"name": "window_top"}, ("a",), ("out",), "'c'.code.params.size_us: required"),
    ({"name": "window_top", "size_us": 0}, ("a",), ("out",), "size_us: must be >= 1"),
    ({"name": "window_top", "size_us": 10**20}, ("a",), ("out",), f"size_us: must be <= {MAX_DURATION_US}"),
    ({"name": "window_top", "size_us": 5, "offset_us": 5}, ("a",), ("out",), "offset_us: must be < size_us (5)"),
    ({"name": "window_top", "size_us": 5, "offset_us": -1}, ("a",), ("out",), "offset_us: must be >= 0"),
    ({"name": "window_top", "size_us": 5, "field": 3}, ("a",), ("out",), "field: expected a string"),
    ({"name": "window_top", "size_us": 5, "allowed_lateness_us": -1}, ("a",), ("out",),
     "allowed_lateness_us: must be >= 0"),
    ({"name": "window_top", "size_us": 5}, ("a",), (), "'c'.outputs:"),
    ({"name": "window_top", "size_us": 5, "period_us": 1}, ("a",), ("out",), "unknown parameters ['period_us']"),
    ({"name": "window_join", "size_us": 5}, ("a",), ("out",), "'window_join' joins exactly two different streams"),
    ({"name": "window_join", "size_us": 5}, ("a", "a"), ("out",), "exactly two different"),
    ({"name": "window_join"}, ("a", "b"), ("out",), "params.size_us: required"),
    ({"name": "window_join", "size_us": 5, "offset_us": 7}, ("a", "b"), ("out",), "offset_us: must be < size_us"),
    ({"name": "window_join", "size_us": 5, "mode": "outer"}, ("a", "b"), ("out",), "mode: 'outer' is not one of"),
    ({"name": "window_join", "size_us": 5, "left": "x"}, ("a", "b"), ("out",),
     "params.left: stream 'x' is not one of its inputs"),
    ({"name": "window_join", "size_us": 5, "left": "b", "right": "b"}, ("a", "b"), ("out",),
     "params.right: must differ from left"),
    ({"name": "window_join", "size_us": 5, "output": "nope"}, ("a", "b"), ("out",), "params.output: stream 'nope'"),
    ({"name": "stream_join"}, ("a",), ("out",), "'stream_join' joins exactly two different streams"),
    ({"name": "stream_join", "retention_us": -1}, ("a", "b"), ("out",), "retention_us: must be >= 0"),
    ({"name": "stream_join", "retention_us": "1"}, ("a", "b"), ("out",), "retention_us: expected an integer"),
    ({"name": "stream_join", "lower_us": 0}, ("a", "b"), ("out",), "unknown parameters ['lower_us']"),
    ({"name": "stream_join"}, ("a", "b"), (), "'c'.outputs:"),
])
def test_bad_specs_name_the_field(code: dict[str, object], inputs: tuple[str, ...], outputs: tuple[str, ...],
                                  message: str) -> None:
    spec = spec_of(dict(code), inputs, outputs)
    with pytest.raises(InvalidSpecError, match="computation 'c'") as exc:
        validate_spec(spec)
    assert message in str(exc.value)
    with pytest.raises(InvalidSpecError):
        build_computation(spec)


def test_yaml_spec_with_the_three_operators_loads_and_builds(tmp_path: Path) -> None:
    path = tmp_path / "spec.yaml"
    path.write_text("""
injectors:
  - {name: bids, stream: bids}
  - {name: people, stream: people}
  - {name: auctions, stream: auctions}
computations:
  - name: highest
    inputs: [{stream: bids}]
    outputs: [highest]
    code: {name: window_top, params: {size_us: 10000000, field: price}}
  - name: new-sellers
    inputs: [{stream: people, key: "json:id"}, {stream: auctions, key: "json:seller"}]
    outputs: [new-sellers]
    code: {name: window_join, params: {size_us: 10000000, mode: semi}}
  - name: sellers
    inputs: [{stream: people, key: "json:id"}, {stream: auctions, key: "json:seller"}]
    outputs: [sellers]
    code: {name: stream_join, params: {right: people}}
""")
    topo = topology_from_dict(load_spec_file(path))
    top = build_computation(topo.computation("highest"))
    assert (top.size_us, top.field) == (10_000_000, "price")  # type: ignore[attr-defined]
    semi = build_computation(topo.computation("new-sellers"))
    assert (semi.left, semi.right, semi.semi) == ("people", "auctions", True)  # type: ignore[attr-defined]
    sellers = build_computation(topo.computation("sellers"))
    assert (sellers.left, sellers.right) == ("auctions", "people")  # type: ignore[attr-defined]
    assert (sellers.lower_us, sellers.upper_us) == (None, None)  # type: ignore[attr-defined]
