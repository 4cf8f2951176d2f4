"""The Nexmark generator follows Flink Nexmark's rules, and a seed repeats a data set."""

from __future__ import annotations

import csv
import hashlib
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from millwheel.errors import InvalidSpecError
from millwheel.nexmark.generate import write
from millwheel.nexmark.generator import (
    BASE_TIME_US,
    Auction,
    Bid,
    GeneratorConfig,
    NexmarkGenerator,
    NextEvent,
    Person,
)
from millwheel.nexmark.meta import read_meta
from millwheel.sources import parse_json_record

N = 20_000


@pytest.fixture(scope="module")
def events() -> list[NextEvent]:
    return list(NexmarkGenerator(GeneratorConfig(events=N, rate=1000, seed=7)))


def test_a_seed_repeats_the_events_and_another_seed_does_not() -> None:
    a = list(NexmarkGenerator(GeneratorConfig(events=2000, seed=3)))
    assert a == list(NexmarkGenerator(GeneratorConfig(events=2000, seed=3)))
    assert a != list(NexmarkGenerator(GeneratorConfig(events=2000, seed=4)))


def test_a_seed_writes_the_same_files_on_every_run_and_version(tmp_path: Path) -> None:
    # A data set is named by its settings: a change to the generator that changes what a
    # seed writes changes published comparisons, so it must be deliberate (update these).
    write(GeneratorConfig(events=5000, seed=11), tmp_path)
    digests = {t: hashlib.sha256((tmp_path / f"{t}.jsonl").read_bytes()).hexdigest()[:16]
               for t in ("person", "auction", "bid")}
    assert digests == {"person": "25fa1258eed82615", "auction": "12bc12c9331f7eb9", "bid": "886df60a16c80acd"}


