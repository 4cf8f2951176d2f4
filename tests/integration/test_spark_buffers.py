"""Spark stage window buffers: state written before them still fires right, and a
window's buffer goes once its result is checkpointed (real PySpark, local mode)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from millwheel.record import Record, Timer
from millwheel.runtime.local_runner import LocalRunner
from millwheel.sources import ListSource
from millwheel.state.protocol import Checkpoint
from millwheel.state.sqlite_store import SQLiteStore
from millwheel.topology import CodeRef, ComputationSpec, InjectorSpec, InputSpec, Options, Topology

S = 1_000_000


def topology(lateness_us: int = 0) -> Topology:
    spec = ComputationSpec("sp", (InputSpec("in"),), ("sp",),
                           CodeRef("spark_aggregate", {"size_us": 10 * S, "aggregation": "sum"}),
                           Options(key_ranges=1, allowed_lateness_us=lateness_us))
    return Topology((spec,), (InjectorSpec("in", "in"),))


def results(store: SQLiteStore) -> list[tuple[str, int, float, int]]:
    out = [json.loads(r.value) for _s, r in store.read_log("sp", 0, 10**6)]
    return [(v["key"], v["start"], v["value"], v["count"]) for v in out]


def test_a_window_buffered_in_state_before_the_upgrade_fires_with_its_new_records(tmp_path: Path) -> None:
    """The old layout: the key's state is ``META\\n`` plus ``TS\\tJSON`` lines, and the
    end-of-window timer is set. New records of the same window go to the buffer; the
    firing counts both, once, and the key's state and the buffer are gone after it."""
    store = SQLiteStore(str(tmp_path / "up.db"))
    token = store.acquire("sp", 0)
    old_state = b'{"0":0}\n' + f"{1 * S}\t1.5\n{2 * S}\t2.5\n".encode()
    store.checkpoint(Checkpoint("sp", 0, token, 1, state_writes={"a": old_state},
                                timer_sets=[Timer("a", "fire:0:0", 10 * S - 1)]))
    records = [Record("a", b"10", 3 * S, "r1"), Record("b", b"100", 4 * S, "r2"),
               Record("a", b"1000", 12 * S, "r3")]
    runner = LocalRunner(topology(), store, {"in": ListSource(records, 0)}, batch_size=1)
    runner.run(idle_sleep_s=0.001)
    assert sorted(results(store)) == [("a", 0, 14.0, 3), ("a", 10 * S, 1000.0, 1), ("b", 0, 100.0, 1)]
    assert store.list_keys("sp", None, 10) == []
    assert store.list_buffers("sp", 0) == []


@pytest.mark.parametrize("writer_process", [False, True])
def test_late_record_of_one_key_corrects_that_key_only(tmp_path: Path, writer_process: bool) -> None:
    """A window's buffer holds every key's records; a correction fired for one key
    (a late record within the lateness) counts that key's records only. The same with
    the runner's writer process (buffer appends cross its pipe)."""
    store = SQLiteStore(str(tmp_path / "late.db"))
    ts = [("a", 1), ("b", 2), ("b", 3), ("a", 15), ("a", 5), ("c", 6), ("a", 40)]
    records = [Record(k, b"1", t * S, f"r{i}") for i, (k, t) in enumerate(ts)]
    runner = LocalRunner(topology(lateness_us=20 * S), store, {"in": ListSource(records, 0)}, batch_size=1,
                         writer_process=writer_process)
    runner.run(idle_sleep_s=0.001)
    first = [(k, v, n) for k, s, v, n in results(store) if s == 0]
    # on time: a=1, b=2; then a's correction (5 s) counts a's records only; c is new late
    assert first == [("a", 1.0, 1), ("b", 2.0, 2), ("a", 2.0, 2), ("c", 1.0, 1)]
    assert store.list_buffers("sp", 0) == []
