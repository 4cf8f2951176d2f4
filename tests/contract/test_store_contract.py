"""The StateStore contract, run unchanged against every backend (SQLite, Redis).

Each test pins what :mod:`millwheel.state.protocol` promises and the runtime relies
on; a new backend is done when this file passes for it.
"""

from __future__ import annotations

import pytest

from millwheel.clock import ManualClock
from millwheel.errors import FencedError, InvalidSpecError, LogTrimmedError
from millwheel.record import MAX_TIMESTAMP, MIN_TIMESTAMP, Record, TimeDomain, Timer
from millwheel.runtime.retention import LogTrimmer, Retention, read_retained
from millwheel.state import open_store
from millwheel.state.protocol import Checkpoint, Production, StateStore

C = "counts"


def rec(rid: str, key: str = "k", value: bytes = b"v", ts: int = 10) -> Record:
    return Record(key, value, ts, rid)


def prod(rid: str, consumer: str = "down", key: str = "k", ts: int = 10) -> Production:
    return Production(consumer, "out", rec(rid, key, f"value-{rid}".encode(), ts))


def cp(token: int, range_id: int = 0, now_us: int = 1_000, **changes: object) -> Checkpoint:
    return Checkpoint(C, range_id, token, now_us, **changes)  # type: ignore[arg-type]


def snapshot(store: StateStore, range_id: int = 0, keys: tuple[str, ...] = ("a", "b", "c")) -> object:
    """Everything observable about one range, to compare before/after a rejected write."""
    return (
        store.read_state(C, keys),
        sorted((t.key, t.tag, t.time, t.domain, t.hold) for t in store.read_timers(C, range_id)),
        store.read_outbox(C, range_id),
        sorted(store.iter_ids(C, range_id)),
        store.list_keys(C, None, 100),
        store.current_token(C, range_id),
    )


# -- tokens -----------------------------------------------------------------------

def test_tokens_start_at_zero_and_acquire_bumps_by_one(store: StateStore) -> None:
    assert store.current_token(C, 0) == 0
    assert store.acquire(C, 0) == 1
    assert store.acquire(C, 0) == 2
    assert store.current_token(C, 0) == 2


def test_tokens_are_per_computation_and_range(store: StateStore) -> None:
    store.acquire(C, 0)
    store.acquire(C, 0)
    assert store.acquire(C, 1) == 1
    assert store.acquire("other", 0) == 1
    assert store.current_token(C, 0) == 2


def test_tokens_survive_reopening(store_url: str) -> None:
    first = open_store(store_url)
    first.acquire(C, 3)
    first.close()
    second = open_store(store_url)
    try:
        assert second.current_token(C, 3) == 1
        assert second.acquire(C, 3) == 2
    finally:
        second.close()


# -- fencing -------------------------------------------------------------------------

def full_checkpoint(token: int, now_us: int = 1_000) -> Checkpoint:
    return cp(
        token, now_us=now_us,
        state_writes={"a": b"A2", "b": None, "c": b"C"},
        timer_sets=[Timer("a", "t2", 50)],
        timer_clears=[("a", "t1")],
        productions=[prod("p2")],
        consumed_ids=["in-2"],
    )


def test_fenced_checkpoint_changes_nothing_at_all(store: StateStore) -> None:
    old = store.acquire(C, 0)
    store.checkpoint(cp(
        old, state_writes={"a": b"A1", "b": b"B1"}, timer_sets=[Timer("a", "t1", 20)],
        productions=[prod("p1")], consumed_ids=["in-1"],
    ))
    new = store.acquire(C, 0)  # a new owner: the old one is now a zombie
    before = snapshot(store)
    with pytest.raises(FencedError) as info:
        store.checkpoint(full_checkpoint(old))
    assert (info.value.token, info.value.current) == (old, new)
    assert snapshot(store) == before
    assert store.contains_ids(C, 0, ["in-2"]) == set()


@pytest.mark.parametrize("bad_token", [0, -1, 2, 99])
def test_checkpoint_with_a_token_that_is_not_current_is_fenced(store: StateStore, bad_token: int) -> None:
    assert store.acquire(C, 0) == 1
    with pytest.raises(FencedError):
        store.checkpoint(full_checkpoint(bad_token))
    assert snapshot(store) == ({}, [], [], [], [], 1)


def test_never_acquired_range_is_fenced(store: StateStore) -> None:
    with pytest.raises(FencedError):
        store.checkpoint(cp(1, state_writes={"a": b"x"}))
    assert store.read_state(C, ["a"]) == {}
    assert store.current_token(C, 0) == 0


def test_fence_is_per_range(store: StateStore) -> None:
    t0 = store.acquire(C, 0)
    store.acquire(C, 1)
    store.acquire(C, 1)
    store.checkpoint(cp(t0, 0, state_writes={"a": b"ok"}))
    assert store.read_state(C, ["a"]) == {"a": b"ok"}


