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
