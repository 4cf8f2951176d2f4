"""Key-range assignment rules of the controller, over a real SQLite store (no network):
even spread, moves on join/death/drain, a fresh token on every move, and a restart
that keeps owners instead of moving everything."""

from __future__ import annotations

from pathlib import Path

from millwheel.state.sqlite_store import SQLiteStore
from services.controller.assign import Assigner


def counts(a: Assigner) -> dict[str | None, int]:
    out: dict[str | None, int] = {}
    for owner in a.units.values():
        out[owner.worker_id] = out.get(owner.worker_id, 0) + 1
    return out


def test_spread_moves_and_tokens(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    a = Assigner(store, timeout_s=60)
    a.sync_units({"c": 6, "injector:i": 1})
    a.heartbeat("w1", "h:1", "", False)
    a.heartbeat("w2", "h:2", "", False)
    a.rebalance()
    assert counts(a) == {"w1": 4, "w2": 3}
    for unit, owner in a.units.items():
        assert owner.token == store.current_token(*unit) >= 1

    before = {u: (o.worker_id, o.token) for u, o in a.units.items()}
    a.heartbeat("w3", "h:3", "", False)  # a join takes ranges from the others
    a.rebalance()
    assert sorted(counts(a).values()) == [2, 2, 3]
    for unit, owner in a.units.items():
        old_owner, old_token = before[unit]
        assert (owner.token > old_token) == (owner.worker_id != old_owner)  # moved <=> new token

    a.heartbeat("w2", "h:2", "", True)  # draining: everything leaves w2
    a.rebalance()
    assert "w2" not in counts(a) and sorted(counts(a).values()) == [3, 4]

    a.workers["w1"].last_seen -= 120  # silent past the timeout: dead
    assert a.reap()
    a.rebalance()
    assert counts(a) == {"w3": 7}

    restarted = Assigner(store, timeout_s=60)  # a controller restart keeps the owners
    assert {u: (o.worker_id, o.token) for u, o in restarted.units.items()} == \
        {u: (o.worker_id, o.token) for u, o in a.units.items()}
    store.close()


def test_last_draining_worker_hands_ranges_back(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    a = Assigner(store, timeout_s=60)
    a.sync_units({"c": 2})
    a.heartbeat("w1", "h:1", "", False)
    a.rebalance()
    tokens = {u: o.token for u, o in a.units.items()}
    a.heartbeat("w1", "h:1", "", True)
    a.rebalance()
    assert all(o.worker_id is None and o.token > tokens[u] for u, o in a.units.items())
    store.close()


def test_a_move_cut_short_is_redone_after_restart(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    a = Assigner(store, timeout_s=60)
    a.sync_units({"c": 1})
    a.heartbeat("w1", "h:1", "", False)
    a.rebalance()
    store.acquire("c", 0)  # the token moved on, but the assignment was never written
    restarted = Assigner(store, timeout_s=60)
    assert restarted.units[("c", 0)].worker_id is None  # to be reassigned with a fresh token
    store.close()


def test_ranges_go_to_workers_that_may_run_their_code(tmp_path: Path) -> None:
    """A worker whose --allow-code refuses a computation says so in its heartbeats; its
    ranges of that computation move to a worker that may run it, and stay put (rather
    than go nowhere) while no worker may."""
    store = SQLiteStore(tmp_path / "s.db")
    a = Assigner(store, timeout_s=60)
    a.sync_units({"builtin": 4, "custom": 4})
    a.heartbeat("narrow", "h:1", "", False, frozenset({"custom"}))
    a.rebalance()
    assert counts(a) == {"narrow": 8}  # nobody else may run custom: it stays here
    a.heartbeat("wide", "h:2", "", False)
    a.rebalance()
    owners = {u: o.worker_id for u, o in a.units.items()}
    assert all(owners[("custom", r)] == "wide" for r in range(4))
    assert sorted(counts(a).values()) == [4, 4]  # still even: narrow keeps the built-ins
    assert all(owners[("builtin", r)] == "narrow" for r in range(4))
    before = dict(owners)
    assert a.rebalance() == 0 and {u: o.worker_id for u, o in a.units.items()} == before  # stable