# -- checkpoint contents ---------------------------------------------------------------

def test_checkpoint_applies_every_part(store: StateStore) -> None:
    t = store.acquire(C, 0)
    store.checkpoint(cp(
        t, state_writes={"a": b"A1", "b": b"B1"}, timer_sets=[Timer("a", "t1", 20)],
        productions=[prod("p1")], consumed_ids=["in-1"],
    ))
    store.checkpoint(full_checkpoint(t))
    assert store.read_state(C, ["a", "b", "c"]) == {"a": b"A2", "c": b"C"}
    assert store.read_timers(C, 0) == [Timer("a", "t2", 50)]
    assert [p.record.record_id for p in store.read_outbox(C, 0)] == ["p1", "p2"]
    assert store.contains_ids(C, 0, ["in-1", "in-2", "in-3"]) == {"in-1", "in-2"}


def test_empty_checkpoint_is_accepted_and_still_fenced(store: StateStore) -> None:
    t = store.acquire(C, 0)
    store.checkpoint(cp(t))
    store.acquire(C, 0)
    with pytest.raises(FencedError):
        store.checkpoint(cp(t))


# -- state -------------------------------------------------------------------------------

def test_state_write_overwrite_delete(store: StateStore) -> None:
    t = store.acquire(C, 0)
    store.checkpoint(cp(t, state_writes={"a": b"1", "b": b"2"}))
    store.checkpoint(cp(t, state_writes={"a": b"3"}))
    assert store.read_state(C, ["a", "b"]) == {"a": b"3", "b": b"2"}
    store.checkpoint(cp(t, state_writes={"a": None, "never": None}))
    assert store.read_state(C, ["a", "b", "never"]) == {"b": b"2"}


def test_state_values_are_exact_bytes_including_empty(store: StateStore) -> None:
    t = store.acquire(C, 0)
    binary = bytes(range(256)) * 3
    store.checkpoint(cp(t, state_writes={"bin": binary, "empty": b"", "ключ ✓": b"\n\x00"}))
    assert store.read_state(C, ["bin", "empty", "ключ ✓", "none"]) == {
        "bin": binary, "empty": b"", "ключ ✓": b"\n\x00",
    }


def test_state_is_per_computation(store: StateStore) -> None:
    t = store.acquire(C, 0)
    store.checkpoint(cp(t, state_writes={"a": b"mine"}))
    assert store.read_state("other", ["a"]) == {}


def test_state_of_many_keys_in_one_read(store: StateStore) -> None:
    t = store.acquire(C, 0)
    writes: dict[str, bytes | None] = {f"k{i:05d}": str(i).encode() for i in range(2500)}
    store.checkpoint(cp(t, state_writes=writes))
    got = store.read_state(C, [f"k{i:05d}" for i in range(0, 2600)])
    assert got == writes


def test_state_read_with_the_owning_range(store: StateStore) -> None:
    t1 = store.acquire(C, 1)
    store.checkpoint(cp(t1, 1, state_writes={"x": b"in range 1"}))
    assert store.read_state(C, ["x"], range_id=1) == {"x": b"in range 1"}
    assert store.read_state(C, ["x"]) == {"x": b"in range 1"}


# -- timers ----------------------------------------------------------------------------

def test_timer_set_replace_clear(store: StateStore) -> None:
    t = store.acquire(C, 0)
    store.checkpoint(cp(t, timer_sets=[Timer("a", "end", 100), Timer("a", "gc", 200, hold=False)]))
    store.checkpoint(cp(t, timer_sets=[Timer("a", "end", 150, TimeDomain.PROCESSING)]))
    assert sorted(store.read_timers(C, 0), key=lambda x: x.tag) == [
        Timer("a", "end", 150, TimeDomain.PROCESSING, True),
        Timer("a", "gc", 200, TimeDomain.EVENT, False),
    ]
    store.checkpoint(cp(t, timer_clears=[("a", "gc"), ("a", "absent")]))
    assert store.read_timers(C, 0) == [Timer("a", "end", 150, TimeDomain.PROCESSING)]


def test_timer_clears_apply_before_sets(store: StateStore) -> None:
    t = store.acquire(C, 0)
    store.checkpoint(cp(t, timer_sets=[Timer("a", "x", 1)]))
    store.checkpoint(cp(t, timer_clears=[("a", "x")], timer_sets=[Timer("a", "x", 2)]))
    assert store.read_timers(C, 0) == [Timer("a", "x", 2)]


