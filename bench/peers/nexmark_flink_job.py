"""Flink SQL's Nexmark queries over the files of ``python -m millwheel.nexmark.generate``.

Run by the Flink peer's own virtualenv (``bench/.peers/flink``, made by
:func:`bench.peers.peer_common.prepare`): it imports only the standard library and
PyFlink, never millwheel. Usage::

    python nexmark_flink_job.py '{"data": DIR, "out": DIR, "queries": ["q0", ...],
                                  "parallelism": 2}'

**The queries are the published ones** (github nexmark/nexmark,
``nexmark-flink/src/main/resources/queries/qN.sql``): each ``SELECT`` of their
``INSERT INTO nexmark_qN`` below is copied unchanged. **Only the source is adapted**:
Flink's suite reads one generated ``datagen`` table and splits it into the views
``person``, ``auction`` and ``bid`` (``ddl_views.sql``); here each view reads its own
JSON-lines file of the generator (``{"key", "timestamp", "id", "value": ROW}``), with
the same columns and the same watermark (``dateTime - INTERVAL '4' SECOND``). Times in
the files are µs; ``dateTime`` and ``expires`` are them as ``TIMESTAMP(3)`` in UTC, the
type of Flink's tables (whole milliseconds, so nothing is lost).

**Output.** Each query runs as its published ``INSERT INTO nexmark_qN`` (the sink's
columns as published), the ``blackhole`` connector replaced by a JSON file sink; q4,
whose result updates (a file sink takes only inserts), is collected
(``TableResult.collect()``) with its row kinds. Settings as Nexmark's
``conf/config.yaml`` where they matter here: exactly-once checkpoints (every second, so
the file sinks commit), mini-batches (2 s, 50,000 rows). Every query's rows go to
``OUT/qN.jsonl``, one JSON list per row: the row kind (``+I``, ``-U``, ``+U``, ``-D``) then
the columns in the SELECT's order, times as epoch µs, decimals as text. It prints one
JSON line: seconds and rows per query.
"""

from __future__ import annotations

import datetime as dt
import decimal
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

SOURCES = {
    "person": ("id BIGINT, name STRING, emailAddress STRING, creditCard STRING, city STRING, state STRING, "
               "`dateTime` BIGINT, extra STRING",
               "`value`.id AS id, `value`.name AS name, `value`.emailAddress AS emailAddress, "
               "`value`.creditCard AS creditCard, `value`.city AS city, `value`.state AS state, `dateTime`, "
               "`value`.extra AS extra"),
    "auction": ("id BIGINT, itemName STRING, description STRING, initialBid BIGINT, reserve BIGINT, "
                "`dateTime` BIGINT, expires BIGINT, seller BIGINT, category BIGINT, extra STRING",
                "`value`.id AS id, `value`.itemName AS itemName, `value`.description AS description, "
                "`value`.initialBid AS initialBid, `value`.reserve AS reserve, `dateTime`, "
                "CAST(TO_TIMESTAMP_LTZ(`value`.expires / 1000, 3) AS TIMESTAMP(3)) AS expires, "
                "`value`.seller AS seller, "
                "`value`.category AS category, `value`.extra AS extra"),
    "bid": ("auction BIGINT, bidder BIGINT, price BIGINT, channel STRING, url STRING, `dateTime` BIGINT, "
            "extra STRING",
            "`value`.auction AS auction, `value`.bidder AS bidder, `value`.price AS price, "
            "`value`.channel AS channel, `value`.url AS url, `dateTime`, `value`.extra AS extra"),
}

