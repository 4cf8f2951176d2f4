"""The small parts of liveness and deadlines, without a cluster: the progress block a
worker shares with its watchdog, the isolation plan for records that overran, the
splitting of large Inject messages, max_batch_seconds on the wire, and the restarts of
``millwheel up`` (with real, short-lived processes)."""

from __future__ import annotations

import subprocess
import sys
import time

from millwheel.record import Record
from millwheel.topology import CodeRef, ComputationSpec, InputSpec, Options
from services.cli.restarter import Restarter
from services.controller.inject_split import split
from services.generated import millwheel_pb2 as pb
from services.rpc import convert
from services.worker import overruns
from services.worker.progress import MAX_IDS, ProgressBlock


def records(n: int) -> list[Record]:
    return [Record(f"k{i}", b"v", i, f"id-{i}") for i in range(n)]


def test_progress_block_shows_running_batches_to_a_second_mapping() -> None:
    worker = ProgressBlock()
    watchdog = ProgressBlock(worker.fd)  # what the watchdog maps (same memfd)
    assert watchdog.running() == []
    with worker.batch("count", 3, 17, 2.5, records(MAX_IDS + 10)):
        with worker.batch("other", 0, 1, 60.0, ids=["timer\x1fk\x1ft\x1f5"]):
            running = sorted(watchdog.running(), key=lambda r: r.computation)
            assert [(r.computation, r.range_id, r.token, r.deadline_s, r.n_ids) for r in running] == [
                ("count", 3, 17, 2.5, MAX_IDS + 10), ("other", 0, 1, 60.0, 1)]
            assert watchdog.record_ids(running[0]) == [f"id-{i}" for i in range(MAX_IDS)]
            assert watchdog.record_ids(running[1]) == ["timer\x1fk\x1ft\x1f5"]
            assert time.monotonic() - running[0].start < 5
    assert watchdog.running() == []
    worker.heartbeat_ok()
    assert abs(watchdog.last_heartbeat() - time.monotonic()) < 5


def test_plan_runs_suspects_alone_in_order_and_refuses_those_that_overran_alone() -> None:
    rs = records(6)
    seen = {"id-1": {"overruns": 1, "alone": False}, "id-4": {"overruns": 2, "alone": True}}
    segments, refused = overruns.plan(rs, seen)
    assert [[r.record_id for r in s] for s in segments] == [["id-0"], ["id-1"], ["id-2", "id-3"], ["id-5"]]
    assert [r.record_id for r in refused] == ["id-4"]


def test_split_keeps_order_counts_and_puts_the_watermark_on_the_last_piece() -> None:
    batch = pb.DeliverBatch(computation="injector:e", inject_session="s", topology_version=3, watermark=99)
    batch.records.extend(pb.Record(key="k", id=f"r{i}") for i in range(12))
    pieces = list(split(batch, 5))
    assert [len(p.records) for p, _ in pieces] == [5, 5, 2]
    assert [last for _, last in pieces] == [False, False, True]
    assert [r.id for p, _ in pieces for r in p.records] == [f"r{i}" for i in range(12)]
    assert [p.HasField("watermark") for p, _ in pieces] == [False, False, True]
    assert all(p.inject_session == "s" and p.topology_version == 3 for p, _ in pieces)
    assert list(split(batch, 12)) == [(batch, True)]


def test_max_batch_seconds_crosses_the_wire() -> None:
    spec = ComputationSpec("c", (InputSpec("s"),), ("o",), CodeRef("map", {}), Options(max_batch_seconds=2.5))
    assert convert.spec_from_proto(convert.spec_to_proto(spec)).options.max_batch_seconds == 2.5
    default = ComputationSpec("c", (InputSpec("s"),), ("o",), CodeRef("map", {}))
    assert convert.spec_from_proto(convert.spec_to_proto(default)).options.max_batch_seconds == 60.0


def test_restarter_replaces_a_dead_worker_after_its_backoff() -> None:
    def spawn() -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])

    dying = subprocess.Popen([sys.executable, "-c", "pass"])
    dying.wait()
    procs = [spawn(), dying]
    r = Restarter(procs, 1, spawn, base_s=0.2)
    try:
        r.check()
        assert procs[1] is dying  # scheduled, not yet due
        deadline = time.monotonic() + 5
        while procs[1] is dying and time.monotonic() < deadline:
            time.sleep(0.05)
            r.check()
        assert procs[1] is not dying and procs[1].poll() is None
        assert r.delay_s == 0.4  # the next restart would wait longer
    finally:
        for p in procs:
            p.kill()
            p.wait()