def test_read_timers_is_per_range_and_read_key_timers_is_time_ordered(store: StateStore) -> None:
    t0, t1 = store.acquire(C, 0), store.acquire(C, 1)
    store.checkpoint(cp(t0, 0, timer_sets=[Timer("a", "late", 300), Timer("a", "early", 100),
                                          Timer("b", "end", 200)]))
    store.checkpoint(cp(t1, 1, timer_sets=[Timer("z", "end", 5)]))
    assert sorted(store.read_timers(C, 0), key=lambda x: (x.key, x.time)) == [
        Timer("a", "early", 100), Timer("a", "late", 300), Timer("b", "end", 200),
    ]
    assert store.read_timers(C, 1) == [Timer("z", "end", 5)]
    assert store.read_key_timers(C, "a") == [Timer("a", "early", 100), Timer("a", "late", 300)]
    assert store.read_key_timers(C, "a", range_id=0) == [Timer("a", "early", 100), Timer("a", "late", 300)]
    assert store.read_key_timers(C, "nobody") == []


def test_timer_keys_and_tags_that_look_alike_stay_apart(store: StateStore) -> None:
    t = store.acquire(C, 0)
    tricky = [Timer("a\x00b", "c", 1), Timer("a", "b\x00c", 2), Timer("a:", "1", 3), Timer("a", ":1", 4)]
    store.checkpoint(cp(t, timer_sets=tricky))
    assert sorted(store.read_timers(C, 0), key=lambda x: x.time) == tricky
    assert store.read_key_timers(C, "a") == [Timer("a", "b\x00c", 2), Timer("a", ":1", 4)]


# -- outbox --------------------------------------------------------------------------

def test_outbox_keeps_checkpoint_order_and_ignores_repeats(store: StateStore) -> None:
    t = store.acquire(C, 0)
    store.checkpoint(cp(t, productions=[prod("z1"), prod("a2")]))
    store.checkpoint(cp(t, productions=[prod("m3"), prod("z1")]))  # z1 again: ignored
    assert [p.record.record_id for p in store.read_outbox(C, 0)] == ["z1", "a2", "m3"]
    assert store.read_outbox(C, 0)[0] == prod("z1")


def test_outbox_entry_is_per_consumer(store: StateStore) -> None:
    t = store.acquire(C, 0)
    store.checkpoint(cp(t, productions=[prod("r1", "x"), prod("r1", "y"), prod("r1", "log:out")]))
    assert [p.consumer for p in store.read_outbox(C, 0)] == ["x", "y", "log:out"]
    store.ack(C, 0, t, [("y", "r1")])
    assert [p.consumer for p in store.read_outbox(C, 0)] == ["x", "log:out"]


def test_ack_deletes_entries_and_is_fenced(store: StateStore) -> None:
    t = store.acquire(C, 0)
    store.checkpoint(cp(t, productions=[prod("r1"), prod("r2"), prod("r3")]))
    store.ack(C, 0, t, [("down", "r2"), ("down", "unknown")])
    assert [p.record.record_id for p in store.read_outbox(C, 0)] == ["r1", "r3"]
    store.acquire(C, 0)
    with pytest.raises(FencedError):
        store.ack(C, 0, t, [("down", "r1")])
    assert [p.record.record_id for p in store.read_outbox(C, 0)] == ["r1", "r3"]


def test_outbox_is_per_range(store: StateStore) -> None:
    t0, t1 = store.acquire(C, 0), store.acquire(C, 1)
    store.checkpoint(cp(t0, 0, productions=[prod("r0")]))
    store.checkpoint(cp(t1, 1, productions=[prod("r1")]))
    assert [p.record.record_id for p in store.read_outbox(C, 1)] == ["r1"]
    assert store.read_outbox("other", 0) == []


# -- consumed record IDs ------------------------------------------------------------------

def test_consumed_ids_lookup_iterate_and_expire(store: StateStore) -> None:
    t = store.acquire(C, 0)
    store.checkpoint(cp(t, now_us=100, consumed_ids=["old-1", "old-2"]))
    store.checkpoint(cp(t, now_us=200, consumed_ids=["mid"]))
    store.checkpoint(cp(t, now_us=300, consumed_ids=["new"]))
    assert store.contains_ids(C, 0, ["old-1", "new", "nope"]) == {"old-1", "new"}
    assert sorted(store.iter_ids(C, 0)) == ["mid", "new", "old-1", "old-2"]
    assert store.expire_ids(C, 0, t, 200) == 2  # strictly older than 200
    assert sorted(store.iter_ids(C, 0)) == ["mid", "new"]
    assert store.contains_ids(C, 0, ["old-1", "old-2", "mid"]) == {"mid"}


def test_an_id_consumed_again_is_kept_from_its_latest_consumption(store: StateStore) -> None:
    """Remembering longer never breaks deduplication; forgetting early would."""
    t = store.acquire(C, 0)
    store.checkpoint(cp(t, now_us=100, consumed_ids=["again", "once"]))
    store.checkpoint(cp(t, now_us=300, consumed_ids=["again"]))
    store.expire_ids(C, 0, t, 200)
    assert store.contains_ids(C, 0, ["again", "once"]) == {"again"}
    assert set(store.iter_ids(C, 0)) == {"again"}


