"""A PostgreSQL sink across a savepoint restored onto another store (issue 22).

The sink keeps, in PostgreSQL, the last log position it wrote and the sequencer token
that wrote it. On SQLite the log positions of all streams are one sequence (here the
``tagged`` and ``counts`` logs interleave), on Redis each stream counts from 1, and a
fresh store's tokens start at 1: read as they were, the kept position would make the
restored service's sink skip records and the kept token would refuse its writes. A
service on SQLite is stopped with a savepoint while its sink is behind; the file is
restored into a service on a real redis-server, which gets the rest of the records: the
table must hold every window of the failure-free run, once, and the sink's progress row
a token above the one the first service wrote it with.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from millwheel.connectors.spec import sinks_from_list
from millwheel.sources import ListSource
from millwheel.topology import Topology
from services.rpc.convert import spec_to_proto
from tests.support.postgres_server import PostgresServer
from tests.support.redis_server import RedisServer
from tests.support.savepoints import BATCH, records, run_cli, start, topology
from tests.support.service_cluster import Cluster, expected_outputs, wait_for

pytest.importorskip("psycopg")
pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def register(c: Cluster, topo: Topology, pg_url: str) -> None:
    sinks = sinks_from_list([{"stream": "counts", "type": "postgres", "url": pg_url, "table": "counts"}])
    c.client.register_topology([spec_to_proto(s) for s in topo.computations], [("events", "events")],
                               ["tagged", "counts"], sinks)


def progress(pg: PostgresServer) -> tuple[int, int]:
    import psycopg
    with psycopg.connect(pg.url) as conn:
        row = conn.execute("SELECT token, position FROM millwheel_sink_progress").fetchone()
        return int(row[0]), int(row[1])


def test_a_postgres_sink_goes_on_exactly_after_a_restore_on_another_store(tmp_path: Path) -> None:
    topo, recs = topology(), records()
    half = len(recs) // 2
    path = tmp_path / "stop.mwsp"
    with PostgresServer() as pg, RedisServer() as redis:
        first = start(tmp_path, "first")
        try:
            register(first, topo, pg.url)
            first.wait_balanced()
            first.inject("events", "events", recs[:half], batch=BATCH)
            wait_for(lambda: len(pg.rows("counts")) >= 3, 60, "the sink to write some windows")
            code, _out, err = run_cli("savepoint", "create", str(path), "--stop", "--controller", first.address)
            assert code == 0, err
        finally:
            first.stop()
        token_at_cut, written = progress(pg)
        assert written > 0
        second = start(tmp_path, "second", store_url=redis.url)
        try:
            code, _out, err = run_cli("savepoint", "restore", str(path), "--controller", second.address)
            assert code == 0, err
            second.wait_balanced()
            second.inject("events", "events", recs[half:], batch=BATCH, done=True)
            second.wait_watermark("counts", timeout=120)
            (tmp_path / "expected").mkdir()
            want = expected_outputs(tmp_path / "expected", topo, {"events": ListSource(recs)}, ("counts",))["counts"]
            wanted = sorted((rid, key, ts) for key, _v, ts, rid in want)
            wait_for(lambda: len(pg.rows("counts")) >= len(wanted), 60, "the sink to write every window")
            got = sorted((str(r[0]), str(r[1]), int(r[5])) for r in pg.rows("counts"))  # type: ignore[call-overload]
            assert got == wanted  # each window once (record_id is the key), none skipped
            assert progress(pg)[0] > token_at_cut
        finally:
            second.stop()
