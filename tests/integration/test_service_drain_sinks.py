"""Drain (``millwheel savepoint create FILE --drain``) with a connector sink: a Redis
stream -> 3 stages -> PostgreSQL on a real controller and two real workers (gRPC on
loopback, real redis-server and PostgreSQL).

The drain closes the injector, so every open window fires; the sink must then write
the results to PostgreSQL before the drain stops the service. A sink held back (its
table locked by another session) keeps the drain waiting, named in its progress, and
once the lock goes the drain ends with the table equal, row by row, to the failure-free
run's (local mode over the same entries, ``until: end``). A sink that cannot write (its
table refuses every new row) makes the drain time out naming the sink; with the table
fixed, the drain run again finishes with the whole table.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_connectors_service import reference_rows, register
from tests.support.connector_pipeline import entries
from tests.support.postgres_server import PostgresServer
from tests.support.redis_server import RedisServer
from tests.support.service_cluster import ROOT, Cluster, wait_for

pytest.importorskip("psycopg")
pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]
N = 600


class Drain:
    """``millwheel savepoint create FILE --drain`` as a process, its stderr read as it comes."""

    def __init__(self, cluster: Cluster, path: Path, timeout_s: float) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "savepoint", "create", str(path), "--drain", "--timeout",
             str(timeout_s), "--controller", cluster.address],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.err: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.err.append(line)

    def line_with(self, text: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            found = [line for line in self.err if text in line]
            if found:
                return found[-1]
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self._reader.join(5)
                raise AssertionError(f"no {text!r} on the drain's stderr (status {self.proc.poll()}): "
                                     f"{''.join(self.err)}")
            time.sleep(0.05)

    def wait(self, timeout: float = 120) -> tuple[int, str, str]:
        # Not communicate(): it would read stderr too, racing the reader thread for the
        # last lines (seen: the drain's final error went to communicate and was lost).
        assert self.proc.stdout is not None
        out: list[str] = []
        reader = threading.Thread(target=lambda: out.append(self.proc.stdout.read()), daemon=True)  # type: ignore[union-attr]
        reader.start()
        self.proc.wait(timeout=timeout)
        reader.join(5)
        self._reader.join(5)
        return self.proc.returncode, "".join(out), "".join(self.err)


def started(tmp_path: Path, redis_url: str, pg: PostgresServer, items: list[dict[str, str]]) -> Cluster:
    """A service running the pipeline over ``items`` (followed, never ended): every entry
    read, the sink writing, the windows after the last watermark still open."""
    import redis
    cluster = Cluster(tmp_path)
    cluster.start_controller()
    cluster.start_worker()
    cluster.start_worker()
    register(cluster, tmp_path, redis_url, pg.url)
    r = redis.Redis.from_url(redis_url)
    for e in items:
        r.xadd("events", e)
    # Every entry read (max_disorder 0: the injector's watermark is the last timestamp
    # read), so closing the injector loses nothing; some windows already in the table.
    cluster.wait_watermark("injector:ev", int(items[-1]["timestamp"]), timeout=120)
    wait_for(lambda: len(pg.rows("sums")) > 0, 60, "rows in the table")
    return cluster


@pytest.fixture
def servers() -> Any:
    with RedisServer() as redis_server, PostgresServer() as pg:
        yield redis_server, pg


def test_drain_waits_for_a_sink_held_back_until_postgres_holds_every_row(servers: Any, tmp_path: Path) -> None:
    import psycopg
    redis_server, pg = servers
    items = entries(N)
    ref = reference_rows(tmp_path, redis_server.url, pg, items)
    cluster = started(tmp_path, redis_server.url, pg, items)
    try:
        assert len(pg.rows("sums")) < len(ref)  # the last windows are still open
        with psycopg.connect(pg.url) as holder:
            # Another session holds the table: the sink's next insert waits on it.
            holder.execute("LOCK TABLE sums IN ACCESS EXCLUSIVE MODE")
            drain = Drain(cluster, tmp_path / "final.mwsp", 120)
            line = drain.line_with("sink sums.postgres", 60)
            assert "sinks behind" in line and "records to write" in line, line
            time.sleep(2.0)
            assert drain.proc.poll() is None, "the drain must wait for the sink"
            holder.rollback()  # the lock goes; the sink writes on
        while drain.proc.poll() is None:
            time.sleep(0.05)
        got_at_end = pg.rows("sums")  # the table as the drain ends
        code, out, err = drain.wait()
        assert code == 0, err
        assert got_at_end == ref  # every row, record by record, when the drain ended
        assert "drained: every window fired" in out and "drained in" in err
        time.sleep(1.0)
        assert pg.rows("sums") == ref  # and nothing more (nothing twice) afterwards
        assert all(not r.worker_id for r in cluster.client.status().ranges)  # stopped
    finally:
        cluster.stop()


def test_a_sink_that_cannot_write_makes_the_drain_time_out_naming_it(servers: Any, tmp_path: Path) -> None:
    import psycopg
    redis_server, pg = servers
    items = entries(N)
    ref = reference_rows(tmp_path, redis_server.url, pg, items)
    cluster = started(tmp_path, redis_server.url, pg, items)
    try:
        with psycopg.connect(pg.url, autocommit=True) as conn:
            # Every new row refused (the rows there stay): the sink fails each write.
            conn.execute("ALTER TABLE sums ADD CONSTRAINT no_more_rows CHECK (false) NOT VALID")
        path = tmp_path / "never.mwsp"
        # 20 s: under load the watermarks alone can take several seconds to reach +inf, and a
        # timeout before the drain gets to the sinks names a range instead of the sink
        code, _out, err = Drain(cluster, path, 20).wait()
        assert code == 2, err
        assert "drain not finished" in err and "left draining" in err, err
        assert "sink sums.postgres at log position" in err and "failing to write for" in err, err
        assert not path.exists()
        assert all(r.worker_id for r in cluster.client.status().ranges)  # not stopped
        short = pg.rows("sums")
        assert len(short) < len(ref)
        with psycopg.connect(pg.url, autocommit=True) as conn:
            conn.execute("ALTER TABLE sums DROP CONSTRAINT no_more_rows")
        # The drain run again waits on from there, and ends with the whole table.
        code, out, err = Drain(cluster, tmp_path / "final.mwsp", 120).wait()
        assert code == 0, err
        assert pg.rows("sums") == ref
        assert "drained: every window fired" in out
    finally:
        cluster.stop()