def test_consumed_ids_are_forgotten_a_generation_at_a_time(store: StateStore) -> None:
    """Checkpoints naming one ``ids_generation`` share it: the generation is forgotten
    once its newest ID is past the bound, all of it at once, never before."""
    t = store.acquire(C, 0)
    store.checkpoint(cp(t, now_us=1_000, consumed_ids=["a1", "a2"], ids_generation=0))
    store.checkpoint(cp(t, now_us=1_900, consumed_ids=["a3"], ids_generation=0))
    store.checkpoint(cp(t, now_us=2_100, consumed_ids=["b1"], ids_generation=2_000))
    assert store.expire_ids(C, 0, t, 1_500) == 0  # a3 (1,900) keeps its generation
    assert store.contains_ids(C, 0, ["a1", "a2", "a3", "b1"]) == {"a1", "a2", "a3", "b1"}
    assert store.expire_ids(C, 0, t, 2_000) == 3
    assert store.contains_ids(C, 0, ["a1", "a2", "a3", "b1"]) == {"b1"}
    assert sorted(store.iter_ids(C, 0)) == ["b1"]
    many = [f"m{i}" for i in range(12_345)]  # more than one expiry transaction's worth
    for start in range(0, len(many), 5_000):
        store.checkpoint(cp(t, now_us=3_000 + start, consumed_ids=many[start:start + 5_000], ids_generation=3_000))
    assert store.expire_ids(C, 0, t, 20_000) == len(many) + 1
    assert list(store.iter_ids(C, 0)) == []


def test_consumed_ids_are_per_range_and_many_at_once(store: StateStore) -> None:
    t0, t1 = store.acquire(C, 0), store.acquire(C, 1)
    ids = [f"id-{i}" for i in range(2500)]
    store.checkpoint(cp(t0, 0, consumed_ids=ids))
    store.checkpoint(cp(t1, 1, consumed_ids=["only-1"]))
    assert store.contains_ids(C, 0, ids[::7] + ["only-1"]) == set(ids[::7])
    assert sorted(store.iter_ids(C, 0)) == sorted(ids)
    assert list(store.iter_ids(C, 1)) == ["only-1"]


def test_iter_ids_reads_every_id_across_pages(store: StateStore) -> None:
    """More IDs than one page: every one comes back once, each range's its own."""
    from millwheel.state.protocol import ID_PAGE

    t0, t1 = store.acquire(C, 0), store.acquire(C, 1)
    ids = [f"r{i}" for i in range(2 * ID_PAGE + 123)]
    for start in range(0, len(ids), 5000):
        store.checkpoint(cp(t0, 0, now_us=1_000 + start, consumed_ids=ids[start:start + 5000]))
    store.checkpoint(cp(t1, 1, consumed_ids=[f"r{ID_PAGE}", "only-1"]))
    got = list(store.iter_ids(C, 0))
    assert len(got) == len(ids) and set(got) == set(ids)
    assert sorted(store.iter_ids(C, 1)) == ["only-1", f"r{ID_PAGE}"]
    exact = [f"x{i}" for i in range(ID_PAGE)]  # exactly one full page, then an empty one
    t2 = store.acquire(C, 2)
    store.checkpoint(cp(t2, 2, consumed_ids=exact))
    assert sorted(store.iter_ids(C, 2)) == sorted(exact)


def test_expire_ids_is_fenced(store: StateStore) -> None:
    t = store.acquire(C, 0)
    store.checkpoint(cp(t, now_us=100, consumed_ids=["x"]))
    store.acquire(C, 0)
    with pytest.raises(FencedError):
        store.expire_ids(C, 0, t, 10**9)
    assert list(store.iter_ids(C, 0)) == ["x"]


# -- list_keys ---------------------------------------------------------------------------

def test_list_keys_pages_in_order_across_ranges(store: StateStore) -> None:
    tokens = {r: store.acquire(C, r) for r in range(3)}
    keys = sorted({"", "a", "b", "ba", "é", "z", "Z", "0", "a b", *(f"k{i:03d}" for i in range(40))})
    for i, key in enumerate(keys):
        r = i % 3
        store.checkpoint(cp(tokens[r], r, state_writes={key: b"1"}))
    pages: list[str] = []
    after: str | None = None
    while True:
        page = store.list_keys(C, after, 7)
        assert len(page) <= 7
        if not page:
            break
        pages += page
        after = page[-1]
    assert pages == keys
    assert store.list_keys(C, "b", 2) == ["ba", "k000"]
    assert store.list_keys(C, None, 0) == []


def test_list_keys_forgets_deleted_state(store: StateStore) -> None:
    t = store.acquire(C, 0)
    store.checkpoint(cp(t, state_writes={"a": b"1", "b": b"2"}))
    store.checkpoint(cp(t, state_writes={"a": None}))
    assert store.list_keys(C, None, 10) == ["b"]
    assert store.list_keys("other", None, 10) == []


# -- stream log ---------------------------------------------------------------------------

