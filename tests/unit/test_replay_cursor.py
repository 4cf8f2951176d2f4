"""The dead-letter replay's durable cursor (services/controller/replay.py): what a
retried replay skips, and cursors written before it had more than a position."""

from __future__ import annotations

from services.controller.replay import Cursor


def test_a_cursor_of_an_older_version_is_its_position() -> None:
    assert Cursor.load(b"42") == Cursor(42)
    assert Cursor.load(None) == Cursor() == Cursor.load(b"")


def test_settled_letters_after_an_open_one_are_kept_until_it_settles() -> None:
    chunk = [3, 5, 8, 13, 21]  # log positions of one chunk read after position 1
    c = Cursor(1, end=21)
    c.settle([5, 13], chunk, 1)  # range 1's letters handed over; 3 (range 0) not yet
    assert (c.after, c.done) == (1, {5, 13})
    assert Cursor.load(c.dump()) == c  # what a retry reads back
    c.settle([3, 8], chunk, 1)
    assert (c.after, c.done) == (13, set())  # 21 is still open
    c.settle([21], chunk, 1)
    assert (c.after, c.done, c.end) == (21, set(), 21)


def test_a_chunk_read_past_an_open_letter_does_not_move_the_position() -> None:
    c = Cursor(1, {9})
    c.settle([12, 14], [12, 14], 10)  # read after 10 while 3 (before 9) is still open
    assert (c.after, c.done) == (1, {9, 12, 14})
