"""The Redis store on a real Redis Cluster (3 masters + 3 replicas, started by the
tests): found by the URL of one node, ranges spread over the masters, reads across
slots, database numbers refused, every connection closed, replicated writes, and a
master killed mid-stream under the running service with the output still exact."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.crc import key_slot

from millwheel.errors import InvalidSpecError, StoreError
from millwheel.state import open_store
from millwheel.state.protocol import Checkpoint
from tests.support import pipelines
from tests.support.redis_cluster import RedisClusterNodes
from tests.support.service_cluster import PIPELINE_CODE, Cluster, expected_outputs, wait_for

pytestmark = pytest.mark.timeout(300)


def cp(range_id: int, token: int, n: int = 0) -> Checkpoint:
    return Checkpoint("counts", range_id, token, 100 + n,
                      state_writes={f"k{range_id}": f"v{n}".encode()}, consumed_ids=[f"in-{n}"])


def keys_on(node_port: int, prefix: str) -> int:
    return len(list(redis.Redis(port=node_port).scan_iter(match=f"{prefix}:*", count=1000)))


def test_one_node_url_finds_the_cluster_and_ranges_spread_over_every_master(
    redis_cluster: RedisClusterNodes,
) -> None:
    store: Any = open_store(f"{redis_cluster.url}?prefix=spread")
    try:
        for r in range(24):
            store.checkpoint(cp(r, store.acquire("counts", r)))
        assert isinstance(store._r, redis.RedisCluster)
        per_master = [keys_on(m.port, "spread") for m in redis_cluster.masters()]
        assert len(per_master) == 3 and all(n > 0 for n in per_master), per_master
        # reads that span slots (no range given: every range of the registry is searched)
        wanted = [f"k{r}" for r in range(24)]
        assert store.read_state("counts", wanted) == {k: b"v0" for k in wanted}
        assert store.list_keys("counts", None, 100) == sorted(wanted)
    finally:
        store.close()


def test_database_other_than_0_is_refused_on_a_cluster(redis_cluster: RedisClusterNodes) -> None:
    store = open_store(redis_cluster.url.replace("/0", "/2"))
    with pytest.raises(InvalidSpecError, match=r"database 2 .*only database 0"):
        store.acquire("counts", 0)


def test_a_single_node_client_forced_on_a_cluster_says_why_it_fails(redis_cluster: RedisClusterNodes) -> None:
    store = open_store(f"{redis_cluster.url}?cluster=no&prefix=forced")
    started = time.monotonic()
    with pytest.raises(StoreError, match=r"MovedError.*drop \?cluster=no"):
        for r in range(24):  # some of these ranges live on another node
            store.acquire("counts", r)
    assert time.monotonic() - started < 5, "a MOVED the client cannot follow is not retried"


def test_close_releases_the_connections_to_every_node(redis_cluster: RedisClusterNodes) -> None:
    probes = {n.port: redis.Redis(port=n.port) for n in redis_cluster.alive()}

    def connections() -> set[tuple[int, str]]:
        """(node port, client address) of every client connection of every node."""
        return {(port, c["addr"]) for port, p in probes.items() for c in p.client_list()}

    before = connections()  # (stores of earlier tests may close theirs meanwhile)
    store = open_store(f"{redis_cluster.url}?prefix=close")
    for r in range(24):
        store.acquire("counts", r)
    opened = connections() - before
    masters = {m.port for m in redis_cluster.masters()}
    assert masters <= {port for port, _addr in opened}, "a connection to each master"
    store.close()
    wait_for(lambda: not connections() & opened, 5, "the store's connections to close")


def test_a_range_whose_slot_moves_mid_use_keeps_working(redis_cluster: RedisClusterNodes) -> None:
    """Resharding under a live store: the slot of range 0 is migrating with half its
    keys moved (a script there meets TRYAGAIN/ASK) when a checkpoint comes; it is
    retried until the migration ends, then MOVED leads the client to the new master."""
    store = open_store(f"{redis_cluster.url}?prefix=moving")
    t = store.acquire("counts", 0)
    store.checkpoint(cp(0, t, 1))
    tagged = "moving:r:{counts:0}:state"
    slot = key_slot(tagged.encode())
    source = redis_cluster.master_of(tagged)
    target = next(m for m in redis_cluster.masters() if m is not source)
    src, dst = redis.Redis(port=source.port), redis.Redis(port=target.port)
    src_id, dst_id = (c.execute_command("CLUSTER", "MYID").decode() for c in (src, dst))
    dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
    src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
    keys = src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 10000)
    assert tagged.encode() in keys
    src.migrate("127.0.0.1", target.port, keys[: len(keys) // 2], 0, 5000)

    moments: dict[str, float] = {}

    def finish() -> None:
        time.sleep(0.7)
        rest = src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 10000)
        if rest:
            src.migrate("127.0.0.1", target.port, rest, 0, 5000)
        moments["keys_moved"] = time.monotonic()
        for m in redis_cluster.masters():
            redis.Redis(port=m.port).execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)

    mover = threading.Thread(target=finish)
    mover.start()
    try:
        store.checkpoint(cp(0, t, 2))
        moments["checkpointed"] = time.monotonic()
    finally:
        mover.join()
    assert moments["checkpointed"] >= moments["keys_moved"], "the checkpoint never met the migration"
    assert redis_cluster.master_of(tagged) is target
    assert store.read_state("counts", ["k0"]) == {"k0": b"v2"}
    store.checkpoint(cp(0, t, 3))
    assert store.read_state("counts", ["k0"], range_id=0) == {"k0": b"v3"}
    store.close()


def test_wait_replicas_returns_once_the_replica_has_the_checkpoint(redis_cluster: RedisClusterNodes) -> None:
    store = open_store(f"{redis_cluster.url}?prefix=w1&wait_replicas=1")
    t = store.acquire("counts", 0)
    store.checkpoint(cp(0, t))
    last = "w1:r:{counts:0}:last"
    master = redis_cluster.master_of(last)
    replica = redis.Redis(port=redis_cluster.replica_of(master).port)
    replica.execute_command("READONLY")
    stored = redis.Redis(port=master.port).get(last)
    assert stored and replica.get(last) == stored

    # A stopped replica acknowledges nothing: the next checkpoint waits for it. (A WAIT
    # on another pooled connection would return at once: that connection's own last
    # write was acknowledged before the stop.)
    paused = redis_cluster.replica_of(master)
    assert paused.proc is not None
    done = threading.Event()
    time.sleep(1.2)  # the replica's periodic ACK now covers every earlier write of any connection
    os.kill(paused.proc.pid, signal.SIGSTOP)
    try:
        writer = threading.Thread(target=lambda: (store.checkpoint(cp(0, t, 2)), done.set()))
        writer.start()
        assert not done.wait(2.5), "the checkpoint returned before any replica had it"
    finally:
        os.kill(paused.proc.pid, signal.SIGCONT)
    writer.join(30)
    assert done.is_set()
    assert replica.get(last) == redis.Redis(port=master.port).get(last) != stored
    store.close()
    redis_cluster.wait_ok(expected_masters=3)

    two = open_store(f"{redis_cluster.url}?prefix=w2&wait_replicas=2&retry_deadline=0.5")
    with pytest.raises(StoreError, match="acknowledged by 1 of 2 replicas"):
        two.acquire("counts", 0)  # each master has one replica
    two.close()


@pytest.mark.parametrize("options,restart", [("?wait_replicas=1", True), ("", False)],
                         ids=["wait_replicas=1,restarted", "default,left-dead"])
def test_master_killed_mid_stream_replica_takes_over_and_output_is_exact(
    tmp_path: Path, options: str, restart: bool,
) -> None:
    """kill -9 of the master holding a range of ``counts`` while records flow; its
    replica is promoted. With ``wait_replicas=1`` the dead node must come back (here:
    restarted, it rejoins as a replica) before the shard accepts writes again; without,
    the promoted replica serves alone. Either way the output equals a failure-free run
    record by record, every worker survives, and none met lost writes."""
    topology = pipelines.topology(key_ranges=3)
    records = pipelines.workload(n=1500)
    want = expected_outputs(tmp_path, topology, pipelines.sources(records), ("counts", "totals"))
    with RedisClusterNodes() as nodes:
        service = Cluster(tmp_path, store_url=nodes.url + options, allow_code=PIPELINE_CODE)
        try:
            service.start_controller()
            for _ in range(2):
                service.start_worker()
            service.register(topology)
            service.wait_balanced()
            victim = nodes.master_of("mw:r:{counts:1}:state")
            figures: dict[str, float] = {}

            def kill_master(i: int) -> None:
                if i != 6:
                    return
                started = time.monotonic()
                victim.kill()
                nodes.wait_ok(expected_masters=3)  # the replica was promoted
                figures["promoted_s"] = time.monotonic() - started
                if restart:
                    victim.start()  # back as a replica of its successor
                    nodes.wait_ok(expected_masters=3)
                    figures["rejoined_s"] = time.monotonic() - started

            started = time.monotonic()
            service.inject("events", "events", records, max_disorder_us=2 * pipelines.SECOND,
                           done=True, between=kill_master)
            service.wait_watermark("totals", timeout=120)
            figures["run_s"] = time.monotonic() - started
            print(f"\nfailover figures: {figures}")
            assert "promoted_s" in figures, "the master was never killed"
            assert nodes.master_of("mw:r:{counts:1}:state") is not victim
            assert service.outputs("counts") == want["counts"]
            assert service.outputs("totals") == want["totals"]
            assert all(w.poll() is None for w in service.workers), "a worker died"
            logs = service.log("worker0") + service.log("worker1") + service.log("controller")
            assert "lost acknowledged writes" not in logs
        finally:
            service.stop()