def test_append_log_is_idempotent_by_record_id(store: StateStore) -> None:
    assert store.append_log("s", [rec("r1"), rec("r2"), rec("r1")]) == 2
    assert store.append_log("s", [rec("r2", value=b"changed"), rec("r3")]) == 1
    assert [(r.record_id, r.value) for _s, r in store.read_log("s", 0, 10)] == [
        ("r1", b"v"), ("r2", b"v"), ("r3", b"v"),
    ]
    assert store.append_log("s", []) == 0


def test_read_log_order_and_paging(store: StateStore) -> None:
    records = [Record(f"key{i % 5}", bytes([i % 256]) * (i % 7), 1_000 + i, f"r{i:04d}") for i in range(2300)]
    assert store.append_log("s", records) == 2300
    store.append_log("other", [rec("x")])
    seen: list[tuple[int, Record]] = []
    after = 0
    while page := store.read_log("s", after, 500):
        seen += page
        after = page[-1][0]
    assert [r for _s, r in seen] == records
    seqs = [s for s, _r in seen]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs) and seqs[0] > 0
    assert store.read_log("s", seqs[-1], 10) == []
    assert store.read_log("s", seqs[9], 2) == seen[10:12]
    assert [r.record_id for _s, r in store.read_log("other", 0, 10)] == ["x"]
    assert store.read_log("missing", 0, 10) == []


def test_log_end_fixes_where_a_reader_stops(store: StateStore) -> None:
    assert store.log_end("s") == (0, 0)
    assert store.log_end("s", 7) == (7, 0)
    store.append_log("s", [rec(f"r{i}") for i in range(5)])
    store.append_log("other", [rec("x")])
    seqs = [seq for seq, _r in store.read_log("s", 0, 10)]
    assert store.log_end("s") == (seqs[-1], 5)
    assert store.log_end("s", seqs[1]) == (seqs[-1], 3)
    assert store.log_end("s", seqs[-1]) == (seqs[-1], 0)
    end = store.log_end("s")
    store.append_log("s", [rec("later")])  # written after the end was fixed: beyond it
    [(later, _r)] = [(seq, r) for seq, r in store.read_log("s", 0, 10) if seq > end[0]]
    assert _r.record_id == "later" and later > end[0]
    assert store.log_end("s", end[0]) == (later, 1) and store.log_end("s") == (later, 6)
    assert store.log_end("s", 0, end[0]) == end and store.log_end("s", seqs[1], seqs[3]) == (seqs[3], 2)
    assert store.log_end("s", seqs[3], seqs[3]) == (seqs[3], 0)


# -- stream-log retention (millwheel.runtime.retention) ------------------------------------

def test_log_stats_measure_entries_in_batches(store: StateStore) -> None:
    store.append_log("s", [rec(f"r{i}", value=b"x" * 100) for i in range(10)])
    store.append_log("other", [rec("o", value=b"y" * 5000)])
    seqs = [seq for seq, _r in store.read_log("s", 0, 100)]
    rows, size, last = store.log_stats("s", 0, 4)
    assert (rows, last) == (4, seqs[3])
    assert 4 * 100 <= size <= 4 * 200  # key + value + ID, and a small overhead per entry
    assert store.log_stats("s", seqs[3], 100)[::2] == (6, seqs[-1])
    assert store.log_stats("s", seqs[-1], 100) == (0, 0, seqs[-1])
    assert store.log_stats("missing", 0, 100) == (0, 0, 0)
    assert store.log_stats("s", 0, 1 << 62)[::2] == (10, seqs[-1])  # "all of them" (the replay's end)


def test_trim_log_removes_the_oldest_in_batches_and_raises_the_start(store: StateStore) -> None:
    store.append_log("s", [rec(f"r{i}") for i in range(10)])
    store.append_log("other", [rec("o")])
    seqs = [seq for seq, _r in store.read_log("s", 0, 100)]
    assert store.log_start("s") == 0
    assert store.trim_log("s", seqs[6], 3) == 3  # at most max_rows, oldest first
    assert store.log_start("s") == seqs[2]
    assert [r.record_id for _s, r in store.read_log("s", 0, 100)] == [f"r{i}" for i in range(3, 10)]
    assert store.trim_log("s", seqs[6], 100) == 4  # the rest through seqs[6]
    assert store.log_start("s") == seqs[6]
    assert store.trim_log("s", seqs[6], 100) == 0
    assert store.log_start("s") == seqs[6]  # never goes back
    assert [r.record_id for _s, r in store.read_log("s", seqs[6], 100)] == ["r7", "r8", "r9"]
    assert store.log_start("other") == 0 and len(store.read_log("other", 0, 10)) == 1
    # A removed entry's ID is forgotten: the record appended again is a new entry, after the rest.
    assert store.append_log("s", [rec("r0"), rec("r8")]) == 1
    assert [r.record_id for _s, r in store.read_log("s", seqs[6], 100)] == ["r7", "r8", "r9", "r0"]


