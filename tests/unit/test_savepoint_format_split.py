"""Values larger than a frame in a savepoint file (issue 34, item 4).

A key's state (or a record's value, or an error) over ~12 MiB made every savepoint
fail: one item was never split across frames (16 MiB each). Such a value is now
written as part frames before the frame holding its item and reassembled on read;
what a store holds must come back byte for byte in another store, a file cut short
inside the parts is refused naming where, a file whose parts and references do not
match is refused, and a file as the earlier writer wrote it (every value inline) is
still read.
"""

from __future__ import annotations

import base64
import io
import json
import struct
from pathlib import Path

import pytest

from millwheel.keys import key_range
from millwheel.record import Record
from millwheel.savepoint import capture, restore
from millwheel.savepoint.format import (
    FORMAT_VERSION,
    MAGIC,
    MAX_FRAME_BYTES,
    PART_BYTES,
    SavepointFileError,
    Writer,
    frames,
    verify,
)
from millwheel.state import open_store
from millwheel.state.protocol import Checkpoint, Production, StateStore

MiB = 1 << 20


def pattern(n: int, seed: int) -> bytes:
    """``n`` bytes no two positions of which are likely to be confused (a piece put in
    the wrong place or dropped changes the bytes)."""
    block = bytes((i * 131 + seed * 7 + (i >> 8)) & 0xFF for i in range(4099))
    return (block * (n // len(block) + 1))[:n]


def fill(store: StateStore) -> dict[str, bytes]:
    """Range 0 and 1 of ``c``: small states, one 40 MiB state, one exactly PART_BYTES
    (inline) and one a byte over (split); a pending 3 MiB production; a 2 MiB error;
    a log with a 5 MiB entry between small ones."""
    states = {f"k{i}": f"small {i}".encode() for i in range(30)}
    states["big"] = pattern(40 * MiB + 17, 1)
    states["edge"] = pattern(PART_BYTES, 2)
    states["edge+1"] = pattern(PART_BYTES + 1, 3)
    for r in range(2):
        token = store.acquire("c", r)
        mine: dict[str, bytes | None] = {k: v for k, v in states.items() if key_range(k, 2) == r}
        store.checkpoint(Checkpoint("c", r, token, 1_000, state_writes=mine))
        store.checkpoint(Checkpoint(
            "c", r, token, 1_000,
            productions=[Production("log:out", "out", Record(f"p{r}", pattern(3 * MiB, 4 + r), 10, f"pid{r}"))],
            errors=[json.dumps({"message": "x" * (2 * MiB)}).encode()]))
        store.report_watermark("c", r, token, 500 + r)
    store.append_log("out", [Record("a", b"1", 1, "l1"), Record("b", pattern(5 * MiB, 9), 2, "l2"),
                             Record("c", b"3", 3, "l3")])
    return states


def take(store: StateStore) -> bytes:
    buf = io.BytesIO()
    w = Writer(buf)
    w.frame({"t": "header", "created_us": 1_000, "registry": {}})
    counts: dict[str, int] = {}
    capture.capture_nodes(store, {"c": 2}, w, counts, lambda _k, _n: None)
    capture.capture_logs(store, ["out"], w, counts, lambda _k, _n: None)
    w.finish()
    return buf.getvalue()


def raw_frames(data: bytes) -> list[tuple[int, dict[str, object]]]:
    """(offset, frame) of every frame as written, parts included."""
    out, at = [], len(MAGIC) + 4
    while at < len(data) - 32:
        n = struct.unpack(">I", data[at:at + 4])[0]
        out.append((at, json.loads(data[at + 4:at + 4 + n])))
        at += 4 + n
    return out


def test_values_larger_than_a_frame_round_trip_byte_for_byte(tmp_path: Path) -> None:
    src, dst = open_store(f"sqlite:///{tmp_path}/a.db"), open_store(f"sqlite:///{tmp_path}/b.db")
    try:
        states = fill(src)
        data = take(src)
        verify(io.BytesIO(data), len(data))
        written = raw_frames(data)
        sizes = [len(json.dumps(f)) for _at, f in written]
        assert max(sizes) < 2 * MiB  # no frame near the limit, whatever a value's size
        parts = [f for _at, f in written if f["t"] == "part"]
        # 41 for the 40 MiB state, 2 for PART_BYTES + 1, 3 + 3 productions, 5 for the
        # log entry, 3 + 3 for the errors (2 MiB and their JSON); PART_BYTES exactly is inline.
        assert len(parts) == 41 + 2 + 6 + 5 + 6 and sum(f["last"] is True for f in parts) == 7
        # Reading them yields no part frame, and every value whole where its item is.
        got = {k: v for f in frames(io.BytesIO(data)) if f["t"] == "state" for k, v in f["items"]}
        assert got["big"] == states["big"] and got["edge+1"] == states["edge+1"]
        assert got["edge"] == base64.b64encode(states["edge"]).decode()  # inline, as before
        f = io.BytesIO(data)
        summary = restore.check(f, {"c": 2}, {"out"})
        assert summary.counts["state"] == len(states) and summary.counts["outbox"] == 2
        restore.apply(dst, f, {"c": 2}, {"out"}, 1_000, dst.acquire, lambda _k, _n: None)
        keys = src.list_keys("c", None, 1000)
        assert dst.list_keys("c", None, 1000) == keys
        for k in keys:  # every key's state, byte for byte
            assert dst.read_state("c", [k], key_range(k, 2)) == {k: states[k]}, k
        for r in range(2):
            assert dst.read_outbox("c", r) == src.read_outbox("c", r)
            assert dst.read_errors("c", r).recent == src.read_errors("c", r).recent
        assert [r for _s, r in dst.read_log("out", 0, 10)] == [r for _s, r in src.read_log("out", 0, 10)]
        assert take(dst) == data  # and a savepoint of the restored store is the same file
    finally:
        src.close()
        dst.close()


def test_a_file_cut_inside_a_split_value_is_refused_naming_where(tmp_path: Path) -> None:
    src = open_store(f"sqlite:///{tmp_path}/a.db")
    try:
        token = src.acquire("c", 0)
        src.checkpoint(Checkpoint("c", 0, token, 1, state_writes={"big": pattern(5 * MiB, 1)}))
        buf = io.BytesIO()
        w = Writer(buf)
        w.frame({"t": "header", "created_us": 1, "registry": {}})
        capture.capture_nodes(src, {"c": 1}, w, {}, lambda _k, _n: None)
        w.finish()
        data = buf.getvalue()
    finally:
        src.close()
    third_part = [at for at, f in raw_frames(data) if f["t"] == "part"][2]
    cut = data[:third_part + 1000]
    with pytest.raises(SavepointFileError, match=rf"truncated: frame 4 needs \d+ bytes, \d+ more than the file has "
                                                 rf"\(the file is {len(cut)} bytes\)"):
        verify(io.BytesIO(cut), len(cut))
    # Read without the check (the frames as they come), the cut is named too, not a crash.
    with pytest.raises(SavepointFileError, match=rf"truncated: frame 4 at byte {third_part} needs"):
        list(frames(io.BytesIO(cut)))
    with pytest.raises(SavepointFileError, match=rf"truncated: it ends at byte {third_part}, inside frame 4's"):
        list(frames(io.BytesIO(data[:third_part + 2])))


def forged(*frames_: dict[str, object]) -> bytes:
    """A well-checksummed file of these frames as given (written as they come: the
    writer's own checks bypassed, as a forger's would be)."""
    buf = io.BytesIO()
    w = Writer(buf)
    w.frame({"t": "header", "created_us": 1, "registry": {}})
    w.frame({"t": "range", "node": "c", "range": 0, "watermark": None, "counters": {}, "recent": [],
             "attempts": []})
    for f in frames_:
        w.frame(f)  # (no value() was called: the writer checks nothing of the references)
    w.finish()
    return buf.getvalue()


def part(data: bytes, last: bool = True) -> dict[str, object]:
    return {"t": "part", "data": base64.b64encode(data).decode(), "last": last}


def state(value: object) -> dict[str, object]:
    return {"t": "state", "node": "c", "range": 0, "items": [["k", value]]}


@pytest.mark.parametrize(("content", "message"), [
    ([part(b"ab"), {"t": "ids", "node": "c", "range": 0, "items": ["x"]}],
     r"frame 3 at byte \d+: it references 0 of the 1 values split from frame 2 on"),
    ([part(b"ab")], r"frame 3 at byte \d+: it references 0 of the 1 values"),  # only the end frame after it
    ([part(b"ab", last=False), state({"split": 0, "bytes": 2})],
     "the value split from frame 2 on has no last part before it"),
    ([part(b"ab"), state({"split": 0, "bytes": 3})], r"a reference \{'split': 0, 'bytes': 3\} to none"),
    ([part(b"ab"), state({"split": 1, "bytes": 2})], "to none of the 1 values"),
    ([part(b"ab"), {"t": "state", "node": "c", "range": 0,
                    "items": [["k", {"split": 0, "bytes": 2}], ["j", {"split": 0, "bytes": 2}]]}],
     "or to one referenced already"),
    ([state({"split": 0, "bytes": 2})], "value: must be base64 text"),  # a reference without parts
    ([{"t": "part", "data": "!!", "last": True}, state({"split": 0, "bytes": 2})], "not valid base64"),
    ([{"t": "part", "data": "", "last": True}, state({"split": 0, "bytes": 0})], "a part of 0 bytes"),
    ([{"t": "part", "data": "YWI=", "last": 1}, state({"split": 0, "bytes": 2})], "a part must be"),
])
def test_parts_and_references_that_do_not_match_are_refused(content: list[dict[str, object]], message: str) -> None:
    data = forged(*content)
    verify(io.BytesIO(data), len(data))  # well-formed and checksummed: the parts' meaning is what is wrong
    with pytest.raises(SavepointFileError, match=message):
        restore.check(io.BytesIO(data), {"c": 1}, set())


def test_two_values_split_before_one_frame_are_each_put_in_place(tmp_path: Path) -> None:
    """The format allows several (a range frame's errors): the j-th value split before
    a frame goes where ``{"split": j}`` stands, in whatever order they are referenced."""
    a, b = pattern(PART_BYTES + 5, 1), pattern(2 * PART_BYTES, 2)
    data = forged(part(a[:PART_BYTES], False), part(a[PART_BYTES:]), part(b[:PART_BYTES], False),
                  part(b[PART_BYTES:]),
                  {"t": "state", "node": "c", "range": 0, "items": [["kb", {"split": 1, "bytes": len(b)}],
                                                                     ["ka", {"split": 0, "bytes": len(a)}]]})
    dst = open_store(f"sqlite:///{tmp_path}/b.db")
    try:
        f = io.BytesIO(data)
        restore.check(f, {"c": 1}, set())
        restore.apply(dst, f, {"c": 1}, set(), 1, dst.acquire, lambda _k, _n: None)
        assert dst.read_state("c", ["ka", "kb"], 0) == {"ka": a, "kb": b}
    finally:
        dst.close()


def test_the_writer_refuses_a_split_value_no_frame_references() -> None:
    w = Writer(io.BytesIO())
    w.frame({"t": "header", "created_us": 1, "registry": {}})
    ref = w.value(pattern(PART_BYTES + 1, 1), "the state of key 'k'")
    assert ref == {"split": 0, "bytes": PART_BYTES + 1}
    with pytest.raises(SavepointFileError, match=r"references split values \[\], not the 1 written as parts"):
        w.frame({"t": "ids", "node": "c", "range": 0, "items": ["x"]})
    w.frame(state(ref))
    w.value(pattern(PART_BYTES + 1, 1), "the state of key 'k'")
    with pytest.raises(SavepointFileError, match="1 values written as parts that no frame references"):
        w.finish()


def test_a_file_as_the_earlier_writer_wrote_it_is_still_read(tmp_path: Path) -> None:
    """Before part frames, every value was inline in its item (base64), up to the
    frame's limit: a 9 MiB state in one frame. Such a file (same format version) is
    read and restored exactly."""
    assert FORMAT_VERSION == 1
    value = pattern(9 * MiB, 5)
    old = state(base64.b64encode(value).decode())
    data = forged(old, {"t": "ids", "node": "c", "range": 0, "items": ["r1"]})
    assert MAX_FRAME_BYTES > len(json.dumps(old)) > 12 * MiB
    assert all(f["t"] != "part" for _at, f in raw_frames(data))
    dst = open_store(f"sqlite:///{tmp_path}/b.db")
    try:
        f = io.BytesIO(data)
        verify(f, len(data))
        assert restore.check(f, {"c": 1}, set()).counts == {"range": 1, "state": 1, "ids": 1}
        restore.apply(dst, f, {"c": 1}, set(), 1, dst.acquire, lambda _k, _n: None)
        assert dst.read_state("c", ["k"], 0) == {"k": value}
    finally:
        dst.close()


def test_many_keys_with_large_states_are_read_in_pages_and_none_is_lost(tmp_path: Path) -> None:
    """The cut and a rescale's copy read keys' values in pages sized by their bytes
    (the first of 100 keys, then about 32 MiB): 300 keys, every tenth 2 MiB, come
    back whole from a savepoint and from a copy into 3 ranges."""
    from millwheel.savepoint import repartition

    src, dst = open_store(f"sqlite:///{tmp_path}/a.db"), open_store(f"sqlite:///{tmp_path}/b.db")
    try:
        states = {f"k{i:03}": pattern(2 * MiB, i) if i % 10 == 0 else f"v{i}".encode() for i in range(300)}
        token = src.acquire("c", 0)
        for i in range(0, 300, 50):  # (one checkpoint of 60 MiB would do too; smaller is kinder)
            part_: dict[str, bytes | None] = {k: states[k] for k in list(states)[i:i + 50]}
            src.checkpoint(Checkpoint("c", 0, token, 1, state_writes=part_))
        buf = io.BytesIO()
        w = Writer(buf)
        w.frame({"t": "header", "created_us": 1, "registry": {}})
        capture.capture_nodes(src, {"c": 1}, w, {}, lambda _k, _n: None)
        w.finish()
        f = io.BytesIO(buf.getvalue())
        restore.check(f, {"c": 1}, set())
        restore.apply(dst, f, {"c": 1}, set(), 1, dst.acquire, lambda _k, _n: None)
        assert dst.read_state("c", list(states), 0) == states
        moved = repartition.copy(src, "c", 1, "d", 3, lambda node, r: src.acquire(node, r), 1)
        assert moved.keys == 300
        got: dict[str, bytes] = {}
        for r in range(3):
            mine = [k for k in states if key_range(k, 3) == r]
            values = src.read_state("d", mine, r)
            assert set(values) == set(mine)
            got.update({k: v for k, v in values.items() if v is not None})
        assert got == states
    finally:
        src.close()
        dst.close()
