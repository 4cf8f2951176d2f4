from millwheel.dedup import Deduplicator
from millwheel.state.protocol import Checkpoint
from millwheel.state.sqlite_store import SQLiteStore


def consume(store: SQLiteStore, token: int, ids: list[str], now: int = 0) -> None:
    store.checkpoint(Checkpoint("c", 0, token, now, consumed_ids=ids))


def test_new_ids_pass_and_consumed_ids_are_caught_by_filter_then_store(sqlite_store: SQLiteStore) -> None:
    token = sqlite_store.acquire("c", 0)
    d = Deduplicator(sqlite_store, "c", 0)
    assert d.seen(["a", "b"]) == set()
    assert d.store_lookups == 0  # Bloom misses never touch the store
    consume(sqlite_store, token, ["a"])
    d.remember(["a"])
    assert d.seen(["a", "b"]) == {"a"}
    assert d.store_lookups == 1


def test_filter_is_rebuilt_from_stored_ids_after_restart(sqlite_store: SQLiteStore) -> None:
    token = sqlite_store.acquire("c", 0)
    consume(sqlite_store, token, [f"id{i}" for i in range(1000)])
    fresh = Deduplicator(sqlite_store, "c", 0)  # a new owner, nothing in memory
    assert fresh.seen([f"id{i}" for i in range(995, 1005)]) == {f"id{i}" for i in range(995, 1000)}


def test_expired_ids_are_forgotten_by_store_and_rebuilt_filter(sqlite_store: SQLiteStore) -> None:
    token = sqlite_store.acquire("c", 0)
    consume(sqlite_store, token, ["old"], now=100)
    consume(sqlite_store, token, ["new"], now=500)
    assert sqlite_store.expire_ids("c", 0, token, older_than_us=200) == 1
    d = Deduplicator(sqlite_store, "c", 0)
    assert d.seen(["old", "new"]) == {"new"}


def test_rebuilding_from_many_stored_ids_never_holds_them_all(sqlite_store: SQLiteStore) -> None:
    """A range's filter is rebuilt from every retained ID (when a worker takes the
    range); at the default retention of an hour that is millions of IDs. They are read
    and added in pages, so the rebuild's own memory stays far below what the IDs take
    as Python objects (~120 bytes each: ~24 MB for these 200,000)."""
    import tracemalloc

    token = sqlite_store.acquire("c", 0)
    ids = [f"events/c0123456789ab/{i}/{i % 100}" for i in range(200_000)]
    consume(sqlite_store, token, ids)
    del ids
    tracemalloc.start()
    try:
        d = Deduplicator(sqlite_store, "c", 0)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert d.seen(["events/c0123456789ab/199999/99", "new"]) == {"events/c0123456789ab/199999/99"}
    assert peak < 6 * 2**20, f"rebuild peaked at {peak / 2**20:.1f} MB of Python objects"


def test_the_filter_is_rebuilt_once_half_of_what_it_holds_has_expired(sqlite_store: SQLiteStore) -> None:
    token = sqlite_store.acquire("c", 0)
    consume(sqlite_store, token, [f"a{i}" for i in range(10)], now=100)
    consume(sqlite_store, token, [f"b{i}" for i in range(100)], now=200)
    d = Deduplicator(sqlite_store, "c", 0)
    assert (d.held, d.rebuilds) == (110, 1)
    d.expired(sqlite_store.expire_ids("c", 0, token, older_than_us=150))  # 10 of 110
    assert (d.held, d.rebuilds) == (110, 1)  # kept: the store confirms every maybe-hit
    assert d.seen(["a1", "b1"]) == {"b1"}
    consume(sqlite_store, token, [f"c{i}" for i in range(20)], now=300)
    d.remember([f"c{i}" for i in range(20)])
    assert d.held == 130
    d.expired(sqlite_store.expire_ids("c", 0, token, older_than_us=250))  # the 100 b's: 110 of 130
    assert (d.held, d.rebuilds) == (20, 2)  # rebuilt from the 20 IDs the store keeps
    assert d.seen(["a1", "b1", "c1", "new"]) == {"c1"}


def test_the_filter_holds_at_most_twice_the_retained_ids(sqlite_store: SQLiteStore) -> None:
    """Steady state: 600 IDs consumed each minute, kept 5 minutes, expired every minute.
    The filter never holds more than twice what the store retains, and is rebuilt about
    once per retention period rather than after every expiry."""
    token = sqlite_store.acquire("c", 0)
    d = Deduplicator(sqlite_store, "c", 0)
    minute = 60_000_000
    for m in range(1, 61):
        batch = [f"m{m}-{i}" for i in range(600)]
        consume(sqlite_store, token, batch, now=m * minute)
        d.remember(batch)
        d.expired(sqlite_store.expire_ids("c", 0, token, older_than_us=(m - 5) * minute + 1))
        retained = sum(1 for _ in sqlite_store.iter_ids("c", 0))
        assert retained == 600 * min(m, 5)
        assert d.held <= 2 * retained, (m, d.held, retained)
    assert 10 <= d.rebuilds <= 13  # one at start, then about every 5 minutes (was: 56)
