"""Savepoints on real services: a controller and two workers (subprocesses, gRPC on
loopback), SQLite on one side and a real redis-server on the other.

A savepoint is taken mid-stream while records are being injected; the first service's
output up to the cut plus what a second service, restored from the file on Redis,
emits after it (fed every record the cut may have missed) must equal the failure-free
run exactly: each window once. Corrupt, truncated and foreign files are refused with a
message saying what is wrong and write nothing (a good restore still finds the service
empty afterwards); a restore into a non-empty service is refused; stop with savepoint
stops the source service at the cut. The shared scenario is tests/support/savepoints.py
(also run against Redis Cluster: test_service_savepoint_cluster.py).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from millwheel.errors import InvalidSpecError, PermissionDeniedError
from services.rpc.status import PreconditionError
from tests.support.redis_server import RedisServer
from tests.support.savepoints import (
    BATCH,
    flipped,
    forged,
    log_entries,
    mid_stream,
    records,
    run_cli,
    send_restore,
    start,
    topology,
)
from tests.support.service_cluster import wait_for

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def test_savepoint_mid_stream_sqlite_to_redis_exact(tmp_path: Path) -> None:
    with RedisServer() as redis:
        mid_stream(tmp_path, None, redis.url)


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
        "flipped.mwsp": flipped(data),
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
                send_restore(dst, content)
        # A well-checksummed file whose contents are refused: code outside --allow-code,
        # and a frame naming a node its registry does not have.
        with pytest.raises(PermissionDeniedError):
            send_restore(dst, forged({"computations": [{"name": "evil", "inputs": [{"stream": "x"}], "outputs": [],
                                                        "code": {"name": "os:system"}}]}))
        with pytest.raises(InvalidSpecError, match="not in the savepoint's registry"):
            send_restore(dst, forged({"injectors": [{"name": "e", "stream": "e"}]},
                                     [{"t": "range", "node": "elsewhere", "range": 0}]))
        assert not dst.client.computations().computations and not dst.client.status().ranges
        # Nothing was written: the good file still finds the service empty.
        code, out, err = run_cli("savepoint", "restore", str(path), "--controller", dst.address)
        assert code == 0, err
        assert [c.spec.name for c in dst.client.computations().computations] == ["tag", "counts"]
        assert [rec for _seq, rec in log_entries(dst, "counts")] == [rec for _seq, rec in emitted]
        with pytest.raises(PreconditionError, match="empty service"):
            send_restore(dst, data)
    finally:
        dst.stop()
