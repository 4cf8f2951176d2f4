"""The Nexmark events (people, auctions, bids), made by Flink Nexmark's rules, seeded.

This follows ``nexmark-flink/src/main/java/com/github/nexmark/flink/generator`` of
github nexmark/nexmark (``GeneratorConfig``, ``NexmarkGenerator`` and the
``Person``/``Auction``/``Bid``/``Price``/``Strings`` generators) rule by rule, so that
the queries see the distributions the published Flink figures were measured on:

* events are numbered; event ``id % 50`` below 1 is a person, below 4 an auction, else
  a bid (the 1:3:46 interleave); ids of people and auctions start at 1000, categories
  are 10..14;
* a bid is for a hot auction with probability 1/2 (the first of the last 100 auctions),
  else for one of the 100 auctions in flight or 10 ahead; its bidder is hot with
  probability 3/4 (the second of the last 100 people), else one of the 1,000 active
  people or 10 ahead; an auction's seller is hot with probability 3/4 (the first of
  the last 100 people), else an active person;
* prices are log-uniform ``round(10 ** (6u) * 100)``: 100 .. 10^8 cents;
* records are padded by ``extra`` to 200 (person), 500 (auction) and 100 (bid) bytes
  on average (+-20%), cut from one long random string as Flink does;
* an auction lasts ``1 + uniform(2 x the time 100 auctions take to be made)``;
* event time: ``base + floor(n x 10^6 / rate µs) // 1000`` milliseconds for event
  number ``n`` (Flink's ``timestampForEvent``), so the stream spans ``events / rate``
  seconds of event time whatever the rate; ``out_of_order_group_size`` > 1 shuffles
  event numbers (ids and times together) inside groups of that many events, as
  Flink's ``outOfOrderGroupSize`` does: bounded disorder (:attr:`GeneratorConfig.max_disorder_us`).

**Time units.** Flink's event times are milliseconds; millwheel's are integer
microseconds. Times here are Flink's milliseconds written as microseconds
(``ms * 1000``): every ``dateTime``/``expires`` is a whole millisecond, so a window or
``BETWEEN`` bound in milliseconds in Flink's SQL selects exactly the same events as the
same bound in microseconds here.

**What differs from Flink's generator.** Flink's random numbers come from an unseeded
``SplittableRandom`` (and its URL and padding tables from a static one), so no two Flink
runs see the same events; here one ``random.Random(seed)`` makes everything, so a seed
repeats a data set byte for byte, and the random draws are not Java's bit for bit (the
same distributions, not the same values). Flink adds ``FIRST_PERSON_ID`` to a bid's
bidder twice (``BidGenerator.nextBid``), so bidders are 2000 and up; that is kept, as
the published figures were measured with it. One generator makes the whole stream (Flink
splits it among its source subtasks, each on its own timeline).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterator, NamedTuple

from millwheel.errors import InvalidSpecError

#: 2015-07-15T00:00:00Z, the base time of Beam's (and so Nexmark's) generator, in µs.
BASE_TIME_US = 1_436_918_400_000_000
FIRST_PERSON_ID = 1000
FIRST_AUCTION_ID = 1000
FIRST_CATEGORY_ID = 10
NUM_CATEGORIES = 5
PERSON_ID_LEAD = 10  # people not yet made that a random choice may name
AUCTION_ID_LEAD = 10
HOT_BATCH = 100  # a hot seller / bidder / auction is the first (bidder: second) of its batch of 100
HOT_CHANNELS = ("Google", "Facebook", "Baidu", "Apple")
HOT_CHANNELS_RATIO = 2
CHANNELS_NUMBER = 10_000
MIN_STRING_LENGTH = 3
EXTRA_STRING_LENGTH = 1 << 20  # Flink's REUSABLE_EXTRA_STRING: padding is cut from it
US_STATES = ("AZ", "CA", "ID", "OR", "WA", "WY")
US_CITIES = ("Phoenix", "Los Angeles", "San Francisco", "Boise", "Portland", "Bend", "Redmond",
             "Seattle", "Kent", "Cheyenne")
FIRST_NAMES = ("Peter", "Paul", "Luke", "John", "Saul", "Vicky", "Kate", "Julie", "Sarah", "Deiter",
               "Walter")
LAST_NAMES = ("Shultz", "Abrams", "Spencer", "White", "Bartels", "Walton", "Smith", "Jones", "Noris")
MAX_EVENTS = 10**12
MAX_RATE = 10**9

#: The tables, in the order of Flink's ``event_type`` (0 person, 1 auction, 2 bid).
TABLES = ("person", "auction", "bid")


class Person(NamedTuple):
    """A new person; fields named as Flink's ``person`` table. Times in µs."""

    id: int
    name: str
    emailAddress: str  # noqa: N815 (Flink's column names)
    creditCard: str  # noqa: N815
    city: str
    state: str
    dateTime: int  # noqa: N815
    extra: str