def test_retention_trims_by_age_in_small_batches(store: StateStore) -> None:
    clock = ManualClock(1_000_000_000)
    trimmer = LogTrimmer(store, clock, batch_rows=7, pass_batches=2)
    policy = {"s": Retention(age_us=60_000_000, bytes=0)}
    store.append_log("s", [rec(f"old{i}") for i in range(30)])
    assert trimmer.run(policy)  # two batches of 7 per pass: more than one pass to measure
    while trimmer.run(policy):
        pass
    clock.advance(30_000_000)
    store.append_log("s", [rec(f"new{i}") for i in range(5)])
    while trimmer.run(policy):
        pass
    clock.advance(31_000_000)  # the old records are 61 s old, the new ones 31 s
    busy = trimmer.run(policy)
    assert busy and 0 < trimmer.removed == 14  # a pass removes at most 2 batches of 7
    while trimmer.run(policy):
        pass
    kept = store.read_log("s", 0, 100)
    assert [r.record_id for _s, r in kept] == [f"new{i}" for i in range(5)]
    assert store.log_start("s") < kept[0][0]
    # A fresh trimmer (a restart, another leader) resumes from the saved marks.
    trimmer.save(force=True)
    again = LogTrimmer(store, clock)
    clock.advance(30_000_000)
    again.run(policy)
    assert store.read_log("s", 0, 100) == []


def test_retention_trims_by_bytes_but_never_the_youngest(store: StateStore) -> None:
    clock = ManualClock(1_000_000_000)
    trimmer = LogTrimmer(store, clock, batch_rows=10, min_trim_age_us=5_000_000)
    policy = {"s": Retention(age_us=0, bytes=64 * 1024)}
    for i in range(200):  # 1 KiB records, a batch of 10 a second: 200 KiB over 20 s
        if i % 10 == 0:
            clock.advance(1_000_000)
        store.append_log("s", [rec(f"r{i:03d}", value=b"v" * 1000)])
        trimmer.run(policy)
    kept = [r.record_id for _s, r in store.read_log("s", 0, 1000)]
    kept_bytes = sum(len(r.key) + len(r.value) + len(r.record_id) for _s, r in store.read_log("s", 0, 1000))
    assert kept == [f"r{i:03d}" for i in range(200 - len(kept), 200)]  # the newest, in order
    assert 48 * 1024 <= kept_bytes <= 64 * 1024
    # 100 KiB more at once: over the limit on their own, but younger than the floor
    # (5 s here): only older records go.
    store.append_log("s", [rec(f"x{i}", value=b"v" * 1000) for i in range(100)])
    while trimmer.run(policy):
        pass
    ids = [r.record_id for _s, r in store.read_log("s", 0, 1000)]
    assert ids[-100:] == [f"x{i}" for i in range(100)] and len(ids) < len(kept) + 100
    clock.advance(5_000_000)
    while trimmer.run(policy):
        pass
    ids = [r.record_id for _s, r in store.read_log("s", 0, 1000)]
    assert ids == [f"x{i}" for i in range(100 - len(ids), 100)] and 48 <= len(ids) <= 64


def test_read_retained_names_the_oldest_position_never_a_gap(store: StateStore) -> None:
    store.append_log("s", [rec(f"r{i}") for i in range(6)])
    seqs = [seq for seq, _r in store.read_log("s", 0, 100)]
    assert read_retained(store, "s", 0, 100)[1] == store.read_log("s", 0, 100)
    assert read_retained(store, "s", -5, 100)[1] == store.read_log("s", 0, 100)  # nothing removed yet
    store.trim_log("s", seqs[2], 100)
    with pytest.raises(LogTrimmedError, match=f"oldest available position.*--after {seqs[2]}") as info:
        read_retained(store, "s", seqs[1], 100)
    assert info.value.oldest == seqs[2]
    pos, entries = read_retained(store, "s", seqs[2], 100)
    assert pos == seqs[2] and [r.record_id for _s, r in entries] == ["r3", "r4", "r5"]
    pos, entries = read_retained(store, "s", 0, 100, skip_removed=True)
    assert pos == seqs[2] and [r.record_id for _s, r in entries] == ["r3", "r4", "r5"]


# -- watermarks --------------------------------------------------------------------------

def test_report_watermark_never_goes_backwards(store: StateStore) -> None:
    t = store.acquire(C, 0)
    assert store.report_watermark(C, 0, t, 500) == 500
    assert store.report_watermark(C, 0, t, 400) == 500
    assert store.report_watermark(C, 0, t, 900) == 900
    assert store.read_watermarks(C) == {0: 900}