#: The SELECT of each published qN.sql, unchanged.
QUERIES = {
    "q0": "SELECT auction, bidder, price, `dateTime`, extra FROM bid",
    "q1": """SELECT
    auction,
    bidder,
    0.908 * price as price, -- convert dollar to euro
    `dateTime`,
    extra
FROM bid""",
    "q2": "SELECT auction, price FROM bid WHERE MOD(auction, 123) = 0",
    "q3": """SELECT
    P.name, P.city, P.state, A.id
FROM
    auction AS A INNER JOIN person AS P on A.seller = P.id
WHERE
    A.category = 10 and (P.state = 'OR' OR P.state = 'ID' OR P.state = 'CA')""",
    "q4": """SELECT
    Q.category,
    AVG(Q.final)
FROM (
    SELECT MAX(B.price) AS final, A.category
    FROM auction A, bid B
    WHERE A.id = B.auction AND B.`dateTime` BETWEEN A.`dateTime` AND A.expires
    GROUP BY A.id, A.category
) Q
GROUP BY Q.category""",
    "q5": """SELECT AuctionBids.auction, AuctionBids.num
 FROM (
   SELECT
     auction,
     count(*) AS num,
     window_start AS starttime,
     window_end AS endtime
     FROM TABLE(
             HOP(TABLE bid, DESCRIPTOR(`dateTime`), INTERVAL '2' SECOND, INTERVAL '10' SECOND))
     GROUP BY auction, window_start, window_end
 ) AS AuctionBids
 JOIN (
   SELECT
     max(CountBids.num) AS maxn,
     CountBids.starttime,
     CountBids.endtime
   FROM (
     SELECT
       count(*) AS num,
       window_start AS starttime,
       window_end AS endtime
     FROM TABLE(
                HOP(TABLE bid, DESCRIPTOR(`dateTime`), INTERVAL '2' SECOND, INTERVAL '10' SECOND))
     GROUP BY auction, window_start, window_end
     ) AS CountBids
   GROUP BY CountBids.starttime, CountBids.endtime
 ) AS MaxBids
 ON AuctionBids.starttime = MaxBids.starttime AND
    AuctionBids.endtime = MaxBids.endtime AND
    AuctionBids.num >= MaxBids.maxn""",
    "q7": """SELECT B.auction, B.price, B.bidder, B.`dateTime`, B.extra
from bid B
JOIN (
  SELECT MAX(price) AS maxprice, window_end as `dateTime`
  FROM TABLE(
          TUMBLE(TABLE bid, DESCRIPTOR(`dateTime`), INTERVAL '10' SECOND))
  GROUP BY window_start, window_end
) B1
ON B.price = B1.maxprice
WHERE B.`dateTime` BETWEEN B1.`dateTime`  - INTERVAL '10' SECOND AND B1.`dateTime`""",
    "q8": """SELECT P.id, P.name, P.starttime
FROM (
  SELECT id, name,
        window_start AS starttime,
        window_end AS endtime
  FROM TABLE(
            TUMBLE(TABLE person, DESCRIPTOR(`dateTime`), INTERVAL '10' SECOND))
  GROUP BY id, name, window_start, window_end
) P
JOIN (
  SELECT seller,
        window_start AS starttime,
        window_end AS endtime
  FROM TABLE(
        TUMBLE(TABLE auction, DESCRIPTOR(`dateTime`), INTERVAL '10' SECOND))
  GROUP BY seller, window_start, window_end
) A
ON P.id = A.seller AND P.starttime = A.starttime AND P.endtime = A.endtime""",
    "q11": """SELECT
    B.bidder,
    count(*) as bid_count,
    SESSION_START(B.`dateTime`, INTERVAL '10' SECOND) as starttime,
    SESSION_END(B.`dateTime`, INTERVAL '10' SECOND) as endtime
FROM bid B
GROUP BY B.bidder, SESSION(B.`dateTime`, INTERVAL '10' SECOND)""",
}

#: The columns of each published qN.sql's sink table ``nexmark_qN``, unchanged (q7's
#: SELECT puts price before bidder, into the columns named bidder and price: as published).
SINKS = {
    "q0": "auction BIGINT, bidder BIGINT, price BIGINT, `dateTime` TIMESTAMP(3), extra VARCHAR",
    "q1": "auction BIGINT, bidder BIGINT, price DECIMAL(23, 3), `dateTime` TIMESTAMP(3), extra VARCHAR",
    "q2": "auction BIGINT, price BIGINT",
    "q3": "name VARCHAR, city VARCHAR, state VARCHAR, id BIGINT",
    "q4": "id BIGINT, final BIGINT",
    "q5": "auction BIGINT, num BIGINT",
    "q7": "auction BIGINT, bidder BIGINT, price BIGINT, `dateTime` TIMESTAMP(3), extra VARCHAR",
    "q8": "id BIGINT, name VARCHAR, stime TIMESTAMP(3)",
    "q11": "bidder BIGINT, bid_count BIGINT, starttime TIMESTAMP(3), endtime TIMESTAMP(3)",
}
#: Queries whose result updates (an unwindowed GROUP BY): collected with their row kinds,
#: as a file sink takes only inserts.
UPDATING = ("q4",)
EPOCH = dt.datetime(1970, 1, 1)
TIMESTAMP = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(\.\d+)?")