class Auction(NamedTuple):
    """A new auction; fields named as Flink's ``auction`` table. Times in µs."""

    id: int
    itemName: str  # noqa: N815
    description: str
    initialBid: int  # noqa: N815
    reserve: int
    dateTime: int  # noqa: N815
    expires: int
    seller: int
    category: int
    extra: str


class Bid(NamedTuple):
    """A bid; fields named as Flink's ``bid`` table. Times in µs."""

    auction: int
    bidder: int
    price: int
    channel: str
    url: str
    dateTime: int  # noqa: N815
    extra: str


Event = Person | Auction | Bid


class NextEvent(NamedTuple):
    """One generated event: its table (index into :data:`TABLES`), event id and record."""

    table: int
    event_id: int
    event: Event


@dataclass(frozen=True)
class GeneratorConfig:
    """What to generate; the defaults are Flink Nexmark's (``NexmarkConfiguration``), with
    ``events`` bounded and the base time fixed (Flink's is the wall clock at start)."""

    events: int = 100_000
    #: events per second of event time (Flink's ``firstEventRate``, TPS)
    rate: int = 10_000
    seed: int = 0
    base_time_us: int = BASE_TIME_US
    person_proportion: int = 1
    auction_proportion: int = 3
    bid_proportion: int = 46
    avg_person_bytes: int = 200
    avg_auction_bytes: int = 500
    avg_bid_bytes: int = 100
    hot_auction_ratio: int = 2
    hot_sellers_ratio: int = 4
    hot_bidders_ratio: int = 4
    in_flight_auctions: int = 100
    active_people: int = 1000
    #: 1: in order; N > 1: event numbers shuffled inside groups of N (bounded disorder)
    out_of_order_group_size: int = 1
    #: Flink's table source starts both at 1, so the first event has id 2 (an auction)
    first_event_id: int = 1
    first_event_number: int = 1

    def __post_init__(self) -> None:
        def need(ok: bool, what: str) -> None:
            if not ok:
                raise InvalidSpecError(f"nexmark generator: {what}")

        need(0 <= self.events <= MAX_EVENTS, f"events must be 0 .. {MAX_EVENTS}, got {self.events}")
        need(1 <= self.rate <= MAX_RATE, f"rate must be 1 .. {MAX_RATE} events/s, got {self.rate}")
        need(self.base_time_us % 1000 == 0 and self.base_time_us >= 0,
             f"base_time_us must be a whole millisecond >= 0, got {self.base_time_us}")
        need(self.person_proportion >= 1 and self.auction_proportion >= 1 and self.bid_proportion >= 0,
             "proportions: person and auction >= 1, bid >= 0")
        for name in ("avg_person_bytes", "avg_auction_bytes", "avg_bid_bytes", "in_flight_auctions",
                     "active_people"):
            need(getattr(self, name) >= 0, f"{name} must be >= 0")
        for name in ("hot_auction_ratio", "hot_sellers_ratio", "hot_bidders_ratio", "out_of_order_group_size"):
            need(getattr(self, name) >= 1, f"{name} must be >= 1")
        need(self.first_event_id >= 0 and self.first_event_number >= 0, "first event id and number must be >= 0")

    @property
    def total_proportion(self) -> int:
        return self.person_proportion + self.auction_proportion + self.bid_proportion

    @property
    def inter_event_delay_us(self) -> float:
        return 1_000_000.0 / self.rate

    def timestamp_us(self, event_number: int) -> int:
        """Flink's ``timestampForEvent``: ``baseTime + (long)(n * delayUs) / 1000`` ms, as µs."""
        return self.base_time_us + int(event_number * self.inter_event_delay_us) // 1000 * 1000

    def adjusted_event_number(self, count: int) -> int:
        """Flink's ``nextAdjustedEventNumber``: the event number of the ``count``-th event,
        shuffled inside its out-of-order group."""
        n = self.out_of_order_group_size
        number = self.first_event_number + count
        return number // n * n + number * 953 % n

    @property
    def max_disorder_us(self) -> int:
        """An upper bound on how far an event's time is behind an earlier event's: 0 in
        order, else one group's span plus a millisecond of rounding. An injector's
        ``max_disorder_us`` at least this never sees a late record."""
        g = self.out_of_order_group_size
        if g <= 1:
            return 0
        return (int((g - 1) * self.inter_event_delay_us) // 1000 + 1) * 1000

    @property
    def auction_horizon_events(self) -> int:
        """Events until ``in_flight_auctions`` more auctions are made (Flink's
        ``numEventsForAuctions``): an auction lasts up to twice their span."""
        return self.in_flight_auctions * self.total_proportion // self.auction_proportion

    @property
    def max_auction_length_us(self) -> int:
        """An upper bound on ``expires - dateTime`` of every auction: what a join of bids
        to their open auction (q4) needs to keep an auction for."""
        horizon_ms = int(self.auction_horizon_events * self.inter_event_delay_us) // 1000 + 2
        return (2 * horizon_ms + 1) * 1000

    @property
    def duration_us(self) -> int:
        """Event time the stream spans: from the first event's time to the last's."""
        if self.events == 0:
            return 0
        return self.timestamp_us(self.first_event_number + self.events - 1) - self.timestamp_us(
            self.first_event_number)


class _Strings:
    """Flink's ``StringsGenerator``: random strings of letters with an occasional
    special character, and padding cut from one long random string."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        # the alphabet's bytes -> letters; the slight bias (256 = 9 x 26 + 22) is harmless
        table = bytes(ord("a") + b % 26 for b in range(256))
        self.extra_source = rng.randbytes(EXTRA_STRING_LENGTH).translate(table).decode()
        self.letters = [chr(ord("a") + i) for i in range(26)]
        # one in 13 characters is the special one (Flink: random.nextInt(13) == 0)
        self.cum_weights = [6 * (i + 1) for i in range(26)] + [169]

    def next_string(self, max_length: int, special: str = " ") -> str:
        rng = self.rng
        length = MIN_STRING_LENGTH + int(rng.random() * (max_length - MIN_STRING_LENGTH))
        chars = rng.choices(self.letters + [special], cum_weights=self.cum_weights, k=length)
        return "".join(chars).strip(" ")

    @staticmethod
    def padding(current_size: int, desired_average: int) -> tuple[int, int]:
        """Flink's ``nextExtra`` sizes: the padding is ``low + uniform(span)`` long, so that
        ``current_size`` plus it averages ``desired_average`` (+-20%)."""
        if current_size > desired_average:
            return 0, 0
        desired = desired_average - current_size
        delta = int(desired * 0.2 + 0.5)  # Java's Math.round
        return desired - delta, 2 * delta

    def next_extra(self, current_size: int, desired_average: int) -> str:
        """Padding so that ``current_size + len(extra)`` averages ``desired_average``."""
        low, span = self.padding(current_size, desired_average)
        size = low + int(self.rng.random() * span) if span else low
        offset = int(self.rng.random() * (EXTRA_STRING_LENGTH - size))
        return self.extra_source[offset:offset + size]


def _java_int_reverse_abs(i: int) -> int:
    """``Math.abs(Integer.reverse(i))`` of Java, for the channel URLs."""
    rev = int(f"{i & 0xFFFFFFFF:032b}"[::-1], 2)
    return abs(rev - (1 << 32) if rev >= 1 << 31 else rev)


class NexmarkGenerator:
    """The events of a :class:`GeneratorConfig`, in generation order (by event number).

    Iterating yields :class:`NextEvent`; the same config (seed included) yields the same
    events. Construction makes the URL and padding tables (~0.1 s)."""

    def __init__(self, config: GeneratorConfig) -> None:
        self.config = config
        self.rng = random.Random(config.seed)
        self.strings = _Strings(self.rng)
        self.hot_urls = tuple(self._base_url() for _ in HOT_CHANNELS)
        channels = []
        for i in range(CHANNELS_NUMBER):
            url = self._base_url()
            if int(self.rng.random() * 10) > 0:
                url += f"&channel_id={_java_int_reverse_abs(i)}"
            channels.append((f"channel-{i}", url))
        self.channels = tuple(channels)
        self._random = self.rng.random
        self._total = config.total_proportion
        self._extra_source = self.strings.extra_source
        self._bid_padding = self.strings.padding(32, config.avg_bid_bytes)  # Flink counts 4 numbers

    def _base_url(self) -> str:
        s = self.strings.next_string
        return f"https://www.nexmark.com/{s(5, '_')}/{s(5, '_')}/{s(5, '_')}/item.htm?query=1"

    # -- ids, as Flink's PersonGenerator / AuctionGenerator compute them ---------------

    def last_person_id(self, event_id: int) -> int:
        """The last person made by ``event_id`` (base 0): the current one for a person."""
        c = self.config
        epoch, offset = divmod(event_id, c.total_proportion)
        if offset >= c.person_proportion:
            offset = c.person_proportion - 1
        return epoch * c.person_proportion + offset

    def last_auction_id(self, event_id: int) -> int:
        """The last auction made by ``event_id`` (base 0): the current one for an auction."""
        c = self.config
        epoch, offset = divmod(event_id, c.total_proportion)
        if offset < c.person_proportion:
            epoch -= 1
            offset = c.auction_proportion - 1
        elif offset >= c.person_proportion + c.auction_proportion:
            offset = c.auction_proportion - 1
        else:
            offset -= c.person_proportion
        return epoch * c.auction_proportion + offset

    def _random_person(self, event_id: int) -> int:
        """One of the active people, or a few not yet made (base 0)."""
        people = self.last_person_id(event_id) + 1
        active = min(people, self.config.active_people)
        return people - active + int(self.rng.random() * (active + PERSON_ID_LEAD))

    def _random_auction(self, event_id: int) -> int:
        """One of the auctions in flight, or a few not yet made (base 0)."""
        last = self.last_auction_id(event_id)
        low = max(last - self.config.in_flight_auctions, 0)
        return low + int(self.rng.random() * (last - low + 1 + AUCTION_ID_LEAD))

    def _price(self) -> int:
        return int(10.0 ** (self.rng.random() * 6.0) * 100.0 + 0.5)

    # -- the events --------------------------------------------------------------------

    def person(self, event_id: int, ts: int) -> Person:
        rnd, s = self.rng.random, self.strings
        name = f"{FIRST_NAMES[int(rnd() * len(FIRST_NAMES))]} {LAST_NAMES[int(rnd() * len(LAST_NAMES))]}"
        email = f"{s.next_string(7)}@{s.next_string(5)}.com"
        card = " ".join(f"{int(rnd() * 10000):04d}" for _ in range(4))
        city = US_CITIES[int(rnd() * len(US_CITIES))]
        state = US_STATES[int(rnd() * len(US_STATES))]
        size = 8 + len(name) + len(email) + len(card) + len(city) + len(state)
        return Person(self.last_person_id(event_id) + FIRST_PERSON_ID, name, email, card, city, state, ts,
                      s.next_extra(size, self.config.avg_person_bytes))

    def auction(self, event_id: int, ts: int, event_number: int) -> Auction:
        c, rnd, s = self.config, self.rng.random, self.strings
        if int(rnd() * c.hot_sellers_ratio) > 0:
            seller = self.last_person_id(event_id) // HOT_BATCH * HOT_BATCH
        else:
            seller = self._random_person(event_id)
        category = FIRST_CATEGORY_ID + int(rnd() * NUM_CATEGORIES)
        initial = self._price()
        horizon_ms = (c.timestamp_us(event_number + c.auction_horizon_events) - ts) // 1000
        length_ms = 1 + int(rnd() * max(horizon_ms * 2, 1))
        name = s.next_string(20)
        description = s.next_string(100)
        reserve = initial + self._price()
        size = 8 + len(name) + len(description) + 8 + 8 + 8 + 8 + 8
        return Auction(self.last_auction_id(event_id) + FIRST_AUCTION_ID, name, description, initial, reserve,
                       ts, ts + length_ms * 1000, seller + FIRST_PERSON_ID, category,
                       s.next_extra(size, c.avg_auction_bytes))

    def bid(self, event_id: int, ts: int) -> Bid:
        """The bid of ``event_id``: the rules of :meth:`last_auction_id`,
        :meth:`_random_auction`, :meth:`last_person_id` and :meth:`_random_person`,
        written out for a bid (92% of the events), whose offset in its epoch is always
        past the epoch's people and auctions."""
        c, rnd = self.config, self._random
        epoch = event_id // self._total
        last_auction = epoch * c.auction_proportion + c.auction_proportion - 1
        last_person = epoch * c.person_proportion + c.person_proportion - 1
        if int(rnd() * c.hot_auction_ratio) > 0:
            auction = last_auction // HOT_BATCH * HOT_BATCH
        else:
            low = max(last_auction - c.in_flight_auctions, 0)
            auction = low + int(rnd() * (last_auction - low + 1 + AUCTION_ID_LEAD))
        if int(rnd() * c.hot_bidders_ratio) > 0:
            bidder = last_person // HOT_BATCH * HOT_BATCH + 1
        else:
            active = min(last_person + 1, c.active_people)
            bidder = last_person + 1 - active + int(rnd() * (active + PERSON_ID_LEAD))
        price = int(10.0 ** (rnd() * 6.0) * 100.0 + 0.5)
        if int(rnd() * HOT_CHANNELS_RATIO) > 0:
            i = int(rnd() * len(HOT_CHANNELS))
            channel, url = HOT_CHANNELS[i], self.hot_urls[i]
        else:
            channel, url = self.channels[int(rnd() * CHANNELS_NUMBER)]
        low_size, span = self._bid_padding
        size = low_size + int(rnd() * span) if span else low_size
        offset = int(rnd() * (EXTRA_STRING_LENGTH - size))
        # Flink adds FIRST_PERSON_ID twice to a bidder (BidGenerator.nextBid): kept
        return Bid(auction + FIRST_AUCTION_ID, bidder + 2 * FIRST_PERSON_ID, price, channel, url, ts,
                   self._extra_source[offset:offset + size])

    def __iter__(self) -> Iterator[NextEvent]:
        c = self.config
        people, auctions = c.person_proportion, c.person_proportion + c.auction_proportion
        total = c.total_proportion
        base_ms, delay = c.base_time_us // 1000, c.inter_event_delay_us
        for count in range(c.events):
            number = c.adjusted_event_number(count) if c.out_of_order_group_size > 1 \
                else c.first_event_number + count
            event_id = c.first_event_id + number
            ts = (base_ms + int(number * delay) // 1000) * 1000
            rem = event_id % total
            if rem < people:
                yield NextEvent(0, event_id, self.person(event_id, ts))
            elif rem < auctions:
                yield NextEvent(1, event_id, self.auction(event_id, ts, number))
            else:
                yield NextEvent(2, event_id, self.bid(event_id, ts))
