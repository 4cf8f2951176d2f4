"""Savepoints on real services: a controller and two workers (subprocesses, gRPC on
loopback), SQLite on one side and a real redis-server on the other.

A savepoint is taken mid-stream while records are being injected; the first service's
output up to the cut plus what a second service, restored from the file on Redis,
emits after it (fed every record the cut may have missed) must equal the failure-free
run exactly: each window once. Corrupt, truncated and foreign files are refused with a
message saying what is wrong and write nothing (a good restore still finds the service
empty afterwards); a restore into a non-empty service is refused; stop with savepoint
stops the source service at the cut.
"""

from __future__ import annotations

import contextlib
import io
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from millwheel.errors import InvalidSpecError, PermissionDeniedError
from millwheel.record import Record
from millwheel.savepoint.format import Writer
from millwheel.sources import ListSource
from millwheel.topology import CodeRef, ComputationSpec, InjectorSpec, InputSpec, Options, Topology
from services.cli import main as cli
from services.rpc.status import PreconditionError
from tests.integration.service_cluster import Cluster, expected_outputs, wait_for
from tests.support.redis_server import RedisServer

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
SECOND = 1_000_000
N = 1200
BATCH = 40
CUT_AT = 12  # inject messages before the savepoint starts


def topology() -> Topology:
    tag = ComputationSpec("tag", (InputSpec("events"),), ("tagged",), CodeRef("map", {"value": "'t:' + value"}),
                          Options(key_ranges=3))
    counts = ComputationSpec("counts", (InputSpec("tagged"),), ("counts",),
                             CodeRef("window_aggregate", {"size_us": 2 * SECOND, "aggregation": "count"}),
                             Options(key_ranges=2))
    return Topology((tag, counts), (InjectorSpec("events", "events"),), ("counts",))


class _Enough(Exception):
    """Ends the feed of the first service once its savepoint is taken."""


def records() -> list[Record]:
    return [Record(f"k{i % 7}", f"r{i}".encode(), 1_000 * SECOND + i * 50_000, f"id{i}") for i in range(N)]


def run_cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli(list(args))
    return code, out.getvalue(), err.getvalue()


def log_entries(c: Cluster, stream: str) -> list[tuple[int, tuple[str, bytes, int, str]]]:
    return [(seq, (r.key, r.value, r.timestamp, r.record_id)) for seq, r in c.client.subscribe(stream)]


def start(tmp: Path, name: str, store_url: str | None = None, workers: int = 2) -> Cluster:
    d = tmp / name
    d.mkdir()
    c = Cluster(d, store_url=store_url)
    c.start_controller()
    for _ in range(workers):
        c.start_worker()
    return c


def test_savepoint_mid_stream_sqlite_to_redis_exact(tmp_path: Path) -> None:
    import json

    topo, recs = topology(), records()
    path = tmp_path / "cut.mwsp"
    first = start(tmp_path, "first")
    try:
        first.register(topo)
        first.wait_balanced()
        started = threading.Event()
        done_before: list[int] = []  # messages fully accepted before the savepoint began
        created: dict[str, Any] = {}

        def take() -> None:
            created["result"] = run_cli("savepoint", "create", str(path), "--controller", first.address, "--json")

        side = threading.Thread(target=take)

        def between(i: int) -> None:
            time.sleep(0.02)
            if i == CUT_AT:
                done_before.append(i + 1)
                started.set()
                side.start()
            if started.is_set() and not side.is_alive():
                raise _Enough  # the savepoint is taken: stop feeding the first service

        with contextlib.suppress(_Enough):
            first.inject("events", "events", recs, batch=BATCH, between=between)
        side.join(120)
        code, out, err = created["result"]
        assert code == 0, err
        summary = json.loads(out)
        assert summary["counts"]["ranges"] == 1 + 3 + 2 and summary["computations"] == 2
        cut = summary["log_last"].get("counts", 0)
        before = [rec for seq, rec in log_entries(first, "counts") if seq <= cut]
    finally:
        first.stop()

    with RedisServer() as redis:
        second = start(tmp_path, "second", store_url=redis.url)
        try:
            code, out, err = run_cli("savepoint", "restore", str(path), "--controller", second.address, "--json")
            assert code == 0, err
            restored = json.loads(out)
            assert [c.spec.name for c in second.client.computations().computations] == ["tag", "counts"]
            assert {v.name: v.version for v in second.client.status().versions} == {"tag": 1, "counts": 1}
            second.wait_balanced()
            # Everything the cut may lack: from the first message not surely in it, IDs kept.
            rest = recs[done_before[0] * BATCH:]
            second.inject("events", "events", rest, batch=BATCH, done=True)
            second.wait_watermark("counts", timeout=120)
            mark = restored["restored_log_last"].get("counts", 0)
            after = [rec for seq, rec in log_entries(second, "counts") if seq > mark]
            # The restored log holds the first service's entries up to the cut, in order.
            assert [rec for seq, rec in log_entries(second, "counts") if seq <= mark] == before
        finally:
            second.stop()

    want = expected_outputs(tmp_path, topo, {"events": ListSource(recs)}, ("counts",))["counts"]
    assert before and after, "the cut should fall mid-stream"
    assert sorted(before + after) == want  # each window exactly once, none missing