def sources(t_env: Any, data: Path) -> None:
    """The views ``person``, ``auction``, ``bid`` over the generator's files."""
    for table, (row, columns) in SOURCES.items():
        path = data / f"{table}.jsonl"
        t_env.execute_sql(f"""
            CREATE TEMPORARY TABLE {table}_file (
                `timestamp` BIGINT,
                `value` ROW<{row}>,
                `dateTime` AS CAST(TO_TIMESTAMP_LTZ(`timestamp` / 1000, 3) AS TIMESTAMP(3)),
                WATERMARK FOR `dateTime` AS `dateTime` - INTERVAL '4' SECOND
            ) WITH ('connector' = 'filesystem', 'path' = '{path}', 'format' = 'json')""")
        t_env.execute_sql(f"CREATE TEMPORARY VIEW {table} AS SELECT {columns} FROM {table}_file")


def plain(v: Any) -> Any:
    """A column as JSON: times as epoch µs (UTC), decimals as text."""
    if isinstance(v, str) and TIMESTAMP.fullmatch(v):
        v = dt.datetime.fromisoformat(v)
    if isinstance(v, dt.datetime):
        if v.tzinfo is not None:
            v = v.astimezone(dt.UTC).replace(tzinfo=None)
        return (v - EPOCH) // dt.timedelta(microseconds=1)
    if isinstance(v, (decimal.Decimal, float)):
        return str(v)
    return v


def run_query(t_env: Any, name: str, out: Path) -> int:
    """Run one query, its rows into ``out/NAME.jsonl``; returns the rows written.

    An append-only query runs as published, ``INSERT INTO nexmark_qN SELECT ...``, into
    a JSON file sink (files committed by checkpoints, the last when the input ends); an
    updating one is collected with its row kinds."""
    rows = 0
    with (out / f"{name}.jsonl").open("w") as f:
        if name in UPDATING:
            with t_env.sql_query(QUERIES[name]).execute().collect() as result:
                for row in result:
                    f.write(json.dumps([str(row.get_row_kind()), *(plain(v) for v in row)]) + "\n")
                    rows += 1
            return rows
        sink = out / f"sink-{name}"
        columns = [c.split(" ")[0].strip("`") for c in re.split(r",\s*(?![^()]*\))", SINKS[name])]
        t_env.execute_sql(f"CREATE TEMPORARY TABLE nexmark_{name} ({SINKS[name]}) "
                          f"WITH ('connector' = 'filesystem', 'path' = '{sink}', 'format' = 'json')")
        t_env.execute_sql(f"INSERT INTO nexmark_{name}\n{QUERIES[name]}").wait()
        for part in sorted(sink.rglob("*")):
            if part.is_file() and not part.name.startswith("."):  # a dot: not committed
                for line in part.read_text().splitlines():
                    obj = json.loads(line, parse_float=decimal.Decimal)
                    f.write(json.dumps(["+I", *(plain(obj[c]) for c in columns)]) + "\n")
                    rows += 1
    return rows


def main(spec: dict[str, Any]) -> dict[str, Any]:
    t0 = time.perf_counter()
    from pyflink.table import EnvironmentSettings, TableEnvironment

    t_env = TableEnvironment.create(EnvironmentSettings.in_streaming_mode())
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    conf = t_env.get_config()
    for key, value in {
        "parallelism.default": str(spec.get("parallelism", 2)),
        "table.local-time-zone": "UTC",
        # as Nexmark's own conf/config.yaml: exactly-once checkpoints, mini-batches
        "execution.checkpointing.interval": "1 s",
        "execution.checkpointing.mode": "EXACTLY_ONCE",
        "execution.checkpointing.storage": "filesystem",
        "execution.checkpointing.dir": (out / "checkpoints").resolve().as_uri(),
        "state.backend.type": "hashmap",
        "table.exec.mini-batch.enabled": "true",
        "table.exec.mini-batch.allow-latency": "2 s",
        "table.exec.mini-batch.size": "50000",
    }.items():
        conf.set(key, value)
    sources(t_env, Path(spec["data"]))
    report: dict[str, Any] = {"jvm_start_s": time.perf_counter() - t0, "queries": {}}
    for name in spec["queries"]:
        started = time.perf_counter()
        rows = run_query(t_env, name, out)
        report["queries"][name] = {"seconds": time.perf_counter() - started, "rows": rows}
    return report


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))), flush=True)
