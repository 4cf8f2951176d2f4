"""Late records counted per input stream, in the service (issue 33, "Late data visible").

A computation reads two injectors' streams, ``clicks`` and ``views``; only clicks
gets records behind the watermark, injected after every range of the computation
reported a watermark past them (so each is late where it arrives, whatever the
timing). ``DescribeComputation``, ``millwheel errors`` and ``millwheel status``, the
workers' ``millwheel_late_records_total{input}`` and the console's JSON then show
exactly what was planted, per input: views 0. A batch sent straight to a worker
naming two streams per record, and one naming none (as a dead-letter replay or an
older worker sends), is counted per stream, and under "" shown as "(replay)".
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from millwheel.keys import KeyExtractor, key_range
from millwheel.record import Record
from millwheel.topology import CodeRef, ComputationSpec, InjectorSpec, InputSpec, LatePolicy, Options, Topology
from services.generated import millwheel_pb2 as pb
from services.generated import millwheel_pb2_grpc as pb_grpc
from services.metrics import scrape
from services.rpc.server import channel
from tests.support.redis_server import free_port
from tests.support.service_cluster import ROOT, Cluster, wait_for

pytestmark = pytest.mark.timeout(300)
S = 1_000_000
T0 = 1_000 * S
ON_TIME = 20


def topology(policy: LatePolicy, lateness: int) -> Topology:
    inputs = (InputSpec("clicks", KeyExtractor("key")), InputSpec("views", KeyExtractor("key")))
    return Topology(
        (ComputationSpec("calc", inputs, ("doubled",), CodeRef("tests.support.faulty:Doubler"),
                         Options(key_ranges=2, late_policy=policy, allowed_lateness_us=lateness)),),
        (InjectorSpec("clicks", "clicks"), InjectorSpec("views", "views")),
    )


def records(prefix: str, timestamps: list[int]) -> list[Record]:
    return [Record(f"k{i % 4}", json.dumps({"amount": i}).encode(), ts, f"{prefix}-{i}")
            for i, ts in enumerate(timestamps)]


def late_of(c: Cluster) -> dict[tuple[str, str], int]:
    return {(x.input, x.action): x.count for x in c.client.describe("calc").late}


def cli(c: Cluster, *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "services.cli", *args, "--controller", c.address],
                          cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def metric(c: Cluster) -> dict[tuple[str, str], float]:
    """``millwheel_late_records_total`` of calc summed over the workers: (input, action) -> n."""
    out: dict[tuple[str, str], float] = {}
    for w in c.client.status().workers:
        for (name, labels), v in scrape(w.metrics_address, 5).items():
            d = dict(labels)
            if name == "millwheel_late_records_total" and d["computation"] == "calc":
                out[(d["input"], d["action"])] = out.get((d["input"], d["action"]), 0) + v
    return out


def console(port: int) -> dict[str, object]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/computation?computation=calc", timeout=10) as r:
        data: dict[str, object] = json.loads(r.read())
    return data


@pytest.fixture
def service(tmp_path: Path) -> Iterator[tuple[Cluster, int]]:
    ui = free_port()
    c = Cluster(tmp_path, allow_code="tests.support.faulty", controller_args=["--ui-port", str(ui)])
    try:
        c.start(workers=2)
        yield c, ui
    finally:
        c.stop()


@pytest.mark.parametrize("policy,lateness,planted", [
    # 3 records 19 s behind the watermark (beyond 10 s of lateness: dropped), 2 within it
    (LatePolicy.DROP, 10 * S, {("clicks", "dropped"): 3, ("clicks", "processed"): 2}),
    (LatePolicy.PROCESS, 0, {("clicks", "processed"): 5}),
])
def test_late_records_are_counted_per_input_where_they_came(
        service: tuple[Cluster, int], policy: LatePolicy, lateness: int,
        planted: dict[tuple[str, str], int]) -> None:
    c, ui = service
    c.register(topology(policy, lateness))
    c.wait_balanced()
    stamps = [T0 + i * S for i in range(ON_TIME)]
    c.inject("views", "views", records("view", stamps))
    c.inject("clicks", "clicks", records("click", stamps))
    c.wait_watermark("calc", stamps[-1])  # every range knows its input watermark is past T0 + 19 s
    behind = records("late", [T0] * 3) + records("near", [T0 + 15 * S] * 2)
    c.inject("clicks", "clicks", behind)
    total = sum(planted.values())
    dropped = planted.get(("clicks", "dropped"), 0)
    wait_for(lambda: len(c.outputs("doubled")) == 2 * ON_TIME + total - dropped, 60, "the late records processed")
    wait_for(lambda: sum(late_of(c).values()) >= total, 30, "the late counts")
    assert late_of(c) == planted  # views: none
    info = c.client.describe("calc")
    assert info.late_dropped == dropped

    shown = {"dropped": "3 dropped, 2 processed", "processed": "5 processed"}["dropped" if dropped else "processed"]
    errors = cli(c, "errors", "calc")
    assert f"per input: clicks {shown}; views 0 late" in errors, errors
    as_json = json.loads(cli(c, "errors", "calc", "--json"))
    assert {(x["input"], x["action"]): x["count"] for x in as_json["late"]} == planted
    status = cli(c, "status")
    assert f"calc: clicks {shown}; views 0 late" in status, status
    assert json.loads(cli(c, "status", "--json"))["late"]["calc"] == as_json["late"]

    sensor = {"dropped": "drop", "processed": "process"}
    assert metric(c) == {(i, sensor[a]): float(n) for (i, a), n in planted.items()}

    wait_for(lambda: any(x["dropped"] + x["processed"] for x in console(ui)["late"]), 30,  # type: ignore[attr-defined, index]
             "the console's snapshot to show the late counts")
    rows = {x["input"]: x for x in console(ui)["late"]}  # type: ignore[attr-defined, index]
    assert set(rows) == {"clicks", "views"}
    for stream, row in rows.items():
        assert (row["label"], row["dropped"], row["processed"], row["routed"]) == (
            stream, planted.get((stream, "dropped"), 0), planted.get((stream, "processed"), 0), 0)


def test_a_batch_naming_two_streams_or_none_is_counted_per_stream(service: tuple[Cluster, int]) -> None:
    """DeliverBatch straight to the owner of a range of calc: its records late on two
    streams, interleaved, in one batch; then a batch that names no stream (what a
    dead-letter replay and a worker older than the field send)."""
    c, _ui = service
    c.register(topology(LatePolicy.DROP, 0))
    c.wait_balanced()
    stamps = [T0 + i * S for i in range(ON_TIME)]
    c.inject("views", "views", records("view", stamps))
    c.inject("clicks", "clicks", records("click", stamps))
    c.wait_watermark("calc", stamps[-1])
    status = c.client.status()
    owner = next(r for r in status.ranges if r.node == "calc" and r.range_id == 0)
    address = next(w.address for w in status.workers if w.worker_id == owner.worker_id)
    keys = [k for k in (f"x{i}" for i in range(100)) if key_range(k, 2) == 0][:5]

    def late(i: int, key: str) -> pb.Record:
        return pb.Record(key=key, value=json.dumps({"amount": i}).encode(), timestamp=T0, id=f"direct-{i}")

    mixed = pb.DeliverBatch(batch_id=1, producer="test", computation="calc", range_id=0,
                            records=[late(i, k) for i, k in enumerate(keys)],
                            streams=["clicks", "views"], stream_of=[0, 1, 1, 0, 1])
    unnamed = pb.DeliverBatch(batch_id=2, producer="replay", computation="calc", range_id=0,
                              records=[late(10 + i, k) for i, k in enumerate(keys[:2])])
    with channel(address) as ch:
        acks = list(pb_grpc.WorkerStub(ch).Deliver(iter([mixed, unnamed]), timeout=30))
    assert [a.status for a in acks] == [pb.DeliverAck.OK] * 2, acks
    assert late_of(c) == {("clicks", "dropped"): 2, ("views", "dropped"): 3, ("", "dropped"): 2}
    assert c.client.describe("calc").late_dropped == 7
    assert "per input: clicks 2 dropped; views 3 dropped; (replay) 2 dropped" in cli(c, "errors", "calc")