def test_refused_files_write_nothing_and_stop_with_savepoint(tmp_path: Path) -> None:
    topo, recs = topology(), records()[:400]
    path = tmp_path / "stop.mwsp"
    src = start(tmp_path, "src")
    try:
        src.register(topo)
        src.wait_balanced()
        src.inject("events", "events", recs[:200], batch=BATCH)
        wait_for(lambda: log_entries(src, "counts"), 60, "some windows to close")
        code, out, err = run_cli("savepoint", "create", str(path), "--stop", "--controller", src.address)
        assert code == 0, err
        assert "stopped" in out
        with pytest.raises(PreconditionError, match="stopped with a savepoint"):
            src.client.inject_records("events", recs[200:240])
        emitted = log_entries(src, "counts")
        time.sleep(2)  # nothing runs after the cut: the log stays as it was
        assert log_entries(src, "counts") == emitted
        assert all(not r.worker_id for r in src.client.status().ranges)
    finally:
        src.stop()

    data = path.read_bytes()
    bad = {
        "flipped.mwsp": data[:len(data) // 2] + bytes([data[len(data) // 2] ^ 0x01]) + data[len(data) // 2 + 1:],
        "truncated.mwsp": data[:len(data) - 100],
        "foreign.mwsp": b"PK\x03\x04 this is a zip, not a savepoint" + bytes(200),
    }
    dst = start(tmp_path, "dst", workers=1)
    try:
        for name, content in bad.items():
            f = tmp_path / name
            f.write_bytes(content)
            code, _out, err = run_cli("savepoint", "restore", str(f), "--controller", dst.address)
            assert code == 2, (name, err)
            assert ("corrupt" in err or "truncated" in err or "not a millwheel savepoint" in err), (name, err)
            # The controller refuses it too (the CLI's own check bypassed).
            with pytest.raises(InvalidSpecError):
                _send(dst, content)
        # A well-checksummed file whose contents are refused: code outside --allow-code,
        # and a frame naming a node its registry does not have.
        with pytest.raises(PermissionDeniedError):
            _send(dst, _forged({"computations": [{"name": "evil", "inputs": [{"stream": "x"}], "outputs": [],
                                                  "code": {"name": "os:system"}}]}))
        with pytest.raises(InvalidSpecError, match="not in the savepoint's registry"):
            _send(dst, _forged({"injectors": [{"name": "e", "stream": "e"}]},
                               [{"t": "range", "node": "elsewhere", "range": 0}]))
        assert not dst.client.computations().computations and not dst.client.status().ranges
        # Nothing was written: the good file still finds the service empty.
        code, out, err = run_cli("savepoint", "restore", str(path), "--controller", dst.address)
        assert code == 0, err
        assert [c.spec.name for c in dst.client.computations().computations] == ["tag", "counts"]
        assert [rec for _seq, rec in log_entries(dst, "counts")] == [rec for _seq, rec in emitted]
        with pytest.raises(PreconditionError, match="empty service"):
            _send(dst, data)
    finally:
        dst.stop()


def _send(c: Cluster, content: bytes) -> Any:
    from services.generated import millwheel_pb2 as pb

    try:
        return c.client.stub.RestoreSavepoint(iter([pb.RestoreSavepointRequest(chunk=content)]), timeout=60)
    except Exception as exc:
        if hasattr(exc, "code"):
            raise c.client.error(exc) from None  # type: ignore[arg-type]
        raise


def _forged(registry: dict[str, Any], frames: list[dict[str, Any]] = ()) -> bytes:  # type: ignore[assignment]
    buf = io.BytesIO()
    w = Writer(buf)
    w.frame({"t": "header", "created_us": 1, "stopped": False, "registry": registry})
    for fr in frames:
        w.frame(fr)
    w.finish()
    return buf.getvalue()
