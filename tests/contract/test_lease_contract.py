"""The controller lease and epoch-fenced controller writes, against every backend.

What controller high availability relies on (millwheel.state.lease): one holder at a
time, a new epoch each time the lease changes hands, renewals that fail once it did,
and writes carrying a stale epoch that change nothing.
"""

from __future__ import annotations

import time

import pytest

from millwheel.errors import InvalidSpecError
from millwheel.state import open_store
from millwheel.state.lease import LeadershipLostError
from millwheel.state.protocol import StateStore


def test_first_claim_gets_epoch_one_and_others_are_refused(store: StateStore) -> None:
    assert store.read_lease() is None
    assert store.claim_lease("a", 5_000) == 1
    assert store.claim_lease("b", 5_000) is None
    lease = store.read_lease()
    assert lease is not None and lease.holder == "a" and lease.epoch == 1 and lease.held
    assert 0 < lease.remaining_ms <= 5_000
    assert store.claim_lease("a", 5_000) == 1  # the holder claiming again keeps its epoch


def test_lease_runs_out_and_changes_hands_with_a_new_epoch(store: StateStore) -> None:
    assert store.claim_lease("a", 150) == 1
    time.sleep(0.3)
    lease = store.read_lease()
    assert lease is not None and not lease.held
    assert store.claim_lease("b", 5_000) == 2
    assert not store.renew_lease("a", 1, 5_000)  # a woke up: it is not the leader any more
    assert store.claim_lease("a", 5_000) is None
    assert store.renew_lease("b", 2, 5_000)


def test_renewal_keeps_the_lease_past_its_first_ttl(store: StateStore) -> None:
    assert store.claim_lease("a", 300) == 1
    for _ in range(4):
        time.sleep(0.1)
        assert store.renew_lease("a", 1, 300)
    assert store.claim_lease("b", 300) is None


def test_a_holder_whose_lease_ran_out_untaken_may_renew(store: StateStore) -> None:
    assert store.claim_lease("a", 100) == 1
    time.sleep(0.25)
    assert store.renew_lease("a", 1, 5_000)  # nobody took it: the epoch is still current
    assert store.claim_lease("b", 5_000) is None


def test_release_hands_over_at_once_and_keeps_the_epoch_counting(store: StateStore) -> None:
    assert store.claim_lease("a", 60_000) == 1
    store.release_lease("b", 1)  # not the holder: nothing happens
    assert store.claim_lease("b", 60_000) is None
    store.release_lease("a", 1)
    assert store.claim_lease("b", 60_000) == 2
    store.release_lease("a", 1)  # a stale release changes nothing
    lease = store.read_lease()
    assert lease is not None and lease.holder == "b" and lease.held


def test_put_meta_with_a_stale_epoch_writes_nothing(store: StateStore) -> None:
    assert store.claim_lease("a", 60_000) == 1
    store.put_meta("assign/x", b"by-a", epoch=1)
    store.put_meta("gone", b"1", epoch=1)
    store.release_lease("a", 1)
    assert store.claim_lease("b", 60_000) == 2
    with pytest.raises(LeadershipLostError, match="epoch 1 is not current"):
        store.put_meta("assign/x", b"by-a-again", epoch=1)
    with pytest.raises(LeadershipLostError):
        store.put_meta("gone", None, epoch=1)
    assert store.get_meta("assign/x") == b"by-a"
    assert store.get_meta("gone") == b"1"
    store.put_meta("assign/x", b"by-b", epoch=2)
    store.put_meta("gone", None, epoch=2)
    assert store.get_meta("assign/x") == b"by-b"
    assert store.get_meta("gone") is None
    store.put_meta("unfenced", b"ok")  # without an epoch: as before (tools, tests)
    assert store.get_meta("unfenced") == b"ok"


def test_put_metas_with_a_stale_epoch_writes_none_of_its_entries(store: StateStore, store_url: str) -> None:
    assert store.claim_lease("a", 60_000) == 1
    store.put_metas({"registry/head": b"1", "registry/c/a": b"spec a", "registry/c/b": b"spec b"}, epoch=1)
    before = store.list_meta("registry/")
    store.release_lease("a", 1)
    assert store.claim_lease("b", 60_000) == 2
    with pytest.raises(LeadershipLostError, match="epoch 1 is not current"):
        store.put_metas({"registry/head": b"2", "registry/c/a": None, "registry/c/new": b"x"}, epoch=1)
    with pytest.raises(LeadershipLostError):
        store.put_metas({}, epoch=1)  # nothing to write, and still refused
    assert store.list_meta("registry/") == before
    other = open_store(store_url)  # as another connection reads it
    try:
        assert other.list_meta("registry/") == before
        with pytest.raises(LeadershipLostError):
            other.put_metas({"registry/head": b"3"}, epoch=3)  # an epoch from the future: refused too
    finally:
        other.close()
    store.put_metas({"registry/head": b"2", "registry/c/a": None, "registry/c/new": b"x"}, epoch=2)
    assert store.list_meta("registry/") == {"registry/c/b": b"spec b", "registry/c/new": b"x",
                                            "registry/head": b"2"}
    with pytest.raises(InvalidSpecError, match="reserved"):
        store.put_metas({"registry/head": b"4", "lease/epoch": b"99"}, epoch=2)
    assert store.get_meta("registry/head") == b"2"
    lease = store.read_lease()
    assert lease is not None and (lease.holder, lease.epoch) == ("b", 2)


def test_acquire_with_a_stale_epoch_bumps_no_token(store: StateStore) -> None:
    assert store.claim_lease("a", 60_000) == 1
    assert store.acquire("c", 0, epoch=1) == 1
    store.release_lease("a", 1)
    assert store.claim_lease("b", 60_000) == 2
    assert store.acquire("c", 1, epoch=2) == 1
    for rid in (0, 1, 2):
        with pytest.raises(LeadershipLostError):
            store.acquire("c", rid, epoch=1)
    assert (store.current_token("c", 0), store.current_token("c", 1), store.current_token("c", 2)) == (1, 1, 0)
    assert store.acquire("c", 0, epoch=2) == 2
    assert store.acquire("c", 0) == 3  # without an epoch: as before


def test_lease_names_are_reserved(store: StateStore) -> None:
    with pytest.raises(InvalidSpecError, match="reserved"):
        store.put_meta("lease/epoch", b"99")
    assert store.read_lease() is None
    assert store.list_meta("registry/") == {}


def test_a_second_connection_sees_the_same_lease(store: StateStore, store_url: str) -> None:
    other = open_store(store_url)
    try:
        assert store.claim_lease("a", 60_000) == 1
        assert other.claim_lease("b", 60_000) is None
        lease = other.read_lease()
        assert lease is not None and (lease.holder, lease.epoch) == ("a", 1)
        with pytest.raises(LeadershipLostError):
            other.put_meta("x", b"1", epoch=7)
    finally:
        other.close()


def test_bad_ttl_is_refused(store: StateStore) -> None:
    with pytest.raises(InvalidSpecError, match="ttl_ms"):
        store.claim_lease("a", 0)
    assert store.read_lease() is None
