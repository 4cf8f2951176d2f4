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
    d.remember(["a"], 0)
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


def test_a_filter_goes_once_the_store_has_forgotten_all_its_generations(sqlite_store: SQLiteStore) -> None:
    token = sqlite_store.acquire("c", 0)
    consume(sqlite_store, token, [f"a{i}" for i in range(10)], now=100)
    consume(sqlite_store, token, [f"b{i}" for i in range(100)], now=200)
    d = Deduplicator(sqlite_store, "c", 0, bucket_us=100)
    assert (d.held, d.filters, d.rebuilds) == (110, 2, 1)
    assert sqlite_store.expire_ids("c", 0, token, older_than_us=150) == 10
    d.forget_expired(150)
    assert (d.held, d.filters) == (100, 1)  # the a's filter went with their generation
    assert d.seen(["a1", "b1"]) == {"b1"}
    consume(sqlite_store, token, [f"c{i}" for i in range(20)], now=250)  # b's bucket, later generation
    d.remember([f"c{i}" for i in range(20)], 250)
    assert (d.held, d.filters) == (120, 1)
    assert sqlite_store.expire_ids("c", 0, token, older_than_us=240) == 100
    d.forget_expired(240)
    assert (d.held, d.filters) == (120, 1)  # kept: the c's generation is still in the store
    assert d.seen(["a1", "b1", "c1", "new"]) == {"c1"}  # the store confirms every maybe-hit
    assert sqlite_store.expire_ids("c", 0, token, older_than_us=300) == 20
    d.forget_expired(300)
    assert (d.held, d.filters, d.rebuilds) == (0, 0, 1)  # never rebuilt
    assert d.seen(["c1", "new"]) == set()


def test_the_filters_hold_the_retained_ids_and_at_most_a_quarter_more(sqlite_store: SQLiteStore) -> None:
    """Steady state: 600 IDs consumed each 10 s, kept 5 minutes in generations of 1/16
    of it, expired every minute as a range worker does. The filters never hold more
    than the retained IDs and a quarter of the retention more (plus the minute between
    expiry passes), and are never rebuilt: memory is flat (issue 31: one scalable
    filter held up to twice the retained IDs and stepped up as it doubled)."""
    token = sqlite_store.acquire("c", 0)
    second, retention = 1_000_000, 300_000_000
    width = retention // 16
    d = Deduplicator(sqlite_store, "c", 0, bucket_us=retention // 4)
    held = []
    for t in range(10, 3601, 10):
        now = t * second
        gen = now - now % width
        batch = [f"t{t}-{i}" for i in range(600)]
        sqlite_store.checkpoint(Checkpoint("c", 0, token, now, consumed_ids=batch, ids_generation=gen))
        d.remember(batch, gen)
        if t % 60 == 0 and sqlite_store.expire_ids("c", 0, token, now - retention):
            d.forget_expired(now - retention)
        retained = sum(1 for _ in sqlite_store.iter_ids("c", 0))
        assert d.held <= retained + 600 * (retention // 4 + 60 * second) // (10 * second), (t, d.held, retained)
        assert d.filters <= 6
        held.append(d.held)
    assert d.rebuilds == 1
    per_retention = 600 * retention // (10 * second)  # IDs consumed in one retention
    middle, last = held[len(held) // 3: 2 * len(held) // 3], held[2 * len(held) // 3:]
    assert max(middle + last) <= 1.5 * per_retention  # the scalable filter reached ~2x
    assert max(last) <= max(middle)  # flat: no step up as the run ages
    assert d.seen(["t3600-1", "t10-1", "new"]) == {"t3600-1"}