def test_watermarks_are_exact_at_the_extremes(store: StateStore) -> None:
    t0, t1, t2 = store.acquire(C, 0), store.acquire(C, 1), store.acquire(C, 2)
    assert store.report_watermark(C, 0, t0, MIN_TIMESTAMP) == MIN_TIMESTAMP
    assert store.report_watermark(C, 0, t0, -5) == -5
    assert store.report_watermark(C, 0, t0, -7) == -5
    assert store.report_watermark(C, 1, t1, MAX_TIMESTAMP - 2) == MAX_TIMESTAMP - 2
    assert store.report_watermark(C, 1, t1, MAX_TIMESTAMP - 1) == MAX_TIMESTAMP - 1
    assert store.report_watermark(C, 1, t1, MAX_TIMESTAMP - 3) == MAX_TIMESTAMP - 1
    assert store.report_watermark(C, 2, t2, 1_700_000_000_123_457) == 1_700_000_000_123_457
    assert store.report_watermark(C, 2, t2, 1_700_000_000_123_456) == 1_700_000_000_123_457
    assert store.read_watermarks(C) == {0: -5, 1: MAX_TIMESTAMP - 1, 2: 1_700_000_000_123_457}


def test_report_watermark_is_fenced(store: StateStore) -> None:
    t = store.acquire(C, 0)
    store.report_watermark(C, 0, t, 100)
    store.acquire(C, 0)
    with pytest.raises(FencedError):
        store.report_watermark(C, 0, t, 200)
    assert store.read_watermarks(C) == {0: 100}
    assert store.read_watermarks("nobody") == {}


# -- metadata --------------------------------------------------------------------------------

def test_meta_put_get_list_delete(store: StateStore) -> None:
    assert store.get_meta("computations/a") is None
    store.put_meta("computations/a", b"1")
    store.put_meta("computations/b", b"\x00\xff")
    store.put_meta("computations/a", b"2")
    store.put_meta("injectors/x", b"3")
    store.put_meta("c*[?]\\", b"glob")
    assert store.get_meta("computations/a") == b"2"
    assert store.list_meta("computations/") == {"computations/a": b"2", "computations/b": b"\x00\xff"}
    assert list(store.list_meta("")) == sorted(["computations/a", "computations/b", "injectors/x", "c*[?]\\"])
    assert store.list_meta("c*[") == {"c*[?]\\": b"glob"}
    store.put_meta("computations/a", None)
    store.put_meta("never-there", None)
    assert store.get_meta("computations/a") is None
    assert store.list_meta("computations/") == {"computations/b": b"\x00\xff"}


def test_insert_meta_writes_only_where_nothing_is(store: StateStore) -> None:
    assert store.insert_meta("credentials/a", b"first") is True
    assert store.insert_meta("credentials/a", b"second") is False  # taken: left unchanged
    assert store.get_meta("credentials/a") == b"first"
    assert store.insert_meta("credentials/a", b"first") is True  # the same bytes: a retried call's own
    store.put_meta("credentials/a", None)
    assert store.insert_meta("credentials/a", b"third") is True  # free again once deleted
    assert store.list_meta("credentials/") == {"credentials/a": b"third"}
    with pytest.raises(InvalidSpecError, match="reserved"):
        store.insert_meta("lease/holder", b"x")


def test_put_metas_sets_and_deletes_in_one_write(store: StateStore) -> None:
    store.put_meta("registry/x/old", b"gone soon")
    store.put_meta("registry/x/kept", b"kept")
    big = bytes(range(256)) * 1024  # binary, 256 KiB
    store.put_metas({"registry/x/head": b"\x00head", "registry/x/old": None, "registry/x/big": big,
                     "registry/x/empty": b"", "registry/x/never-there": None, "c*[?]\\": b"glob"})
    assert store.list_meta("registry/x/") == {"registry/x/big": big, "registry/x/empty": b"",
                                              "registry/x/head": b"\x00head", "registry/x/kept": b"kept"}
    assert store.get_meta("c*[?]\\") == b"glob"
    store.put_metas({})  # nothing to write: nothing changes
    store.put_metas({"registry/x/head": None, "registry/x/big": b"small"})
    assert store.list_meta("registry/x/") == {"registry/x/big": b"small", "registry/x/empty": b"",
                                              "registry/x/kept": b"kept"}


def test_put_metas_naming_a_lease_entry_writes_nothing(store: StateStore) -> None:
    store.put_meta("registry/y", b"before")
    with pytest.raises(InvalidSpecError, match="reserved"):
        store.put_metas({"registry/y": b"after", "registry/z": b"new", "lease/epoch": b"99"})
    assert store.list_meta("registry/") == {"registry/y": b"before"}
    assert store.read_lease() is None


# -- failing user code: attempt counts, error counters, recent errors ----------------

