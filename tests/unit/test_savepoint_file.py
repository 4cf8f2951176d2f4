"""The savepoint file and its store round trip (millwheel/savepoint/), without a service.

Every flipped byte, every truncation and any trailing byte must be refused before a
frame is believed; what a store holds (state, timers, pending productions, consumed
IDs, watermarks, error counts, logs) must come back equal in another store.
"""

from __future__ import annotations

import io
import struct
from pathlib import Path

import pytest

from millwheel.keys import key_range
from millwheel.record import Record, TimeDomain, Timer
from millwheel.savepoint import capture, restore
from millwheel.savepoint.format import (
    FORMAT_VERSION,
    MAGIC,
    MIN_FRAME_BYTES,
    SavepointFileError,
    Verifier,
    Writer,
    frames,
    verify,
)
from millwheel.state import open_store
from millwheel.state.protocol import Checkpoint, Production, StateStore


def small_file() -> bytes:
    buf = io.BytesIO()
    w = Writer(buf)
    w.frame({"t": "header", "created_us": 5, "registry": {}})
    w.frame({"t": "ids", "node": "c", "range": 0, "items": ["a", "b"]})
    w.finish()
    return buf.getvalue()


def check(data: bytes) -> str:
    return verify(io.BytesIO(data), len(data))


def test_a_good_file_reads_back() -> None:
    data = small_file()
    check(data)
    assert [f["t"] for f in frames(io.BytesIO(data))] == ["header", "ids"]


def test_every_flipped_byte_truncation_and_trailing_byte_is_refused() -> None:
    data = small_file()
    for i in range(len(data)):
        flipped = data[:i] + bytes([data[i] ^ 0x40]) + data[i + 1:]
        with pytest.raises(SavepointFileError):
            check(flipped)
    for n in range(len(data)):
        with pytest.raises(SavepointFileError, match="truncated|corrupt|not a millwheel"):
            check(data[:n])
    with pytest.raises(SavepointFileError, match="unexpected bytes"):
        check(data + b"\x00")


def test_foreign_and_other_versions_say_so() -> None:
    with pytest.raises(SavepointFileError, match="not a millwheel savepoint"):
        check(b"\x89PNG\r\n\x1a\n" + bytes(100))
    data = bytearray(small_file())
    data[15] = 9  # format version 9
    with pytest.raises(SavepointFileError, match="format version 9"):
        check(bytes(data))


def test_the_verifier_fed_in_any_pieces_agrees_with_verify() -> None:
    """A restore checks the upload as it arrives (issue 34, item 7): in whatever pieces,
    the same answer as the whole file's, for a good file, a flipped byte, a cut."""
    data = small_file()
    cases = [data, data[:len(data) - 40], data[:20], data + b"\x00",
             data[:30] + bytes([data[30] ^ 1]) + data[31:], data[:-1] + bytes([data[-1] ^ 1])]
    for case in cases:
        try:
            want: str | type[SavepointFileError] = check(case)
        except SavepointFileError:
            want = SavepointFileError
        for step in (1, 3, 7, 16, 17, 64, len(case) or 1):
            v = Verifier()
            try:
                for i in range(0, len(case), step):
                    v.feed(case[i:i + step])
                got: str | type[SavepointFileError] = v.finish()
            except SavepointFileError:
                got = SavepointFileError
            assert got == want, (case, step)


def test_a_bad_header_or_an_empty_frame_is_refused_as_soon_as_its_bytes_are_in() -> None:
    head = MAGIC + struct.pack(">I", FORMAT_VERSION)
    with pytest.raises(SavepointFileError, match="not a millwheel savepoint"):
        Verifier().feed(b"PK")  # two bytes are enough
    v = Verifier()
    v.feed(head)
    assert v.headed
    with pytest.raises(SavepointFileError, match="frame 0 at byte 16 is 0 bytes, shorter than any frame"):
        v.feed(bytes(4))
    v = Verifier()
    v.feed(head + struct.pack(">I", MIN_FRAME_BYTES) + b'{"t":"ids","items":[1]}'[:MIN_FRAME_BYTES])
    with pytest.raises(SavepointFileError, match="frame 1 at byte 42 is 3 bytes"):
        v.feed(struct.pack(">I", 3))


def test_a_frame_without_items_is_refused() -> None:
    """The format writes none (capture's batches flush only items): a file of many
    would only keep the check loop busy."""
    buf = io.BytesIO()
    w = Writer(buf)
    w.frame({"t": "header", "created_us": 5, "registry": {}})
    w.frame({"t": "range", "node": "c", "range": 0, "watermark": None, "counters": {}, "recent": [], "attempts": []})
    w.frame({"t": "ids", "node": "c", "range": 0, "items": []})
    w.finish()
    data = buf.getvalue()
    check(data)
    with pytest.raises(SavepointFileError, match="frame 2 .*'items' must be a list of at least one item"):
        restore.check(io.BytesIO(data), {"c": 1}, set())


def fill(store: StateStore) -> None:
    keys = [f"k{i}" for i in range(40)]
    for r in range(2):
        token = store.acquire("c", r)
        mine = [k for k in keys if key_range(k, 2) == r]
        store.checkpoint(Checkpoint(
            "c", r, token, 1_000, state_writes={k: f"s{k}".encode() for k in mine},
            timer_sets=[Timer(k, "end:1", 77, TimeDomain.EVENT, True) for k in mine[:3]],
            productions=[Production("log:out", "out", Record(k, b"v", 10, f"p{k}")) for k in mine[:2]],
            consumed_ids=[f"id{r}-{j}" for j in range(25)], errors=[b'{"e":1}'],
            counters={"skipped": 2, "late_dropped": 3, "late:dropped:in": 3, "late:processed:": 1}))
        store.checkpoint(Checkpoint("c", r, token, 1_000, buffer_appends=[  # window buffers
            ("0", b"x" * (600 * 1024)), ("60", b""), ("0", f"r{r}\n".encode())]))
        store.bump_attempts("c", r, token, "item", b'{"e":2}')
        store.report_watermark("c", r, token, 500 + r)
    store.append_log("out", [Record("a", b"1", 1, "l1"), Record("b", b"2", 2, "l2")])


