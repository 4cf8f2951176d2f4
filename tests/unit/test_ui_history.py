"""The console's history rings: fixed memory per series, series of gone owners dropped."""

from __future__ import annotations

from services.ui.history import WINDOW_S, History


def test_a_ring_keeps_the_last_window_only() -> None:
    h = History(interval_s=1.0)
    assert h.size == WINDOW_S + 1
    for t in range(3 * WINDOW_S):
        h.add("lag", "counts", float(t), t * 2.0)
    got = h.get("lag", "counts")
    assert len(got) == h.size
    assert got[0] == (3 * WINDOW_S - h.size, (3 * WINDOW_S - h.size) * 2.0)
    assert got[-1] == (3 * WINDOW_S - 1, (3 * WINDOW_S - 1) * 2.0)


def test_series_of_unregistered_owners_are_dropped() -> None:
    h = History(interval_s=0.5, window_s=10)
    for owner in ("a", "injector:b", "c"):
        h.add("in", owner, 1.0, 1.0)
        h.add("lag", owner, 1.0, 1.0)
    h.keep(["a", "injector:b"])
    assert h.names() == [("in", "a"), ("in", "injector:b"), ("lag", "a"), ("lag", "injector:b")]
    assert h.get("in", "c") == [] and h.size == 21