def test_people_auctions_and_bids_interleave_1_3_46_by_event_id(events: list[NextEvent]) -> None:
    kinds = {Person: 0, Auction: 1, Bid: 2}
    for table, event_id, event in events:
        rem = event_id % 50
        assert table == kinds[type(event)] == (0 if rem < 1 else 1 if rem < 4 else 2)
    # Flink's table source starts at event id 2: the first event is an auction
    assert events[0][1] == 2 and isinstance(events[0][2], Auction)
    counts = [sum(1 for t, _, _ in events if t == k) for k in range(3)]
    assert counts == [N // 50, N * 3 // 50, N * 46 // 50]


def test_ids_start_at_1000_and_run_on_and_categories_are_10_to_14(events: list[NextEvent]) -> None:
    people = [e.id for _, _, e in events if isinstance(e, Person)]
    auctions = [e for _, _, e in events if isinstance(e, Auction)]
    assert people == list(range(1001, 1001 + len(people)))
    assert [a.id for a in auctions] == list(range(1001, 1001 + len(auctions)))
    assert {a.category for a in auctions} == {10, 11, 12, 13, 14}
    assert all(a.seller >= 1000 and a.reserve > a.initialBid for a in auctions)


def test_bids_go_to_hot_or_in_flight_auctions_and_hot_bidders(events: list[NextEvent]) -> None:
    gen = NexmarkGenerator(GeneratorConfig())
    bids = [(eid, e) for _, eid, e in events if isinstance(e, Bid)]
    hot_auctions = hot_bidders = 0
    for eid, b in bids:
        last = gen.last_auction_id(eid) + 1000
        assert max(last - 100, 1000) <= b.auction <= last + 10
        hot_auctions += b.auction == (last - 1000) // 100 * 100 + 1000
        # the bidder carries FIRST_PERSON_ID twice, as Flink's BidGenerator adds it
        hot_bidders += b.bidder == (gen.last_person_id(eid)) // 100 * 100 + 1 + 2000
    assert 0.45 < hot_auctions / len(bids) < 0.6  # 1/2 hot, plus random ones that hit it
    assert 0.70 < hot_bidders / len(bids) < 0.80  # 3/4 hot
    channels = {b.channel for _, b in bids}
    assert {"Google", "Facebook", "Baidu", "Apple"} <= channels and len(channels) > 100


def test_prices_are_log_uniform_from_100_to_10_to_the_8(events: list[NextEvent]) -> None:
    prices = [e.price for _, _, e in events if isinstance(e, Bid)]
    assert min(prices) >= 100 and max(prices) <= 10**8
    decades = [sum(1 for p in prices if 10**k <= p < 10 ** (k + 1)) / len(prices) for k in range(2, 8)]
    assert all(0.14 < d < 0.19 for d in decades), decades  # 1/6 each


def test_records_are_padded_to_200_500_and_100_bytes_on_average(events: list[NextEvent]) -> None:
    # Flink's sizes: 8 bytes per number it counts, strings by their length
    def size(e: Person | Auction | Bid) -> int:
        if isinstance(e, Person):
            return 8 + len(e.name) + len(e.emailAddress) + len(e.creditCard) + len(e.city) + len(e.state)
        if isinstance(e, Auction):
            return 8 + len(e.itemName) + len(e.description) + 40
        return 32

    for t, want in ((0, 200), (1, 500), (2, 100)):
        sizes = [size(e) + len(e.extra) for table, _, e in events if table == t]
        assert abs(statistics.mean(sizes) - want) < want * 0.02, (t, statistics.mean(sizes))
        assert min(sizes) >= want * 0.75 and max(sizes) <= want * 1.25


def test_event_time_follows_the_rate_and_auctions_expire_within_the_bound(events: list[NextEvent]) -> None:
    config = GeneratorConfig(events=N, rate=1000, seed=7)
    times = [e.dateTime for _, _, e in events]
    # event number n (from 1) is at base + floor(n * 1e6 / rate / 1000) ms, as µs
    assert times == [BASE_TIME_US + (n * 1000) // 1000 * 1000 for n in range(1, N + 1)]
    assert times[-1] - times[0] == config.duration_us == (N - 1) * 1000
    assert all(t % 1000 == 0 for t in times)  # whole milliseconds, as Flink's
    lengths = [e.expires - e.dateTime for _, _, e in events if isinstance(e, Auction)]
    assert 0 < min(lengths) and max(lengths) <= config.max_auction_length_us
    assert max(lengths) > config.max_auction_length_us * 0.9


def test_disorder_shuffles_inside_groups_and_stays_within_its_bound() -> None:
    in_order = GeneratorConfig(events=5000, rate=100, seed=1)
    shuffled = GeneratorConfig(events=5000, rate=100, seed=1, out_of_order_group_size=20)
    ids = [eid for _, eid, _ in NexmarkGenerator(in_order)]
    events = list(NexmarkGenerator(shuffled))
    assert sorted(eid for _, eid, _ in events) == ids  # the same events, another order
    times = [e.dateTime for _, _, e in events]
    assert times != sorted(times)
    behind = max(max(times[: i + 1]) - t for i, t in enumerate(times))
    assert 0 < behind <= shuffled.max_disorder_us
    assert in_order.max_disorder_us == 0


def test_bad_settings_are_refused_with_their_name() -> None:
    with pytest.raises(InvalidSpecError, match="rate"):
        GeneratorConfig(rate=0)
    with pytest.raises(InvalidSpecError, match="base_time_us"):
        GeneratorConfig(base_time_us=1)


def test_files_are_records_millwheel_injects_and_csv_has_the_table_columns(tmp_path: Path) -> None:
    config = GeneratorConfig(events=3000, seed=2)
    meta = write(config, tmp_path / "j")
    assert read_meta(tmp_path / "j") == json.loads((tmp_path / "j" / "nexmark.json").read_text())
    assert meta["counts"] == {"person": 60, "auction": 180, "bid": 2760}
    expected = list(NexmarkGenerator(config))
    for table, cls in (("person", Person), ("auction", Auction), ("bid", Bid)):
        lines = (tmp_path / "j" / f"{table}.jsonl").read_text().splitlines()
        mine = [(eid, e) for _, eid, e in expected if isinstance(e, cls)]
        assert len(lines) == len(mine)
        for line, (eid, e) in zip(lines, mine, strict=True):
            record = parse_json_record(line, "x")  # what an injector reads
            assert record.record_id == str(eid) and record.timestamp == e.dateTime
            assert json.loads(record.value) == e._asdict()
    write(config, tmp_path / "c", "csv")
    with (tmp_path / "c" / "bid.csv").open() as f:
        rows = list(csv.DictReader(f))
    bids = [e for _, _, e in expected if isinstance(e, Bid)]
    assert [{k: str(v) for k, v in b._asdict().items()} for b in bids] == rows


def test_the_command_writes_the_files_and_reports_progress(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "millwheel.nexmark.generate", "--events", "5000", "--rate",
                           "100", "--seed", "9", "--out", str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "5,000 events" in done.stderr and "50.0 s of event time" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["auction.jsonl", "bid.jsonl", "nexmark.json",
                                                            "person.jsonl"]
    bad = subprocess.run([sys.executable, "-m", "millwheel.nexmark.generate", "--rate", "0", "--out",
                          str(tmp_path)], capture_output=True, text=True)
    assert bad.returncode == 2 and "rate must be" in bad.stderr
