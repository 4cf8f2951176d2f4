"""A restored log's positions as sinks know them (millwheel/savepoint/logmap.py): the
map a restore records when the new store numbers a stream's entries otherwise."""

from __future__ import annotations

from millwheel.savepoint.logmap import LogMap


def interleaved() -> LogMap:
    """Old positions 2, 4, 6, 8 (SQLite numbers all streams in one sequence), the
    stream's end at the cut 9; the new store numbers them 1..4."""
    m = LogMap()
    for new, old in ((1, 2), (2, 4), (3, 6), (4, 8)):
        m.add(new, old)
    m.old_last = 9
    return m


def test_a_sink_resumes_after_what_it_wrote_and_new_entries_continue_above() -> None:
    m = interleaved()
    assert [m.to_sink(n) for n in (1, 2, 3, 4)] == [2, 4, 6, 8]
    # A sink that wrote through old 4 reads the new log after 2: new 3 and 4 (old 6, 8).
    assert m.to_store(4) == 2 and m.to_store(5) == 2 and m.to_store(0) == 0 and m.to_store(1) == 0
    assert m.to_store(8) == 4 and m.to_store(9) == 4
    # Appended after the restore: above everything the old service numbered.
    assert m.to_sink(5) == 10 and m.to_sink(6) == 11
    assert m.to_store(10) == 5 and m.to_store(11) == 6
    assert not m.identity()


def test_runs_are_kept_compact_and_same_numbering_records_nothing() -> None:
    m = LogMap()
    for i in range(1, 1001):
        m.add(i, i + 50)  # retention had removed the first 50
    m.old_last = 1050
    assert m.runs == [(1, 51, 1000)] and m.offset == 50
    assert m.to_sink(1) == 51 and m.to_store(50) == 0 and m.to_store(51) == 1 and m.to_sink(1001) == 1051
    same = LogMap()
    for i in range(1, 10):
        same.add(i, i)
    same.old_last = 9
    assert same.identity()
    empty = LogMap(old_last=70)  # every entry removed before the cut: new ones continue above
    assert empty.to_sink(1) == 71 and empty.to_store(70) == 0 and empty.to_store(75) == 5
