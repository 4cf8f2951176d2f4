"""One client cannot starve the control plane or the other clients.

A real controller and two real workers (tests/support/service_cluster.py). The
controller listens on ``localhost``, i.e. on 127.0.0.1 and on [::1]: the "attacker"
dials [::1] and is one client (a host), the test's own client, the workers and the
canary dial 127.0.0.1 and are another. While the attacker holds its streams:

* its 49th stream is refused at once: RESOURCE_EXHAUSTED naming the limit and the flag;
* ClusterStatus answers throughout, every worker is alive in every answer, and no key
  range moves (no worker was ever declared dead);
* a canary pipeline (inject -> 1 s window count -> sink) delivers every window, exact.

Before the Cluster service had a server of its own and client calls were admitted, 48
follow-mode Subscribe streams (or 40 idle Inject streams) filled the controller's one
32-thread pool: heartbeats queued behind them and both workers were declared dead.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

import grpc
import pytest

from millwheel.record import Record
from millwheel.topology import CodeRef, ComputationSpec, InputSpec, Options
from services.client import ControllerClient
from services.generated import millwheel_pb2 as pb
from services.generated import millwheel_pb2_grpc as pb_grpc
from services.rpc.controller_link import NoAnswer, await_start
from services.rpc.convert import spec_to_proto
from services.rpc.security import Security
from tests.support.service_cluster import Cluster

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
SECOND = 1_000_000
BASE_US = 1_700_000_000 * SECOND
HELD = 48  # streams the attacker holds


class Canary:
    """inject -> window_aggregate (1 s tumbling count, 2 key ranges) -> logged sink."""

    def __init__(self, cluster: Cluster, name: str) -> None:
        self.cluster = cluster
        self.name = name
        self.out = f"{name}_counts"

    def register(self) -> None:
        client = self.cluster.client
        client.register_injector(self.name, self.name)
        spec = ComputationSpec(self.out, (InputSpec(self.name),), (self.out,),
                               CodeRef("window_aggregate", {"size_us": SECOND}), Options(key_ranges=2))
        client.register_computation(spec_to_proto(spec), [self.out])

    def run(self, n: int = 2000, keys: int = 10) -> float:
        """Inject ``n`` records (100 per second of event time per ... ``keys`` keys) and
        wait for every window; returns the seconds it took. Asserts every window's count."""
        records = [Record(f"k{i % keys}", b"1", BASE_US + i * 10_000, f"{self.name}-{i}") for i in range(n)]
        started = time.monotonic()
        self.cluster.inject(self.name, self.name, records, batch=100, done=True)
        self.cluster.wait_watermark(self.out, timeout=120)
        took = time.monotonic() - started
        want = Counter((r.key, (r.timestamp - BASE_US) // SECOND) for r in records)
        got: Counter[tuple[str, int]] = Counter()
        for key, value, _ts, _id in self.cluster.outputs(self.out):
            window = json.loads(value)
            got[(key, (window["start"] - BASE_US) // SECOND)] += window["count"]
        assert got == want, f"canary {self.name}: windows differ from the {len(want)} expected"
        return took


class Sampler:
    """ClusterStatus every 0.2 s from a client of its own: every failed call and every
    answer with a worker not alive is kept."""

    def __init__(self, address: str) -> None:
        self.client = ControllerClient(address, timeout_s=2, security=Security(), failover_s=0)
        self.answers = 0
        self.failures: list[str] = []
        self.not_alive: list[tuple[float, list[str]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            try:
                workers = self.client.status().workers
            except Exception as exc:  # noqa: BLE001 - what a user would see, kept
                self.failures.append(str(exc)[:200])
                continue
            self.answers += 1
            dead = [w.worker_id for w in workers if not w.alive]
            if dead or len(workers) < 2:
                self.not_alive.append((time.monotonic(), dead))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.client.close()


def owners(cluster: Cluster) -> dict[tuple[str, int], tuple[str, int]]:
    return {(r.node, r.range_id): (r.worker_id, r.token) for r in cluster.client.status().ranges}


@pytest.fixture
def cluster(tmp_path: Path, request: Any) -> Iterator[Cluster]:
    args = getattr(request, "param", [])
    c = Cluster(tmp_path, controller_args=["--host", "localhost", *args])
    c.start_controller()
    c.start_worker()
    c.start_worker()
    try:
        yield c
    finally:
        c.stop()


def attacker(cluster: Cluster) -> grpc.Channel:
    """A second client, on the IPv6 loopback: another host as the controller sees it."""
    return grpc.insecure_channel(f"[::1]:{cluster.port}")


def follow(stub: pb_grpc.ControllerStub, stream: str) -> Any:
    return stub.Subscribe(pb.SubscribeRequest(stream=stream, follow=True))


def held_while(cluster: Cluster, calls: list[Any], address: str, canary: Canary) -> tuple[Sampler, float]:
    """Sample ClusterStatus while ``calls`` are held and the canary runs, and 2 heartbeat
    timeouts more; returns the sampler (stopped) and the canary's time."""
    sampler = Sampler(address)
    try:
        took = canary.run()
        time.sleep(2 * cluster.heartbeat_timeout_s)
    finally:
        sampler.stop()
    return sampler, took


@pytest.mark.parametrize("cluster", [["--max-client-streams", str(HELD)]], indirect=True)
def test_48_follow_subscribes_of_one_client_starve_nothing(cluster: Cluster) -> None:
    before, during = Canary(cluster, "before"), Canary(cluster, "during")
    before.register()
    during.register()
    cluster.wait_balanced()
    alone = before.run()
    placed = owners(cluster)

    ch = attacker(cluster)
    stub = pb_grpc.ControllerStub(ch)
    calls = [follow(stub, before.out) for _ in range(HELD)]
    try:
        for i, call in enumerate(calls):
            try:
                await_start(call, f"[::1]:{cluster.port}", 10)
            except NoAnswer:
                pytest.fail(f"follow Subscribe {i + 1} of {HELD} was not started within 10 s")
        extra = follow(stub, before.out)
        with pytest.raises(grpc.RpcError) as refused:
            next(iter(extra))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"--max-client-streams={HELD}" in (refused.value.details() or ""), refused.value.details()

        sampler, took = held_while(cluster, calls, cluster.address, during)
        print(f"canary: {alone:.2f} s alone, {took:.2f} s while one client holds {HELD} streams")
        assert not sampler.failures, f"ClusterStatus failed {len(sampler.failures)} times: {sampler.failures[:3]}"
        assert sampler.answers >= 10
        assert not sampler.not_alive, f"workers not alive: {sampler.not_alive[:3]}"
        assert all(call.is_active() for call in calls), "the held streams must still be open"
    finally:
        for call in calls:
            call.cancel()
        ch.close()
    assert owners(cluster) == placed, "a key range moved: a worker was declared dead"


class Silent:
    """An Inject request stream that sends nothing until released."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def __iter__(self) -> Iterator[Any]:
        self.release.wait(120)
        return
        yield  # a generator


IDLE_INJECTS = 40


@pytest.mark.parametrize("cluster", [["--max-client-streams", str(IDLE_INJECTS),
                                      "--stream-idle-timeout", "6"]], indirect=True)
def test_40_idle_inject_streams_of_one_client_starve_nothing_and_end(cluster: Cluster) -> None:
    canary = Canary(cluster, "canary")
    canary.register()
    cluster.wait_balanced()
    placed = owners(cluster)
    ch = attacker(cluster)
    stub = pb_grpc.ControllerStub(ch)
    silent = [Silent() for _ in range(IDLE_INJECTS + 1)]
    try:
        began = time.monotonic()
        calls = [stub.Inject.future(iter(s)) for s in silent[:IDLE_INJECTS]]
        for call in calls:
            await_start(call, f"[::1]:{cluster.port}", 10)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Inject(iter(silent[-1]), timeout=10)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"--max-client-streams={IDLE_INJECTS}" in (refused.value.details() or "")

        sampler = Sampler(cluster.address)
        try:
            took = canary.run()
            assert time.monotonic() - began < 6, "the canary must finish while the streams are held"
            ended = []
            for call in calls:
                with pytest.raises(grpc.RpcError) as info:
                    call.result(timeout=20)
                ended.append((info.value.code(), info.value.details() or ""))
        finally:
            sampler.stop()
        print(f"canary: {took:.2f} s while one client holds {IDLE_INJECTS} idle Inject streams")
        assert {code for code, _ in ended} == {grpc.StatusCode.DEADLINE_EXCEEDED}
        assert all("no message from the client for 6 s" in d and "--stream-idle-timeout=6" in d
                   for _, d in ended), ended[0]
        assert not sampler.failures, f"ClusterStatus failed: {sampler.failures[:3]}"
        assert not sampler.not_alive, f"workers not alive: {sampler.not_alive[:3]}"
        again = stub.Inject.future(iter(silent[-1]))  # the slots are free again
        await_start(again, f"[::1]:{cluster.port}", 10)
        again.cancel()
    finally:
        for s in silent:
            s.release.set()
        ch.close()
    assert owners(cluster) == placed, "a key range moved: a worker was declared dead"


@pytest.mark.parametrize("cluster", [["--stream-idle-timeout", "1.5"]], indirect=True)
def test_the_python_client_goes_on_after_an_idle_end(cluster: Cluster) -> None:
    """A quiet source (``tail -f | millwheel inject``) and a slow reader: the controller
    ends their idle calls, the client goes on in new ones; nothing lost, nothing twice."""
    cluster.client.register_injector("big", "big")
    spec = ComputationSpec("copy", (InputSpec("big"),), ("copied",), CodeRef("map", {"key": "key"}),
                           Options(key_ranges=2))
    cluster.client.register_computation(spec_to_proto(spec), ["copied"])
    cluster.wait_balanced()
    value = b"v" * 1000
    n = 6000  # 6 MB: more than the connection buffers, so an unread stream blocks

    def slow() -> Iterator[pb.InjectRequest]:
        for part in range(3):
            yield pb.InjectRequest(injector="big", stream="big", records=[
                pb.Record(key=f"k{i}", value=value, timestamp=BASE_US + i, id=f"r{i}")
                for i in range(part * n // 3, (part + 1) * n // 3)])
            time.sleep(3.5)  # the controller ends the call after 1.5 s of this
        yield pb.InjectRequest(injector="big", stream="big", done=True)

    resp = cluster.client.inject(slow())
    assert resp.accepted >= n
    cluster.wait_watermark("copy", timeout=120)

    ch = grpc.insecure_channel(cluster.address)  # a reader that stops reading: ended
    try:
        raw = pb_grpc.ControllerStub(ch).Subscribe(pb.SubscribeRequest(stream="copied"))
        next(raw)
        time.sleep(4)
        with pytest.raises(grpc.RpcError) as ended:
            for _ in raw:
                pass
        assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "the client read nothing for 1.5 s" in (ended.value.details() or "")
    finally:
        ch.close()

    seen: list[str] = []
    for _seq, record in cluster.client.subscribe("copied"):  # the client resumes by itself
        seen.append(record.key)
        if len(seen) == 1:
            time.sleep(4)
    assert len(seen) == n and set(seen) == {f"k{i}" for i in range(n)}  # each once
