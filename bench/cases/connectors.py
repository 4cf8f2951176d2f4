"""``python -m bench.cases.connectors [N] [M]``: records/s through the connectors (issue 23).

* ``end_to_end``: N entries already in a Redis stream -> filter -> map -> per-key sums
  over 10 s windows -> a PostgreSQL table, ``millwheel run`` in this process (SQLite
  store, ``until: end``); records/s = N / wall time from start to the last row
  committed; the table checked against a plain-Python reference.
* ``sink_<type>``: each sink alone: M records already in a stream's log, written by a
  :class:`~millwheel.runtime.sink_runner.SinkRunner` in batches of 1000 until caught up
  (PostgreSQL, Redis Streams, NATS JetStream).

Private servers on free ports (redis-server, PostgreSQL via initdb, nats-server -js),
stopped at the end. Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from millwheel.connectors.spec import ConnectorSpec, SinkSpec
from millwheel.record import Record
from millwheel.runtime.local_runner import LocalRunner
from millwheel.runtime.sink_runner import SinkRunner
from millwheel.spec import sources_from_dict, topology_from_dict
from millwheel.state import open_store


def end_to_end(n: int, redis_url: str, pg: Any, tmp: str) -> dict[str, Any]:
    import redis

    from tests.support.connector_pipeline import entries, expected_sums, spec, table_sums
    items = entries(n)
    r = redis.Redis.from_url(redis_url)
    pipe = r.pipeline(transaction=False)
    for i, e in enumerate(items):
        pipe.xadd("events", e)
        if i % 5000 == 4999:
            pipe.execute()
    pipe.execute()
    data = spec(redis_url, pg.url, until_end=True, key_ranges=4)
    store = open_store(f"sqlite:///{tmp}/e2e.db")
    started = time.monotonic()
    cpu = time.process_time()
    runner = LocalRunner(topology_from_dict(data), store, sources_from_dict(data, Path(tmp)))
    runner.run()
    runner.stop_writer()
    elapsed, cpu = time.monotonic() - started, time.process_time() - cpu
    store.close()
    ok = table_sums(pg.rows("sums")) == expected_sums(items)
    return {"records": n, "seconds": round(elapsed, 2), "records_per_s": round(n / elapsed),
            "records_per_cpu_s": round(n / cpu), "correct": ok}


def sink_alone(kind: str, settings: dict[str, Any], m: int, tmp: str) -> dict[str, Any]:
    store = open_store(f"sqlite:///{tmp}/{kind}.db")
    for start in range(0, m, 5000):
        store.append_log("out", [Record(f"k{i % 100}", json.dumps({"start": 0, "end": 10, "value": i}).encode(),
                                        i, f"r{i}") for i in range(start, min(m, start + 5000))])
    runner = SinkRunner(SinkSpec(f"bench-{kind}", "out", ConnectorSpec(kind, json.dumps(settings))),
                        store, token=1, batch_size=1000)
    started = time.monotonic()
    while runner.written < m:
        if not runner.step() and runner.down_since is not None:
            time.sleep(0.05)
    elapsed = time.monotonic() - started
    runner.close()
    store.close()
    return {"records": m, "seconds": round(elapsed, 2), "records_per_s": round(m / elapsed)}


def run(n: int = 100_000, m: int = 50_000) -> dict[str, Any]:
    from tests.support.nats_server import NatsServer
    from tests.support.postgres_server import PostgresServer
    from tests.support.redis_server import RedisServer
    tmp = tempfile.mkdtemp(prefix="bench-connectors-")
    out: dict[str, Any] = {}
    try:
        with RedisServer() as rs, PostgresServer() as pg, NatsServer() as ns:
            out["end_to_end"] = end_to_end(n, rs.url, pg, tmp)
            out["sink_postgres"] = sink_alone("postgres", {"type": "postgres", "url": pg.url, "table": "bench"},
                                              m, tmp)
            out["sink_redis_stream"] = sink_alone(
                "redis-stream", {"type": "redis-stream", "url": rs.url, "redis_stream": "bench"}, m, tmp)
            out["sink_nats_jetstream"] = sink_alone(
                "nats-jetstream", {"type": "nats-jetstream", "url": ns.url, "subject": "bench.out",
                                   "jetstream": "BENCH"}, m, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv: list[str]) -> None:
    n = int(argv[0]) if argv else 100_000
    m = int(argv[1]) if len(argv) > 1 else 50_000
    print(json.dumps({**run(n, m), "loadavg": os.getloadavg()}))


if __name__ == "__main__":
    main(sys.argv[1:])
