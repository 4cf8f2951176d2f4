"""Each sink on its real server: a retry writes nothing twice, an older token writes
nothing once a newer one took the sink over, and the table/stream holds what was sent."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest

from millwheel.errors import ConnectorError, FencedError
from millwheel.record import Record
from tests.support.postgres_server import PostgresServer
from tests.support.redis_server import RedisServer

pytest.importorskip("psycopg")


def batch(first: int, n: int) -> list[tuple[int, Record]]:
    return [(p, Record(f"k{p % 3}", json.dumps({"start": 0, "end": 10, "value": p}).encode(), 9, f"r{p}"))
            for p in range(first, first + n)]


@pytest.fixture(scope="module")
def pg() -> Any:
    with PostgresServer() as server:
        yield server


def test_postgres_sink_retry_and_zombie(pg: PostgresServer) -> None:
    from millwheel.connectors.postgres import PostgresSink
    old = PostgresSink({"url": pg.url, "table": "t1"})
    assert old.open("s", 0, token=1) == 0
    assert old.write_batch(batch(1, 5), 1) == 5
    assert old.write_batch(batch(1, 8), 1) == 8  # a retry overlapping what was written: 6..8 added
    new = PostgresSink({"url": pg.url, "table": "t1"})
    assert new.open("s", 0, token=2) == 8  # resumes after the last position written
    with pytest.raises(FencedError):
        old.write_batch(batch(9, 3), 1)  # the zombie's transaction fails on the token
    assert new.write_batch(batch(9, 2), 2) == 10
    rows = pg.rows("t1")
    assert [r[0] for r in rows] == sorted(f"r{p}" for p in range(1, 11))  # each once
    assert rows[0][2:5] == (0, 10, {"start": 0, "end": 10, "value": 1})  # window start/end, JSONB value
    for sink in (old, new):
        sink.close()


def test_postgres_sink_a_writer_stalled_in_its_transaction_does_not_block_the_new_owner(
        pg: PostgresServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A zombie stopped between its progress-row lock and its commit (seen: a worker
    SIGSTOPped there; the new owner's INSERT waited on its lock until the test's end)."""
    from millwheel.connectors import postgres
    monkeypatch.setattr(postgres, "STALLED_TRANSACTION_MS", 1500)
    old = postgres.PostgresSink({"url": pg.url, "table": "t3"})
    assert old.open("s", 0, token=1) == 0
    assert old.write_batch(batch(1, 5), 1) == 5
    # The zombie's next batch stops after its lock: the transaction is open, nothing more is sent.
    old.conn.execute(f"SELECT token FROM {postgres.PROGRESS_TABLE} WHERE sink = 's@t3' FOR UPDATE")
    new = postgres.PostgresSink({"url": pg.url, "table": "t3"})
    opened: list[int] = []
    taker = threading.Thread(target=lambda: opened.append(new.open("s", 0, token=2)), daemon=True)
    started = time.monotonic()
    taker.start()
    taker.join(30)
    assert opened == [5], "the new owner still waits on the stalled writer's lock after 30 s"
    print(f"the new owner opened after {time.monotonic() - started:.1f} s")
    assert new.write_batch(batch(6, 3), 2) == 8
    # The zombie resumes: its session was ended, and once reconnected the token fences it.
    with pytest.raises(ConnectorError):
        old.write_batch(batch(6, 10), 1)
    with pytest.raises(FencedError):
        old.write_batch(batch(6, 10), 1)
    assert [r[0] for r in pg.rows("t3")] == sorted(f"r{p}" for p in range(1, 9))
    for sink in (old, new):
        sink.close()


def test_postgres_sink_down_is_a_connector_error_without_the_password(pg: PostgresServer) -> None:
    from millwheel.connectors.postgres import PostgresSink
    sink = PostgresSink({"url": f"postgresql://mw:sekrit@127.0.0.1:{pg.port + 1}/postgres", "table": "t"})
    with pytest.raises(ConnectorError) as err:
        sink.open("s", 0, 1)
    assert "sekrit" not in str(err.value) and "mw:***@" in str(err.value)


def test_redis_stream_sink_retry_and_zombie() -> None:
    import redis

    from millwheel.connectors.redis_stream import RedisStreamSink
    with RedisServer() as server:
        old = RedisStreamSink({"url": server.url, "redis_stream": "out"})
        assert old.open("s", 0, 1) == 0
        assert old.write_batch(batch(1, 4), 1) == 4
        assert old.write_batch(batch(3, 4), 1) == 6  # 3 and 4 again: skipped
        new = RedisStreamSink({"url": server.url, "redis_stream": "out"})
        assert new.open("s", 0, 2) == 6
        with pytest.raises(FencedError):
            old.write_batch(batch(7, 2), 1)
        got = redis.Redis.from_url(server.url).xrange("out")
        assert [f[b"id"].decode() for _i, f in got] == [f"r{p}" for p in range(1, 7)]
        for sink in (old, new):
            sink.close()


def test_nats_jetstream_sink_retry_and_zombie() -> None:
    pytest.importorskip("nats")
    from millwheel.connectors.nats_jetstream import JetStreamSink
    from tests.support.nats_server import NatsServer
    with NatsServer() as server:
        settings = {"url": server.url, "subject": "out.sums", "jetstream": "OUT"}
        old = JetStreamSink(settings)
        assert old.open("s", 0, 1) == 0
        assert old.write_batch(batch(1, 4), 1) == 4
        assert old.write_batch(batch(3, 4), 1) == 6  # 3 and 4 again: skipped
        new = JetStreamSink(settings)
        assert new.open("s", 0, 2) == 6  # from the subject's last message
        assert new.write_batch(batch(7, 1), 2) == 7
        with pytest.raises(ConnectorError, match="another writer published"):
            old.write_batch(batch(8, 2), 1)  # another writer published since: refused
        assert [m["id"] for m in server.read("OUT", "out.sums")] == [f"r{p}" for p in range(1, 8)]
        for sink in (old, new):
            sink.close()


def test_postgres_sink_upserts_onto_an_existing_table(pg: PostgresServer) -> None:
    """``columns`` + ``upsert_key``: an existing table keeps the latest value per key;
    a retried batch changes nothing; the table is not created by the sink."""
    import psycopg

    from millwheel.connectors.postgres import PostgresSink
    with psycopg.connect(pg.url, autocommit=True) as conn:
        conn.execute("CREATE TABLE latest (user_id TEXT PRIMARY KEY, payload JSONB, event_time BIGINT)")
    settings = {"url": pg.url, "table": "latest", "upsert_key": ["user_id"],
                "columns": {"key": "user_id", "value": "payload", "ts": "event_time"}}
    sink = PostgresSink(settings)
    assert sink.open("u", 0, 1) == 0
    first = [(p, Record(f"u{p % 2}", json.dumps({"n": p}).encode(), p, f"r{p}")) for p in range(1, 5)]
    assert sink.write_batch(first, 1) == 4
    assert sink.write_batch(first, 1) == 4  # a retry: nothing
    with psycopg.connect(pg.url) as conn:
        rows = conn.execute("SELECT user_id, payload, event_time FROM latest ORDER BY user_id").fetchall()
    assert rows == [("u0", {"n": 4}, 4), ("u1", {"n": 3}, 3)]
    missing = PostgresSink({**settings, "table": "absent"})
    with pytest.raises(ConnectorError, match='relation "absent" does not exist'):
        missing.open("m", 0, 1)
        missing.write_batch(first, 1)
    sink.close()
    missing.close()
