"""``python -m millwheel.nexmark.generate``: write Nexmark events as files, one per table.

::

    python -m millwheel.nexmark.generate --events 1000000 --rate 10000 --seed 1 --out data/

writes ``person.jsonl``, ``auction.jsonl`` and ``bid.jsonl`` (or ``.csv`` with
``--format csv``) and ``nexmark.json`` (the configuration and what it implies: the
event-time span, the largest disorder, the longest auction, the count per table).

**Why one file per table.** millwheel's injectors read a file each and Flink's
filesystem connector reads a table per file: with a file per table a query reads only
the tables it names (q0 reads bids alone), and its key extractors read the table's own
fields (``json:auction``). Flink's suite reads one ``datagen`` table with an
``event_type`` and a nested row per table, then splits it by views; the SQL's views do
the same here over three files (bench/peers/nexmark_flink_job.py). Files are in event
order (generation order) within each table.

**JSON lines** are the records ``millwheel run`` injects:
``{"key", "timestamp", "id", "value"}``, where ``value`` is the table's row as a JSON
object (Flink's field names), ``timestamp`` its ``dateTime`` in µs, ``key`` the
person's or auction's ``id`` or the bid's ``auction``, ``id`` the event id (unique over
the three files, so record IDs never collide in a computation reading two of them).
**CSV** has a header of the table's fields and one row per record; times are µs. No
field holds a comma, a quote or a backslash (the generator's strings are letters,
spaces and URL characters), so nothing is quoted or escaped in either format.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable, TextIO

from millwheel.errors import InvalidSpecError, MillWheelError
from millwheel.nexmark.generator import TABLES, Auction, Bid, GeneratorConfig, NexmarkGenerator, Person
from millwheel.nexmark.meta import META_FILE, describe
from millwheel.nexmark.queries import write_specs

FORMATS = ("jsonl", "csv")
PROGRESS_EVERY = 200_000  # events between progress checks (a line at most once a second)


def _person_jsonl(eid: int, p: Any) -> str:
    return (f'{{"key":"{p.id}","timestamp":{p.dateTime},"id":"{eid}","value":{{"id":{p.id},'
            f'"name":"{p.name}","emailAddress":"{p.emailAddress}","creditCard":"{p.creditCard}",'
            f'"city":"{p.city}","state":"{p.state}","dateTime":{p.dateTime},"extra":"{p.extra}"}}}}\n')


def _auction_jsonl(eid: int, a: Any) -> str:
    return (f'{{"key":"{a.id}","timestamp":{a.dateTime},"id":"{eid}","value":{{"id":{a.id},'
            f'"itemName":"{a.itemName}","description":"{a.description}","initialBid":{a.initialBid},'
            f'"reserve":{a.reserve},"dateTime":{a.dateTime},"expires":{a.expires},"seller":{a.seller},'
            f'"category":{a.category},"extra":"{a.extra}"}}}}\n')


def _bid_jsonl(eid: int, b: Any) -> str:
    return (f'{{"key":"{b.auction}","timestamp":{b.dateTime},"id":"{eid}","value":{{"auction":{b.auction},'
            f'"bidder":{b.bidder},"price":{b.price},"channel":"{b.channel}","url":"{b.url}",'
            f'"dateTime":{b.dateTime},"extra":"{b.extra}"}}}}\n')


def _csv(eid: int, row: Any) -> str:
    return ",".join(map(str, row)) + "\n"


FORMATTERS: dict[str, tuple[Callable[[int, Any], str], ...]] = {
    "jsonl": (_person_jsonl, _auction_jsonl, _bid_jsonl),
    "csv": (_csv, _csv, _csv),
}
HEADERS = {"person": Person._fields, "auction": Auction._fields, "bid": Bid._fields}


def table_path(out: Path, table: str, fmt: str) -> Path:
    return out / f"{table}.{fmt}"


def write(config: GeneratorConfig, out: Path, fmt: str = "jsonl",
          progress: Callable[[int, float], None] | None = None) -> dict[str, Any]:
    """Write the events of ``config`` under ``out`` (made if missing); returns what
    ``nexmark.json`` holds. ``progress(events so far, seconds)`` is called about once a
    second on long runs."""
    if fmt not in FORMATS:
        raise InvalidSpecError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    formatters = FORMATTERS[fmt]
    counts = [0, 0, 0]
    files: list[TextIO] = [table_path(out, t, fmt).open("w", buffering=1 << 20) for t in TABLES]
    try:
        if fmt == "csv":
            for f, name in zip(files, TABLES, strict=True):
                f.write(",".join(HEADERS[name]) + "\n")
        writes = [f.write for f in files]
        last_report = started
        for i, (table, event_id, event) in enumerate(NexmarkGenerator(config)):
            writes[table](formatters[table](event_id, event))
            counts[table] += 1
            if progress is not None and i % PROGRESS_EVERY == PROGRESS_EVERY - 1:
                now = time.perf_counter()
                if now - last_report >= 1.0:
                    progress(i + 1, now - started)
                    last_report = now
    finally:
        for f in files:
            f.close()
    seconds = time.perf_counter() - started
    meta = describe(config)
    meta.update({"format": fmt, "counts": dict(zip(TABLES, counts, strict=True)),
                 "files": {t: table_path(out, t, fmt).name for t in TABLES},
                 "seconds": round(seconds, 3)})
    (out / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m millwheel.nexmark.generate",
                                     description="Write Nexmark events (Flink Nexmark's rules, seeded) as "
                                                 "one file per table: person, auction, bid.")
    parser.add_argument("--events", type=int, default=100_000, help="events in all (default 100000)")
    parser.add_argument("--rate", type=int, default=10_000,
                        help="events per second of event time (default 10000, Flink's default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--format", choices=FORMATS, default="jsonl")
    parser.add_argument("--out", required=True, type=Path, help="directory for the files")
    parser.add_argument("--out-of-order-group-size", type=int, default=1, metavar="N",
                        help="shuffle events inside groups of N (bounded disorder; default 1: in order)")
    parser.add_argument("--base-time-us", type=int, default=None,
                        help="event time of the first event (default 2015-07-15T00:00:00Z)")
    parser.add_argument("--specs", action="store_true",
                        help="also write each query's spec (q0.yaml ...) beside the files, set for this data")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    args = parser.parse_args(argv)
    extra = {} if args.base_time_us is None else {"base_time_us": args.base_time_us}
    try:
        config = GeneratorConfig(events=args.events, rate=args.rate, seed=args.seed,
                                 out_of_order_group_size=args.out_of_order_group_size, **extra)

        def report(n: int, seconds: float) -> None:
            print(f"{n:,} of {config.events:,} events ({100 * n / max(config.events, 1):.0f}%), "
                  f"{n / seconds:,.0f} events/s", file=sys.stderr, flush=True)

        meta = write(config, args.out, args.format, None if args.quiet else report)
        if args.specs:
            write_specs(args.out, args.out)
    except MillWheelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not args.quiet:
        rate = config.events / meta["seconds"] if meta["seconds"] else 0.0
        print(f"{config.events:,} events ({meta['counts']}) in {meta['seconds']:.1f} s, {rate:,.0f} events/s, "
              f"{config.duration_us / 1e6:,.1f} s of event time -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