def dump(store: StateStore) -> dict[str, object]:
    out: dict[str, object] = {"keys": store.list_keys("c", None, 1000), "log": store.read_log("out", 0, 100)}
    out["log"] = [(r.key, r.value, r.record_id) for _s, r in store.read_log("out", 0, 100)]
    out["state"] = store.read_state("c", store.list_keys("c", None, 1000))
    for r in range(2):
        errors = store.read_errors("c", r)
        out[f"r{r}"] = (sorted(store.read_timers("c", r), key=lambda t: t.key), store.read_outbox("c", r),
                        sorted(store.iter_ids("c", r)), errors.counters, errors.recent,
                        {k: n for k, (n, _e) in errors.attempts.items()})
    out["wm"] = store.read_watermarks("c")
    out["buffers"] = {(r, n): b"".join(store.read_buffer("c", r, n)) for r in range(2)
                      for n in store.list_buffers("c", r)}
    return out


def test_store_round_trip(tmp_path: Path) -> None:
    src, dst = open_store(f"sqlite:///{tmp_path}/a.db"), open_store(f"sqlite:///{tmp_path}/b.db")
    try:
        fill(src)
        buf = io.BytesIO()
        w = Writer(buf)
        w.frame({"t": "header", "created_us": 1_000, "registry": {}})
        counts: dict[str, int] = {}
        capture.capture_nodes(src, {"c": 2}, w, counts, lambda _k, _n: None)
        capture.capture_logs(src, ["out", "none"], w, counts, lambda _k, _n: None)
        w.finish()
        data = buf.getvalue()
        check(data)
        f = io.BytesIO(data)
        summary = restore.check(f, {"c": 2}, {"out"})
        assert summary.ranges == {("c", 0), ("c", 1)} and summary.counts["ids"] == 50
        with pytest.raises(SavepointFileError, match="not in the savepoint's registry"):
            restore.check(f, {"d": 2}, {"out"})
        restore.apply(dst, f, {"c": 2}, {"out"}, 1_000, dst.acquire, lambda _k, _n: None)
        assert dump(dst) == dump(src)
    finally:
        src.close()
        dst.close()


def _log_file(store: StateStore, streams: list[str]) -> bytes:
    buf = io.BytesIO()
    w = Writer(buf)
    w.frame({"t": "header", "created_us": 1_000, "registry": {}})
    capture.capture_logs(store, streams, w, {}, lambda _k, _n: None)
    w.finish()
    return buf.getvalue()


def test_restored_logs_keep_their_positions_for_sinks(tmp_path: Path) -> None:
    """SQLite numbers all streams' entries in one sequence; restored, a stream's entries
    are numbered anew, and the map (logmap.py) gives sinks the old positions back, also
    in a savepoint of the restored store (a second restore composes)."""
    from millwheel.savepoint.logmap import load

    src, mid, dst = (open_store(f"sqlite:///{tmp_path}/{n}.db") for n in ("a", "b", "c"))
    try:
        for i in range(6):  # "out" gets 1, 3, 5, ...; "side" 2, 4, 6, ...
            src.append_log("out", [Record("k", b"v", i, f"o{i}")])
            src.append_log("side", [Record("k", b"v", i, f"s{i}")])
        want = [(seq, r.record_id) for seq, r in src.read_log("out", 0, 100)]
        assert [s for s, _ in want] == [1, 3, 5, 7, 9, 11]
        first = _log_file(src, ["out", "side"])
        restore.apply(mid, io.BytesIO(first), {}, {"out", "side"}, 1_000, mid.acquire, lambda _k, _n: None)
        m = load(mid, "out")
        assert m is not None
        # A restore cut short and sent again finds the entries written and maps them the same.
        restore.apply(mid, io.BytesIO(first), {}, {"out", "side"}, 1_000, mid.acquire, lambda _k, _n: None)
        assert load(mid, "out") == m and len(mid.read_log("out", 0, 100)) == 6
        assert [(m.to_sink(s), r.record_id) for s, r in mid.read_log("out", 0, 100)] == want
        assert m.to_store(5) == [s for s, r in mid.read_log("out", 0, 100) if r.record_id == "o2"][0]
        mid.append_log("out", [Record("k", b"v", 9, "late")])
        late = m.to_sink(mid.log_end("out")[0])
        assert late > 11  # above every old position
        again = _log_file(mid, ["out", "side"])
        restore.apply(dst, io.BytesIO(again), {}, {"out", "side"}, 1_000, dst.acquire, lambda _k, _n: None)
        m2 = load(dst, "out")
        assert m2 is not None
        assert [(m2.to_sink(s), r.record_id) for s, r in dst.read_log("out", 0, 100)] == [*want, (late, "late")]
    finally:
        for s in (src, mid, dst):
            s.close()


def test_log_positions_that_do_not_rise_are_refused() -> None:
    buf = io.BytesIO()
    w = Writer(buf)
    w.frame({"t": "header", "created_us": 1, "registry": {}})
    w.frame({"t": "log", "stream": "out", "items": [[5, "k", "", 1, "a"], [5, "k", "", 1, "b"]]})
    w.finish()
    with pytest.raises(SavepointFileError, match="not after the one before it"):
        restore.check(io.BytesIO(buf.getvalue()), {}, {"out"})