def test_bump_attempts_counts_per_item_and_keeps_the_last_error(store: StateStore) -> None:
    t = store.acquire(C, 0)
    assert store.bump_attempts(C, 0, t, "rec-1", b'{"message": "first"}') == 1
    assert store.bump_attempts(C, 0, t, "rec-1", b'{"message": "second"}') == 2
    assert store.bump_attempts(C, 0, t, "timer\x1fk\x1ftag\x1f5", b"{}") == 1
    report = store.read_errors(C, 0)
    assert report.attempts == {"rec-1": (2, b'{"message": "second"}'), "timer\x1fk\x1ftag\x1f5": (1, b"{}")}
    assert store.read_errors(C, 1).attempts == {}  # per range
    assert store.read_errors("other", 0).attempts == {}  # per computation


def test_bump_attempts_survives_reopening_and_a_new_owner(store_url: str) -> None:
    first = open_store(store_url)
    t = first.acquire(C, 0)
    first.bump_attempts(C, 0, t, "rec-1", b"{}")
    first.close()
    second = open_store(store_url)
    try:
        t2 = second.acquire(C, 0)  # a crash loop: every new owner sees the count so far
        assert second.bump_attempts(C, 0, t2, "rec-1", b"{}") == 2
    finally:
        second.close()


def test_bump_attempts_is_fenced(store: StateStore) -> None:
    old = store.acquire(C, 0)
    store.bump_attempts(C, 0, old, "rec-1", b"{}")
    store.acquire(C, 0)
    with pytest.raises(FencedError):
        store.bump_attempts(C, 0, old, "rec-1", b"{}")
    assert store.read_errors(C, 0).attempts == {"rec-1": (1, b"{}")}


def test_checkpoint_resolves_attempts_counts_and_keeps_recent_errors(store: StateStore) -> None:
    from millwheel.state.protocol import RECENT_ERRORS

    t = store.acquire(C, 0)
    store.bump_attempts(C, 0, t, "rec-1", b"{}")
    store.bump_attempts(C, 0, t, "rec-2", b"{}")
    store.checkpoint(cp(t, consumed_ids=["rec-1"], resolved=["rec-1"],
                        counters={"dead_lettered": 1, "late_dropped": 4}, errors=[b"e-0"]))
    report = store.read_errors(C, 0)
    assert report.attempts == {"rec-2": (1, b"{}")}
    assert report.counters == {"dead_lettered": 1, "late_dropped": 4}
    assert report.recent == [b"e-0"]
    for i in range(1, RECENT_ERRORS + 5):
        store.checkpoint(cp(t, counters={"dead_lettered": 1}, errors=[f"e-{i}".encode()]))
    report = store.read_errors(C, 0)
    assert report.counters["dead_lettered"] == RECENT_ERRORS + 5
    assert report.recent == [f"e-{i}".encode() for i in range(RECENT_ERRORS + 4, 4, -1)]
    # a resolved item counts from zero again
    assert store.bump_attempts(C, 0, t, "rec-1", b"{}") == 1


def test_fenced_checkpoint_changes_no_error_counts(store: StateStore) -> None:
    old = store.acquire(C, 0)
    store.bump_attempts(C, 0, old, "rec-1", b"{}")
    store.acquire(C, 0)
    with pytest.raises(FencedError):
        store.checkpoint(cp(old, resolved=["rec-1"], counters={"skipped": 1}, errors=[b"x"]))
    report = store.read_errors(C, 0)
    assert (report.attempts, report.counters, report.recent) == ({"rec-1": (1, b"{}")}, {}, [])


def test_ids_come_back_with_their_generation_and_live_generations_are_listed(store: StateStore) -> None:
    """What a Bloom filter per span of generations is rebuilt from (millwheel.dedup):
    every retained ID once per generation it was consumed in, with that generation,
    across pages; and the generations an expiry pass has not forgotten."""
    from millwheel.state.protocol import ID_PAGE

    t = store.acquire(C, 0)
    big = [f"g{i}" for i in range(ID_PAGE + 7)]
    store.checkpoint(cp(t, now_us=1_000, consumed_ids=["a1", "a2"], ids_generation=0))
    store.checkpoint(cp(t, now_us=2_100, consumed_ids=big[:6_000], ids_generation=2_000))
    store.checkpoint(cp(t, now_us=2_200, consumed_ids=big[6_000:] + ["a1"], ids_generation=2_000))
    assert store.id_generations(C, 0) == [0, 2_000]
    got: dict[int | None, list[str]] = {}
    for gen, page in store.iter_id_generations(C, 0):
        assert 0 < len(page) <= 2 * ID_PAGE  # SSCAN's COUNT is a hint
        got.setdefault(gen, []).extend(page)
    assert sorted(got) == [0, 2_000]
    assert sorted(got[0]) == ["a1", "a2"]
    assert sorted(got[2_000]) == sorted(big + ["a1"])
    assert store.expire_ids(C, 0, t, 1_500) == 2
    assert store.id_generations(C, 0) == [2_000]
    assert {g for g, _page in store.iter_id_generations(C, 0)} == {2_000}
    assert store.id_generations(C, 1) == [] and list(store.iter_id_generations(C, 1)) == []
