"""A range that cannot be built or checkpointed is failing, visibly, and blocks nothing.

* Code that raises when constructed (allowed by ``--allow-code``; the controller never
  imports user code, so it cannot know): each worker used to fail its whole heartbeat
  on it ten times a second, and the ranges sorted after it were never taken. Now its
  ranges are marked failing (``millwheel errors``, ``DescribeComputation``,
  ``ClusterStatus``, the console), retried with backoff, logged rarely, and every
  other range runs.
* A range whose checkpoints keep failing (a store error that persists: here a Redis
  key of the wrong type in that range alone) used to stay invisible while its share
  of a shared injector's outbox filled it: the other consumer of the injected stream
  stalled. Now the failing consumer is visible, its share of the outbox waits in the
  store, the healthy consumer gets every record, and once the store is mended the
  failing one catches up, exactly once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import redis

from services.generated import millwheel_pb2 as pb
from tests.support.canary_pipeline import Canary
from tests.support.redis_server import RedisServer, free_port
from tests.support.service_cluster import ROOT, Cluster, wait_for

pytestmark = pytest.mark.timeout(400)
CODE = "tests.support.misbehaving_code"
BROKEN_MESSAGE = "cannot connect to the feature store"


def comp(name: str, stream: str, code: str, outputs: list[str], params: dict[str, Any] | None = None,
         key_ranges: int = 2) -> pb.ComputationSpec:
    return pb.ComputationSpec(name=name, inputs=[pb.InputStream(stream=stream)], outputs=outputs,
                              code=pb.Code(name=code, params_json=json.dumps(params or {})),
                              options=pb.Options(key_ranges=key_ranges))


def cli(cluster: Cluster, *args: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "services.cli", *args, "--controller", cluster.address],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def console(port: int, path: str) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
        return json.loads(resp.read())


def all_alive(cluster: Cluster, n: int) -> None:
    status = cluster.client.status()
    assert len(status.workers) == n and all(w.alive for w in status.workers), status.workers
    assert all(p.poll() is None for p in cluster.workers)


def test_code_that_fails_to_build_is_failing_visible_and_blocks_no_other_range(tmp_path: Path) -> None:
    ui = free_port()
    cluster = Cluster(tmp_path, allow_code=CODE, controller_args=["--ui-port", str(ui)])
    try:
        cluster.start_controller()
        cluster.start_worker()
        cluster.start_worker()
        # Registered first, and sorting before everything registered after it.
        cluster.client.register_topology(
            [comp("a-broken", "broken-in", f"{CODE}:FailsToBuild", ["broken-out"], {"dsn": "x"}),
             comp("a-exits", "broken-in", f"{CODE}:ExitsWhenBuilt", ["exits-out"], key_ranges=1)],
            [("broken", "broken-in")])
        canary = Canary(cluster.client)
        canary.register()
        canary.round()
        started = time.monotonic()

        def failing() -> list[pb.RangeFailure]:
            return list(cluster.client.describe("a-broken").failing_ranges)

        wait_for(lambda: len(failing()) == 2, 20, "both ranges of a-broken to show as failing")
        for f in failing():
            assert f.stage == "build" and BROKEN_MESSAGE in f.message, f
            assert f.exception_type == "RuntimeError" and f.worker_id and f.attempts >= 1, f
        wait_for(lambda: cluster.client.describe("a-exits").failing_ranges, 20, "a-exits to show as failing")
        (exits,) = cluster.client.describe("a-exits").failing_ranges
        assert exits.stage == "build" and exits.exception_type == "SystemExit", exits
        broken = [r for r in cluster.client.status().ranges if r.node == "a-broken"]
        assert len(broken) == 2 and all(r.failure.stage == "build" for r in broken), broken
        assert all(BROKEN_MESSAGE in r.failure.message for r in broken)
        out = cli(cluster, "errors", "a-broken")
        assert "failing ranges" in out and BROKEN_MESSAGE in out and "build" in out, out
        assert "a-broken" in cli(cluster, "status")
        wait_for(lambda: console(ui, "/api/v1/computation?computation=a-broken")["health"] == "failing",
                 20, "the console to show a-broken failing")
        shown = console(ui, "/api/v1/computation?computation=a-broken")
        assert BROKEN_MESSAGE in shown["health_reason"] + json.dumps(shown["failing_ranges"]), shown

        # Meanwhile everything else runs, again and again.
        for _ in range(3):
            canary.round()
        time.sleep(max(0.0, 8 - (time.monotonic() - started)))
        all_alive(cluster, 2)
        # Retried with backoff (a heartbeat is every 100 ms), and logged rarely.
        attempts = max(f.attempts for f in failing())
        assert 2 <= attempts <= 20, failing()
        for i in range(2):
            log = cluster.log(f"worker{i}")
            assert log.count("Traceback") <= 2, log[-3000:]
            assert log.count(BROKEN_MESSAGE) <= 6, log[-3000:]
            assert len(log) < 50_000, len(log)

        # Unregistered, it is gone, and nothing else noticed.
        cluster.client.unregister("a-broken")
        cluster.client.unregister("a-exits")
        wait_for(lambda: not any(r.node == "a-broken" for r in cluster.client.status().ranges), 10,
                 "a-broken's ranges to go")
        canary.round()
        all_alive(cluster, 2)
        print(f"canary rounds (s): {[round(t, 2) for t in canary.seconds]}")
    finally:
        cluster.stop()


def test_a_range_whose_checkpoints_keep_failing_does_not_stall_its_injectors_other_consumer(
        tmp_path: Path) -> None:
    n = 30_000
    with RedisServer() as server:
        raw = redis.Redis(port=server.port)
        cluster = Cluster(tmp_path, store_url=server.url, allow_code=CODE,
                          worker_args=["--max-injector-outbox", "5000"])
        try:
            cluster.start_controller()
            cluster.start_worker()
            cluster.start_worker()
            canary = Canary(cluster.client)
            canary.register()
            # Every checkpoint of bad/0 fails in the store (a key of the wrong type),
            # until the key is mended.
            bad_key = "mw:r:{bad:0}:oseq"
            raw.hset(bad_key, "x", "not a counter")
            cluster.client.register_topology(
                [comp("good", "shared", f"{CODE}:PassThrough", ["good-out"], {"output": "good-out"}),
                 comp("bad", "shared", f"{CODE}:PassThrough", ["bad-out"], {"output": "bad-out"}, 1)],
                [("shared", "shared")])
            canary.round()
            records = [pb.Record(key=f"k{i % 50}", value=b"%d" % i, timestamp=1_000_000 + i, id=f"r{i}")
                       for i in range(n)]
            msgs = [pb.InjectRequest(injector="shared", stream="shared", records=records[i:i + 1000])
                    for i in range(0, n, 1000)]
            started = time.monotonic()
            cluster.client.inject(msgs, busy_retry_s=60)
            injected_s = time.monotonic() - started

            def delivered(stream: str) -> Counter[bytes]:
                return Counter(r.value for _s, r in cluster.client.subscribe(stream))

            wait_for(lambda: len(list(cluster.client.subscribe("good-out"))) == n, 120,
                     "the healthy consumer to get every record")
            healthy_s = time.monotonic() - started
            canary.round()
            failing = list(cluster.client.describe("bad").failing_ranges)
            assert len(failing) == 1 and failing[0].stage == "checkpoint", failing
            assert "mw:r:{bad:0}:oseq" in failing[0].message, failing[0]
            assert "bad" in cli(cluster, "errors", "bad") and "checkpoint" in cli(cluster, "errors", "bad")
            (bad_range,) = [r for r in cluster.client.status().ranges if r.node == "bad"]
            assert bad_range.failure.stage == "checkpoint"
            all_alive(cluster, 2)
            for i in range(2):
                log = cluster.log(f"worker{i}")
                assert log.count("Traceback") <= 4 and len(log) < 200_000, log[-3000:]

            # Mended: the failing consumer catches up, every record exactly once.
            raw.delete(bad_key)
            mended = time.monotonic()
            wait_for(lambda: len(list(cluster.client.subscribe("bad-out"))) >= n, 180,
                     "the mended consumer to catch up")
            print(f"{n} records injected in {injected_s:.1f} s, all at the healthy consumer after "
                  f"{healthy_s:.1f} s; the mended one caught up in {time.monotonic() - mended:.1f} s")
            want = Counter(b"%d" % i for i in range(n))
            for stream in ("good-out", "bad-out"):
                ids = [r.record_id for _s, r in cluster.client.subscribe(stream)]
                assert len(ids) == n and len(set(ids)) == n, stream
                assert delivered(stream) == want, stream
            wait_for(lambda: not cluster.client.describe("bad").failing_ranges, 30, "bad to recover")
            canary.round()
            all_alive(cluster, 2)
            print(f"canary rounds (s): {[round(t, 2) for t in canary.seconds]}")
        finally:
            cluster.stop()
            raw.close()
