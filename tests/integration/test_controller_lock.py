"""The controller answers heartbeats while a store call is blocked (issue 21, item 4), end to end.

A real controller (gRPC on loopback, a real SQLite store) whose store's
``report_watermark`` blocks for one range until the test lets it go, as a Redis shard
that is away would: the store underneath is real, only the block is injected. Another
worker's heartbeats are answered meanwhile, ClusterStatus shows both workers alive
past several heartbeat timeouts, nothing moves, and once the store answers the
blocked range's watermark arrives.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from services.client import ControllerClient
from services.controller.service import serve
from services.generated import millwheel_pb2 as pb
from services.generated import millwheel_pb2_grpc as pb_grpc
from services.rpc.convert import spec_to_proto
from services.rpc.security import Security
from tests.support import pipelines
from tests.support.blocking_store import BlockingStore

pytestmark = pytest.mark.timeout(120)
HEARTBEAT_TIMEOUT_S = 1.0


def heartbeat(stub: Any, worker: str, tokens: dict[tuple[str, int], int], wm: int,
              timeout: float = 30) -> Any:
    return stub.Heartbeat(pb.HeartbeatRequest(
        worker_id=worker, address=f"127.0.0.1:{1000 + int(worker[-1])}",
        reports=[pb.WatermarkReport(node=n, range_id=r, token=t, watermark=wm) for (n, r), t in tokens.items()]),
        timeout=timeout)


def owned(resp: Any, worker: str) -> dict[tuple[str, int], int]:
    return {(a.node, a.range_id): a.token for a in resp.assignments if a.worker_id == worker}


def test_a_heartbeat_is_answered_while_another_heartbeats_store_write_is_blocked(tmp_path: Path) -> None:
    server, port, _m, service = serve(f"sqlite:///{tmp_path}/s.db", port=0, metrics_port=None,
                                      heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S, allow_code=pipelines.__name__)
    client = ControllerClient(f"127.0.0.1:{port}", timeout_s=10, security=Security())
    channel = grpc.insecure_channel(f"127.0.0.1:{service.cluster_port}")
    stub = pb_grpc.ClusterStub(channel)
    blocking: BlockingStore | None = None
    try:
        topology = pipelines.topology(key_ranges=2)
        for inj in topology.injectors:
            client.register_injector(inj.name, inj.stream)
        for spec in topology.computations:
            client.register_computation(spec_to_proto(spec), [])
        for w in ("w1", "w2"):
            heartbeat(stub, w, {}, 0)
        deadline = time.monotonic() + 30
        last: Any = None
        while True:  # both workers hold ranges, evenly, and the assignment stays put
            r1, r2 = heartbeat(stub, "w1", {}, 0), heartbeat(stub, "w2", {}, 0)
            mine, theirs = owned(r1, "w1"), owned(r2, "w2")
            even = abs(len(mine) - len(theirs)) <= 1 and len(mine) + len(theirs) == len(r1.assignments)
            if even and (mine, theirs) == last:
                break
            last = (mine, theirs) if even else None
            assert time.monotonic() < deadline, "ranges never assigned"
            time.sleep(0.3)
        blocked = sorted(mine)[0]
        blocking = BlockingStore(service.plane.store._store, blocked)  # the store under the leader's fence
        service.plane.store._store = blocking  # type: ignore[attr-defined]

        stuck = threading.Thread(target=lambda: heartbeat(stub, "w1", mine, 5_000), daemon=True)
        stuck.start()
        assert blocking.entered.wait(30), "the blocked range's report never reached the store"
        # w2's heartbeats are answered, with its own (unblocked) reports written, and w1's
        # later heartbeats too, for three heartbeat timeouts while the write stays blocked.
        until = time.monotonic() + 3 * HEARTBEAT_TIMEOUT_S
        while time.monotonic() < until:
            assert owned(heartbeat(stub, "w2", theirs, 7_000, timeout=10), "w2") == theirs
            assert owned(heartbeat(stub, "w1", mine, 5_000, timeout=10), "w1") == mine
            status = client.status()
            assert {w.worker_id: w.alive for w in status.workers} == {"w1": True, "w2": True}
            time.sleep(0.1)
        assert not blocking.release.is_set()
        ranges = {(r.node, r.range_id): r for r in client.status().ranges}
        assert all(ranges[u].watermark == 7_000 for u in theirs), "w2's reports were held back"
        assert ranges[blocked].watermark != 5_000  # still blocked: not served before it is stored

        blocking.release.set()
        stuck.join(30)
        deadline = time.monotonic() + 30
        while {(r.node, r.range_id): r.watermark for r in client.status().ranges}[blocked] != 5_000:
            assert time.monotonic() < deadline, "the blocked report never arrived"
            heartbeat(stub, "w1", mine, 5_000)
            time.sleep(0.05)
        assert {(r.node, r.range_id): (r.worker_id, r.token) for r in client.status().ranges} == \
            {**{u: ("w1", t) for u, t in mine.items()}, **{u: ("w2", t) for u, t in theirs.items()}}
    finally:
        if blocking is not None:
            blocking.release.set()
        channel.close()
        client.close()
        service.close()
        server.stop(0)
