"""Zombies on Redis: a worker whose range was taken over keeps trying to write.

Two runners (two store connections, as two processes would have) share one Redis
(a single server, and a Redis Cluster).
The new owner's acquire bumps every token; from then on not one write of the old
owner is visible, and the new owner ends with exactly the failure-free state.
"""

from __future__ import annotations

import hashlib
from typing import Callable, Iterator

import pytest

from millwheel.errors import FencedError
from millwheel.record import Record
from millwheel.runtime.local_runner import LocalRunner
from millwheel.state.protocol import Checkpoint, Production, StateStore
from millwheel.state.redis_store import RedisStore
from tests.support import pipelines
from tests.support.redis_cluster import RedisClusterNodes
from tests.support.redis_server import RedisServer

RECORDS = pipelines.workload(n=1200)
COMPUTATIONS = ("parse", "counts", "totals")


@pytest.fixture(params=["redis", "redis-cluster"])
def url(request: pytest.FixtureRequest) -> Iterator[Callable[[str], str]]:
    """prefix -> store URL: on one redis-server, or on the session's Redis Cluster
    (prefixes made unique to this test there)."""
    if request.param == "redis":
        with RedisServer() as srv:
            yield lambda prefix: f"{srv.url}?prefix={prefix}"
    else:
        nodes: RedisClusterNodes = request.getfixturevalue("redis_cluster")
        tag = "z" + hashlib.sha1(request.node.nodeid.encode()).hexdigest()[:10]
        yield lambda prefix: f"{nodes.url}?prefix={tag}{prefix}"


def runner(store: StateStore) -> LocalRunner:
    return LocalRunner(pipelines.topology(), store, pipelines.sources(RECORDS), batch_size=50)


def visible(store: StateStore) -> object:
    return pipelines.outputs(store), {c: pipelines.final_state(store, c) for c in COMPUTATIONS}


def test_zombie_runner_writes_nothing_and_new_owner_matches_failure_free(url: Callable[[str], str]) -> None:
    reference = RedisStore.from_url(url("ref"))
    runner(reference).run()

    zombie_store, owner_store = RedisStore.from_url(url("zombie")), RedisStore.from_url(url("zombie"))
    zombie = runner(zombie_store)
    for _ in range(6):
        zombie.step()
    owner = runner(owner_store)  # acquires every range: the first runner is now a zombie
    before = visible(owner_store)
    assert before != visible(reference)  # the zombie did part of the work
    with pytest.raises(FencedError):
        for _ in range(100):
            zombie.step()
    assert visible(owner_store) == before, "a fenced zombie changed visible state"
    owner.run()
    assert visible(owner_store) == visible(reference)
    for comp in COMPUTATIONS:
        for r in range(3):
            assert sorted(owner_store.iter_ids(comp, r)) == sorted(reference.iter_ids(comp, r))
            assert owner_store.read_timers(comp, r) == []


def test_every_fenced_write_of_a_zombie_range_worker_is_refused(url: Callable[[str], str]) -> None:
    store = RedisStore.from_url(url("mw"))
    old = store.acquire("counts", 1)
    store.checkpoint(Checkpoint("counts", 1, old, 10, state_writes={"k": b"old"}))
    new = store.acquire("counts", 1)
    store.checkpoint(Checkpoint("counts", 1, new, 20, state_writes={"k": b"new"}, consumed_ids=["x"]))
    attempts: list[Callable[[], object]] = [
        lambda: store.checkpoint(Checkpoint(
            "counts", 1, old, 30, state_writes={"k": b"zombie", "z": b"zombie"},
            productions=[Production("totals", "counts", Record("k", b"zombie", 5, "zombie-out"))],
            consumed_ids=["zombie-id"],
        )),
        lambda: store.ack("counts", 1, old, [("totals", "x")]),
        lambda: store.report_watermark("counts", 1, old, 10**12),
        lambda: store.expire_ids("counts", 1, old, 10**18),
    ]
    for attempt in attempts:
        with pytest.raises(FencedError) as info:
            attempt()
        assert (info.value.token, info.value.current) == (old, new)
    assert store.read_state("counts", ["k", "z"]) == {"k": b"new"}
    assert list(store.iter_ids("counts", 1)) == ["x"]
    assert store.read_watermarks("counts") == {}
    assert store.read_outbox("counts", 1) == []
