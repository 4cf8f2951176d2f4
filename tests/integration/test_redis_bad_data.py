"""Bad or foreign data in the Redis keyspace is a clear error naming the key, never a
silently wrong result, and a checkpoint that meets it changes nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest
import redis

from millwheel.errors import CorruptDataError
from millwheel.record import Record, Timer
from millwheel.state.protocol import Checkpoint, Production
from millwheel.state.redis_store import RedisStore
from tests.support.pipelines import millwheel_run, write_spec
from tests.support.redis_server import RedisServer


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer() as srv:
        yield srv


@pytest.fixture
def store(server: RedisServer) -> Iterator[RedisStore]:
    s = RedisStore.from_url(server.url)
    yield s
    s.close()


@pytest.fixture
def raw(server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis(port=server.port)
    yield client
    client.close()


def seeded(store: RedisStore) -> int:
    t = store.acquire("counts", 0)
    store.checkpoint(Checkpoint(
        "counts", 0, t, 100, state_writes={"alice": b"x" * 40, "bob": b"y"},
        timer_sets=[Timer("alice", "end", 50)],
        productions=[Production("totals", "counts", Record("alice", b"v", 5, "p1"))],
        consumed_ids=["in-1"],
    ))
    return t


def test_truncated_state_value_names_key_and_field(store: RedisStore, raw: redis.Redis) -> None:
    seeded(store)
    key = "mw:r:{counts:0}:state"
    value = raw.hget(key, "alice")
    assert isinstance(value, bytes)
    raw.hset(key, "alice", value[:-7])
    with pytest.raises(CorruptDataError, match=r"mw:r:\{counts:0\}:state.*alice.*truncated"):
        store.read_state("counts", ["alice"], range_id=0)
    with pytest.raises(CorruptDataError, match="alice"):
        store.read_state("counts", ["bob", "alice"])


def test_foreign_state_value_names_key(store: RedisStore, raw: redis.Redis) -> None:
    seeded(store)
    raw.hset("mw:r:{counts:0}:state", "bob", b'{"written": "by someone else"}')
    with pytest.raises(CorruptDataError, match=r"mw:r:\{counts:0\}:state.*bob.*not a millwheel value"):
        store.read_state("counts", ["bob"], range_id=0)


def test_wrong_type_key_names_it_on_read(store: RedisStore, raw: redis.Redis) -> None:
    raw.set("mw:r:{counts:2}:state", "a string, not a hash")
    with pytest.raises(CorruptDataError, match=r"mw:r:\{counts:2\}:state"):
        store.read_state("counts", ["k"], range_id=2)
    raw.set("mw:r:{counts:2}:timers", "nope")
    with pytest.raises(CorruptDataError, match=r"mw:r:\{counts:2\}:timers"):
        store.read_timers("counts", 2)
    raw.hset("mw:r:{counts:2}:ids", "a", "b")
    with pytest.raises(CorruptDataError, match=r"mw:r:\{counts:2\}:ids"):
        store.contains_ids("counts", 2, ["a"])
    raw.hset("mw:r:{counts:3}:idgens", "a", "b")
    with pytest.raises(CorruptDataError, match=r"mw:r:\{counts:3\}:idgens"):
        store.contains_ids("counts", 3, ["a"])


@pytest.mark.parametrize("foreign, problem", [
    ("mw:r:{counts:0}:idgens", r"mw:r:\{counts:0\}:idgens.*has type string, expected zset"),
    # the consumed IDs' generation set, named from the checkpoint (generation = now_us)
    ("mw:r:{counts:0}:ids:200", r"mw:r:\{counts:0\}:ids:200.*is not a window buffer or consumed-ID set"),
])
def test_checkpoint_meeting_a_wrong_type_key_changes_nothing(
    store: RedisStore, raw: redis.Redis, foreign: str, problem: str
) -> None:
    t = seeded(store)
    raw.delete(foreign)
    raw.set(foreign, "foreign")  # among the last keys the script would write
    before = {k: raw.dump(k) for k in sorted(raw.keys("mw:r:*"))}
    with pytest.raises(CorruptDataError, match=problem):
        store.checkpoint(Checkpoint(
            "counts", 0, t, 200, state_writes={"alice": b"new", "carol": b"c"},
            timer_sets=[Timer("carol", "end", 60)], timer_clears=[("alice", "end")],
            productions=[Production("totals", "counts", Record("carol", b"w", 6, "p2"))],
            consumed_ids=["in-2"],
        ))
    assert {k: raw.dump(k) for k in sorted(raw.keys("mw:r:*"))} == before


def test_consumed_ids_of_the_layout_before_generations_are_still_read_and_expired(
    store: RedisStore, raw: redis.Redis
) -> None:
    """A store written by a version keeping one ZSET of IDs (score: first consumed):
    its IDs still deduplicate, rebuild filters and expire, beside new generations."""
    t = seeded(store)
    raw.zadd("mw:r:{counts:0}:ids", {"old-a": 100, "old-b": 500})
    store.checkpoint(Checkpoint("counts", 0, t, 700, consumed_ids=["new"], ids_generation=600))
    assert store.contains_ids("counts", 0, ["old-a", "old-b", "new", "nope"]) == {"old-a", "old-b", "new"}
    assert {"old-a", "old-b", "new"} <= set(store.iter_ids("counts", 0))
    assert store.expire_ids("counts", 0, t, 300) >= 1
    assert store.contains_ids("counts", 0, ["old-a", "old-b", "new"]) == {"old-b", "new"}
    store.expire_ids("counts", 0, t, 10**9)
    assert store.contains_ids("counts", 0, ["old-a", "old-b", "new"]) == set()
    assert raw.exists("mw:r:{counts:0}:ids:600") == 0


def test_foreign_token_and_timer_and_outbox_values_name_their_key(store: RedisStore, raw: redis.Redis) -> None:
    t = seeded(store)
    raw.hset("mw:r:{counts:0}:timers", b"5:alicebroken", b"[1, 2")
    with pytest.raises(CorruptDataError, match=r"mw:r:\{counts:0\}:timers.*alicebroken"):
        store.read_timers("counts", 0)
    raw.hset("mw:r:{counts:0}:outbox", b"6:totalsp1", b"\xffMW1garbage")
    with pytest.raises(CorruptDataError, match=r"mw:r:\{counts:0\}:outbox"):
        store.read_outbox("counts", 0)
    raw.set("mw:r:{counts:0}:token", "seven")
    with pytest.raises(CorruptDataError, match=r"mw:r:\{counts:0\}:token"):
        store.current_token("counts", 0)
    with pytest.raises(CorruptDataError, match=r"mw:r:\{counts:0\}:token.*not an integer"):
        store.checkpoint(Checkpoint("counts", 0, t, 300, state_writes={"alice": b"z"}))
    with pytest.raises(CorruptDataError, match=r"mw:r:\{counts:0\}:token"):
        store.acquire("counts", 0)


def test_corrupt_stream_log_entry_names_the_key(store: RedisStore, raw: redis.Redis) -> None:
    store.append_log("totals", [Record("k", b"v" * 30, 1, "r1")])
    (member,) = raw.zrange("mw:log:{totals}:entries", 0, -1)
    assert isinstance(member, bytes)
    raw.zrem("mw:log:{totals}:entries", member)
    raw.zadd("mw:log:{totals}:entries", {member[:-5]: 1})
    with pytest.raises(CorruptDataError, match=r"mw:log:\{totals\}:entries.*truncated"):
        store.read_log("totals", 0, 10)


def test_millwheel_run_on_corrupt_redis_exits_with_the_key_in_the_message(
    server: RedisServer, raw: redis.Redis, tmp_path: Path
) -> None:
    spec = write_spec(tmp_path, 300)
    raw.set("mw:r:{counts:1}:state", "left here by another application")
    proc = millwheel_run(spec, server.url)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert "mw:r:{counts:1}:state" in err.decode(), err.decode()


@pytest.mark.parametrize("foreign", ["mw:r:{counts:0}:buf:60", "mw:r:{counts:0}:bufs"])
def test_checkpoint_meeting_a_foreign_window_buffer_key_changes_nothing(
    store: RedisStore, raw: redis.Redis, foreign: str
) -> None:
    """Window-buffer keys are named inside the script; a foreign one is found before
    any write, alone and inside a write group."""
    t = seeded(store)
    raw.set(foreign, "foreign")
    before = {k: raw.dump(k) for k in sorted(raw.keys("mw:r:*"))}
    cp = Checkpoint("counts", 0, t, 200, state_writes={"alice": b"new"}, consumed_ids=["in-2"],
                    buffer_appends=[("0", b"a"), ("60", b"b")])
    with pytest.raises(CorruptDataError, match=foreign.replace("{", r"\{").replace("}", r"\}")):
        store.checkpoint(cp)
    assert {k: raw.dump(k) for k in sorted(raw.keys("mw:r:*"))} == before
    group = store.write_group
    assert group is not None
    with pytest.raises(CorruptDataError, match="window buffer"):
        with group():
            store.checkpoint(cp)
    assert {k: raw.dump(k) for k in sorted(raw.keys("mw:r:*"))} == before
