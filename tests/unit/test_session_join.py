"""session_window and interval_join through the local runner, against plain-Python
references (tests/support/operator_refs.py) on seeded out-of-order and late records."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

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
from millwheel.topology import CodeRef, ComputationSpec, InjectorSpec, InputSpec, LatePolicy, Options, Topology
from tests.support import operator_refs as ref
from tests.support.operator_refs import DISORDER, LATENESS, S

GAP = 5 * S


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
    """Records as produced, without IDs (a routed late record gets an ID of its own)."""
    return sorted((r.key, r.value, r.timestamp) for r in records)


def session_topology(agg: str, options: Options) -> Topology:
    code = CodeRef("session_window", {"gap_us": GAP, "aggregation": agg, "field": "x"})
    return Topology((ComputationSpec("sess", (InputSpec("in"),), ("out",), code, options),),
                    (InjectorSpec("src", "in"),))


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("agg", ["count", "sum", "min", "max", "mean"])
def test_sessions_with_late_records_match_the_reference(tmp_path: Path, seed: int, agg: str) -> None:
    records, beyond = ref.timeline(seed, 400, "r")
    opts = Options(key_ranges=2, allowed_lateness_us=LATENESS, late_policy=LatePolicy.ROUTE, late_stream="late")
    out = run(tmp_path, session_topology(agg, opts), {"src": records})
    assert fields(out["late"]) == fields(r for r in records if r.record_id in beyond)
    kept = [r for r in records if r.record_id not in beyond]
    want = ref.sessions(kept, GAP, agg)
    assert ref.final_sessions(out["out"]) == want
    assert len(out["out"]) > len(want), "late records corrected or merged sessions already produced"
    assert len({r.record_id for r in out["out"]}) == len(out["out"])


def test_a_late_record_bridging_two_produced_sessions_merges_them(tmp_path: Path) -> None:
    on_time = [Record("k", b'{"x": 1}', t * S, f"a{t}") for t in (0, 2, 10, 12, 40, 41)]
    bridge = Record("k", b'{"x": 1}', 6 * S, "late")  # 2+5 > 6 and 6+5 > 10: joins [0,7) and [10,17)
    opts = Options(key_ranges=1, allowed_lateness_us=LATENESS)
    out = run(tmp_path, session_topology("count", opts), {"src": [*on_time[:5], bridge, on_time[5]]},
              batch_size=1)
    got = [(json.loads(r.value)["start"], json.loads(r.value)["end"], json.loads(r.value)["value"], r.timestamp)
           for r in out["out"]]
    assert got[:2] == [(0, 7 * S, 2, 7 * S - 1), (10 * S, 17 * S, 2, 17 * S - 1)]
    assert (0, 17 * S, 5, 17 * S - 1) in got[2:]  # the merged session, produced at once
    assert ref.final_sessions(out["out"]) == {("k", 0, 17 * S): (5, 5), ("k", 40 * S, 46 * S): (2, 2)}


@pytest.mark.parametrize("policy", [LatePolicy.DROP, LatePolicy.PROCESS])
def test_sessions_without_lateness_drop_or_skip_late_records(tmp_path: Path, policy: LatePolicy) -> None:
    records, beyond = ref.timeline(7, 300, "r", late=False)
    out = run(tmp_path, session_topology("sum", Options(key_ranges=3, late_policy=policy)), {"src": records})
    want = ref.sessions([r for r in records if r.record_id not in beyond], GAP, "sum")
    assert len(out["out"]) == len(want), "without lateness every session is produced once"
    assert ref.final_sessions(out["out"]) == want


def join_topology(lower: int, upper: int, options: Options) -> Topology:
    code = CodeRef("interval_join", {"lower_us": lower, "upper_us": upper})
    return Topology((ComputationSpec("j", (InputSpec("a"), InputSpec("b")), ("out",), code, options),),
                    (InjectorSpec("ia", "a"), InjectorSpec("ib", "b")))


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
@pytest.mark.parametrize(("lower", "upper"), [(-5 * S, 10 * S), (2 * S, 8 * S), (-20 * S, -1 * S)])
def test_interval_join_with_late_records_matches_the_reference(tmp_path: Path, seed: int, lower: int,
                                                                upper: int) -> None:
    left, beyond_l = ref.timeline(seed, 200, "a", keys=3)
    right, beyond_r = ref.timeline(seed + 100, 200, "b", keys=3)
    opts = Options(key_ranges=2, allowed_lateness_us=LATENESS, late_policy=LatePolicy.ROUTE, late_stream="late")
    out = run(tmp_path, join_topology(lower, upper, opts), {"ia": left, "ib": right})
    assert fields(out["late"]) == fields(r for r in left + right if r.record_id in beyond_l | beyond_r)
    assert all(not r.value.startswith(b"\x00") for r in out["late"]), "routed records are as produced"
    want = ref.joined([r for r in left if r.record_id not in beyond_l],
                      [r for r in right if r.record_id not in beyond_r], lower, upper)
    assert len(want) > 50
    assert ref.join_outputs(out["out"]) == want
    assert len({r.record_id for r in out["out"]}) == len(out["out"])


def test_interval_join_state_is_expired_by_the_watermark(tmp_path: Path) -> None:
    left = [Record("k", json.dumps(i).encode(), i * S, f"a{i}") for i in range(100)]
    right = [Record("k", b'"r"', i * S + S // 2, f"b{i}") for i in range(100)]
    topo = join_topology(0, 1 * S, Options(key_ranges=1))
    store = SQLiteStore(tmp_path / "s.db")
    try:
        runner = LocalRunner(topo, store, {"ia": ListSource(left[:60], 0), "ib": ListSource(right[:60], 0)},
                             batch_size=7)
        runner.run()
        assert store.read_state("j", ["k"], 0).get("k") is None, "a finished run leaves no join state"
        out = [r for _s, r in store.read_log("out", 0, 10**6)]
        assert [json.loads(r.value)["left"] for r in out] == list(range(60))
        assert all(r.timestamp == json.loads(r.value)["right_ts"] for r in out)
    finally:
        store.close()


def test_a_long_running_join_keeps_only_the_open_span(tmp_path: Path) -> None:
    """Mid-run, state holds only what the watermark has not passed by the bounds."""
    topo = join_topology(0, 1 * S, Options(key_ranges=1))
    store = SQLiteStore(tmp_path / "s.db")
    left = [Record("k", b"1", i * S, f"a{i}") for i in range(500)]
    right = [Record("k", b"2", i * S, f"b{i}") for i in range(500)]
    try:
        runner = LocalRunner(topo, store, {"ia": ListSource(left + [Record("k", b"1", 10**9 * S, "end-a")], 0),
                                           "ib": ListSource(right + [Record("k", b"2", 10**9 * S, "end-b")], 0)},
                             batch_size=7)
        while runner.step():
            state = store.read_state("j", ["k"], 0).get("k")
            if state:
                held = json.loads(state)
                assert len(held["l"]) + len(held["r"]) < 60, "state stays bounded by the watermark"
    finally:
        store.close()


def spec_of(code: dict[str, object], inputs: tuple[str, ...] = ("a", "b"), outputs: tuple[str, ...] = ("out",)
            ) -> ComputationSpec:
    return ComputationSpec("c", tuple(InputSpec(s) for s in inputs), outputs,
                           CodeRef(str(code.pop("name")), code))


@pytest.mark.parametrize(("code", "inputs", "outputs", "message"), [
    ({"name": "session_window"}, ("a",), ("out",), "'c'.code.params.gap_us: required"),
    ({"name": "session_window", "gap_us": 0}, ("a",), ("out",), "gap_us: must be >= 1"),
    ({"name": "session_window", "gap_us": 10**20}, ("a",), ("out",), f"gap_us: must be <= {MAX_DURATION_US}"),
    ({"name": "session_window", "gap_us": 5, "aggregation": "median"}, ("a",), ("out",), "aggregation: 'median'"),
    ({"name": "session_window", "gap_us": 5, "allowed_lateness_us": -1}, ("a",), ("out",),
     "allowed_lateness_us: must be >= 0"),
    ({"name": "session_window", "gap_us": 5}, ("a",), (), "'c'.outputs:"),
    ({"name": "session_window", "gap_us": 5, "size_us": 5}, ("a",), ("out",), "unknown parameters ['size_us']"),
    ({"name": "interval_join", "lower_us": 0, "upper_us": 1}, ("a",), ("out",), "exactly two different streams"),
    ({"name": "interval_join", "lower_us": 0, "upper_us": 1}, ("a", "a"), ("out",), "exactly two different"),
    ({"name": "interval_join", "upper_us": 1}, ("a", "b"), ("out",), "params.lower_us: required"),
    ({"name": "interval_join", "lower_us": 2, "upper_us": 1}, ("a", "b"), ("out",), "upper_us: must be >= lower_us"),
    ({"name": "interval_join", "lower_us": -10**19, "upper_us": 1}, ("a", "b"), ("out",), "lower_us: must be >="),
    ({"name": "interval_join", "lower_us": 0, "upper_us": "1"}, ("a", "b"), ("out",), "upper_us: expected an integer"),
    ({"name": "interval_join", "lower_us": 0, "upper_us": 1, "left": "x"}, ("a", "b"), ("out",),
     "params.left: stream 'x' is not one of its inputs"),
    ({"name": "interval_join", "lower_us": 0, "upper_us": 1, "left": "b", "right": "b"}, ("a", "b"), ("out",),
     "params.right: must differ from left"),
    ({"name": "interval_join", "lower_us": 0, "upper_us": 1}, ("a", "b"), (), "'c'.outputs:"),
    ({"name": "interval_join", "lower_us": 0, "upper_us": 1, "output": "nope"}, ("a", "b"), ("out",),
     "params.output: stream 'nope'"),
])
def test_bad_specs_name_the_field(code: dict[str, object], inputs: tuple[str, ...], outputs: tuple[str, ...],
                                  message: str) -> None:
    spec = spec_of(dict(code), inputs, outputs)
    with pytest.raises(InvalidSpecError, match="computation 'c'") as exc:
        validate_spec(spec)
    assert message in str(exc.value)
    with pytest.raises(InvalidSpecError):
        build_computation(spec)


def test_yaml_spec_with_both_operators_loads_and_builds(tmp_path: Path) -> None:
    path = tmp_path / "spec.yaml"
    path.write_text("""
injectors:
  - {name: clicks, stream: clicks}
  - {name: views, stream: views}
computations:
  - name: sessions
    inputs: [{stream: clicks}]
    outputs: [sessions]
    code: {name: session_window, params: {gap_us: 1800000000, aggregation: count}}
  - name: joined
    inputs: [{stream: views}, {stream: clicks}]
    outputs: [pairs]
    code: {name: interval_join, params: {left: clicks, lower_us: 0, upper_us: 60000000}}
""")
    topo = topology_from_dict(load_spec_file(path))
    join = build_computation(topo.computation("joined"))
    assert (join.left, join.right) == ("clicks", "views")  # type: ignore[attr-defined]
    build_computation(topo.computation("sessions"))
