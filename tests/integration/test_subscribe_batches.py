"""Subscribe in batches (SubscribeRequest.max_batch): every record of the log once, in
order, whatever the batch size; the one-record-a-message form of older clients still
served; no message past the size bound with large records; ``millwheel subscribe
--json`` writing exactly what it wrote one record at a time.

A real controller (gRPC on loopback) over a SQLite store whose log was written with the
store's ``append_log``: what is read is what a sink's log holds.
"""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

from millwheel.record import Record
from millwheel.topology import CodeRef, ComputationSpec, InjectorSpec, InputSpec, Options
from services.client import ControllerClient
from services.controller import queries
from services.controller.service import serve
from services.generated import millwheel_pb2 as pb
from services.generated import millwheel_pb2_grpc as pb_grpc
from services.rpc.convert import spec_to_proto
from services.rpc.security import Security

pytestmark = pytest.mark.timeout(180)
ROOT = Path(__file__).resolve().parents[2]
STREAM = "counts"


def log_of(n: int, value: bytes = b'{"count": 1}', start: int = 0) -> list[Record]:
    return [Record(f"user{i % 37}", value, 1_000_000 + i, f"counts/{i}") for i in range(start, start + n)]


@pytest.fixture
def controller(tmp_path: Path) -> Iterator[tuple[ControllerClient, Any, str]]:
    url = f"sqlite:///{tmp_path}/s.db"
    server, port, _m, service = serve(url, port=0, metrics_port=None)
    client = ControllerClient(f"127.0.0.1:{port}", timeout_s=30, security=Security())
    spec = ComputationSpec("counts", (InputSpec("events"),), (STREAM,),
                           CodeRef("window_aggregate", {"size_us": 1_000_000}), Options(key_ranges=2))
    client.register_topology([spec_to_proto(spec)], [InjectorSpec("events", "events")], log_streams=[STREAM])
    try:
        yield client, service.plane.store, f"127.0.0.1:{port}"
    finally:
        client.close()
        service.close()
        server.stop(0)


def test_every_record_once_in_order_whatever_the_batch(controller: tuple[ControllerClient, Any, str]) -> None:
    client, store, _address = controller
    records = log_of(12_345)
    for i in range(0, len(records), 5_000):
        store.append_log(STREAM, records[i:i + 5_000])
    want = [r.record_id for r in records]
    for size in (1, 7, 1_000, 50_000):
        batches = list(client.subscribe_batches(STREAM, max_batch=size))
        assert all(1 <= len(b) <= min(size, queries.MAX_SUBSCRIBE_BATCH) for b in batches)
        got = [(seq, rec) for b in batches for seq, rec in b]
        assert [rec.record_id for _seq, rec in got] == want
        assert [rec for _seq, rec in got] == records  # key, value, timestamp, ID as written
        seqs = [seq for seq, _rec in got]
        assert seqs == sorted(set(seqs))
    # the one-record-a-message form (a client from before max_batch) is served as before
    singles = list(client.subscribe_batches(STREAM, max_batch=0))
    assert all(len(b) == 1 for b in singles) and [b[0][1] for b in singles] == records
    # resuming after a position reads the rest, once
    middle = seqs[6_000]
    assert [r.record_id for _s, r in client.subscribe(STREAM, after_seq=middle)] == want[6_001:]


def test_large_records_never_make_a_message_past_the_bound(controller: tuple[ControllerClient, Any, str]) -> None:
    _client, store, address = controller
    big = log_of(12, value=b"x" * (1 << 20))
    store.append_log(STREAM, big)
    import grpc

    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.ControllerStub(ch)
        msgs = list(stub.Subscribe(pb.SubscribeRequest(stream=STREAM, max_batch=10_000), timeout=60))
    assert [r.id for m in msgs for r in m.records] == [r.record_id for r in big]
    assert len(msgs) >= 3  # 12 MiB in messages of about 4 MiB
    assert all(m.ByteSize() <= queries.SUBSCRIBE_BATCH_BYTES + (1 << 20) + 4096 for m in msgs)
    assert all(len(m.seqs) == len(m.records) and not m.HasField("record") for m in msgs)


def test_the_cli_writes_what_it_wrote_one_record_at_a_time(controller: tuple[ControllerClient, Any, str]) -> None:
    _client, store, address = controller
    odd = [Record('k"\\q', 'naïve "value"\n\t✓'.encode(), 5, "odd/1"), Record("日本", b"\xff\xfe", 6, "odd/2")]
    records = [*log_of(2_500), *odd]
    store.append_log(STREAM, records)
    done = subprocess.run([sys.executable, "-m", "services.cli", "subscribe", STREAM, "--json",
                           "--controller", address], cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == len(records)
    seqs = [json.loads(line)["seq"] for line in lines]
    # the very text json.dumps gives for each entry, as the command printed before batches
    assert lines == [json.dumps({"seq": seq, "key": r.key, "value": r.value.decode("utf-8", "replace"),
                                 "timestamp": r.timestamp, "id": r.record_id})
                     for seq, r in zip(seqs, records, strict=True)]
    table = subprocess.run([sys.executable, "-m", "services.cli", "subscribe", STREAM, "--controller", address],
                           cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
                           capture_output=True, text=True, timeout=120)
    assert table.returncode == 0, table.stderr
    rows = table.stdout.splitlines()
    assert rows[0].split() == ["SEQ", "TIMESTAMP", "(UTC)", "KEY", "VALUE"] and len(rows) == len(records) + 2
    when = (dt.datetime(1970, 1, 1, tzinfo=dt.UTC) + dt.timedelta(microseconds=records[0].timestamp))
    assert rows[1] == (f"{seqs[0]:>8}  {when.strftime('%Y-%m-%dT%H:%M:%S.%fZ'):<27}  {records[0].key}  "
                       f"{records[0].value.decode()}")  # a time people read, to the microsecond
