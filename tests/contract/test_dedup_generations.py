"""The record-ID filters follow the store's generations on every backend
(millwheel.dedup): a filter goes only once the store has forgotten all of its
generations, never while one of its IDs could still be a duplicate; and IDs a Redis
store kept before generations existed are caught until an expiry pass has passed them."""

from __future__ import annotations

import redis

from millwheel.dedup import Deduplicator
from millwheel.state import open_store
from millwheel.state.protocol import Checkpoint, StateStore
from tests.support.redis_server import RedisServer

C = "c"


def consume(store: StateStore, token: int, ids: list[str], now: int, gen: int) -> None:
    store.checkpoint(Checkpoint(C, 0, token, now, consumed_ids=ids, ids_generation=gen))


def test_filters_are_dropped_with_their_generations_never_before(store: StateStore) -> None:
    t = store.acquire(C, 0)
    consume(store, t, ["a1", "a2"], now=1_000, gen=1_000)
    consume(store, t, ["b1"], now=2_500, gen=2_000)  # bucket 0 (width 4,000) holds gens 1,000 and 2,000
    consume(store, t, ["c1"], now=5_000, gen=5_000)  # bucket 4,000
    d = Deduplicator(store, C, 0, bucket_us=4_000)
    assert (d.filters, d.held) == (2, 4)
    assert store.expire_ids(C, 0, t, 2_000) == 2  # gen 1,000 only: b1 keeps bucket 0
    d.forget_expired(2_000)
    assert d.filters == 2
    assert d.seen(["a1", "b1", "c1", "new"]) == {"b1", "c1"}
    consume(store, t, ["d1"], now=5_100, gen=5_000)
    d.remember(["d1"], 5_000)
    assert store.expire_ids(C, 0, t, 3_000) == 1  # gen 2,000: bucket 0 has nothing left
    d.forget_expired(3_000)
    assert (d.filters, d.held) == (1, 2)
    assert d.seen(["b1", "c1", "d1"]) == {"c1", "d1"}
    fresh = Deduplicator(store, C, 0, bucket_us=4_000)  # a new owner sees the same
    assert (fresh.filters, fresh.held) == (1, 2)
    assert fresh.seen(["b1", "c1", "d1"]) == {"c1", "d1"}


def test_ids_stored_before_generations_are_caught_until_expired_past_them() -> None:
    with RedisServer() as server:
        store = open_store(server.url)
        try:
            t = store.acquire(C, 0)
            consume(store, t, ["new1"], now=10_000, gen=10_000)
            raw = redis.Redis.from_url(server.url)
            legacy = next(k for k in raw.keys("*") if k.endswith(b":ids:10000"))[: -len(b":10000")]
            raw.zadd(legacy, {"old1": 1_000, "old2": 2_000})  # the layout before generations
            now = [20_000]
            d = Deduplicator(store, C, 0, bucket_us=4_000, now_us=lambda: now[0])
            assert (d.filters, d.held) == (2, 3)
            assert d.seen(["old1", "old2", "new1", "x"]) == {"old1", "old2", "new1"}
            assert store.expire_ids(C, 0, t, 1_500) == 1  # old1
            d.forget_expired(1_500)
            assert d.filters == 2  # old2 may still be in the store: its filter stays
            assert d.seen(["old1", "old2"]) == {"old2"}
            assert store.expire_ids(C, 0, t, 15_000) == 2  # old2 and generation 10,000
            d.forget_expired(15_000)
            assert d.filters == 1  # not yet past the rebuild (20,000): kept, a little longer
            consume(store, t, ["late"], now=25_000, gen=24_000)
            d.remember(["late"], 24_000)
            assert store.expire_ids(C, 0, t, 20_001) == 0  # nothing left to forget here...
            store.checkpoint(Checkpoint(C, 0, t, 21_000, consumed_ids=["z"], ids_generation=20_000))
            assert store.expire_ids(C, 0, t, 22_000) == 1
            d.forget_expired(22_000)  # ...past the rebuild now: every pre-generation ID is gone
            assert d.filters == 1 and d.seen(["old2", "late"]) == {"late"}
        finally:
            store.close()
