"""Client admission on a real controller (no workers needed): what each limit refuses,
with which status and message, and what it leaves alone.

The controller listens on ``localhost`` (127.0.0.1 and [::1]); a channel to [::1] is one
client, a channel to 127.0.0.1 another (a client is the peer's host).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Iterator

import grpc
import pytest

from millwheel.topology import CodeRef, ComputationSpec, InputSpec
from services.generated import millwheel_pb2 as pb
from services.generated import millwheel_pb2_grpc as pb_grpc
from services.metrics import scrape
from services.rpc.controller_link import await_start
from services.rpc.convert import spec_to_proto
from services.rpc.security import Security
from tests.support.redis_server import free_port
from tests.support.service_cluster import Cluster, wait_for

pytestmark = [pytest.mark.timeout(120)]
LOGGED = "out"


@pytest.fixture
def controller(tmp_path: Path, request: Any) -> Iterator[Cluster]:
    c = Cluster(tmp_path, controller_args=["--host", "localhost", *request.param])
    c.start_controller()
    c.client.register_injector("in", "in")
    spec = ComputationSpec("copy", (InputSpec("in"),), (LOGGED,), CodeRef("map", {"key": "key"}))
    c.client.register_computation(spec_to_proto(spec), [LOGGED])
    try:
        yield c
    finally:
        c.stop()


def stub(c: Cluster, v6: bool) -> tuple[grpc.Channel, pb_grpc.ControllerStub]:
    """A channel of one client, connected before it is used: a call made while a fresh
    channel still connects can fail at once (UNAVAILABLE), and a test that holds calls
    open must know they reached the controller."""
    ch = grpc.insecure_channel(f"[::1]:{c.port}" if v6 else f"127.0.0.1:{c.port}")
    grpc.channel_ready_future(ch).result(timeout=15)
    return ch, pb_grpc.ControllerStub(ch)


def follow(s: pb_grpc.ControllerStub) -> Any:
    call = s.Subscribe(pb.SubscribeRequest(stream=LOGGED, follow=True))
    return call


def started(call: Any) -> Any:
    await_start(call, "controller", 5)
    assert call.is_active(), f"refused: {call.code()} {call.details()}"
    return call


def refusal(call: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        for _ in call:
            pass
    return info.value.code(), info.value.details() or ""


class Silent:
    """A request stream that sends nothing until released (then ends)."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def __iter__(self) -> Iterator[Any]:
        self.release.wait(60)
        return
        yield  # a generator


METRICS_PORT = free_port()


@pytest.mark.parametrize("controller", [["--max-client-streams", "2", "--max-streams", "3",
                                         "--metrics-port", str(METRICS_PORT)]], indirect=True)
def test_streams_are_bounded_per_client_and_in_total(controller: Cluster) -> None:
    ch6, v6 = stub(controller, True)
    ch4, v4 = stub(controller, False)
    held = [started(follow(v6)), started(follow(v6))]
    try:
        code, details = refusal(follow(v6))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "client ::1 already has 2 streams open" in details and "--max-client-streams=2" in details

        held.append(started(follow(v4)))  # another client has its own share...
        code, details = refusal(follow(v4))  # ...of what is left in all
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "already has 3 streams open from all clients" in details and "--max-streams=3" in details

        # Streams and unary calls are counted apart: both clients still query.
        assert v6.ClusterStatus(pb.ClusterStatusRequest(), timeout=5).answered_by
        assert controller.client.status().answered_by

        # An operator sees refusals by limit on the controller's /metrics.
        samples = scrape(f"127.0.0.1:{METRICS_PORT}", 5)
        method = "/millwheel.v1.Controller/Subscribe"
        assert samples[("millwheel_admission_refused_total",
                        (("limit", "--max-client-streams"), ("method", method)))] == 1
        assert samples[("millwheel_admission_refused_total", (("limit", "--max-streams"), ("method", method)))] == 1

        held.pop(0).cancel()  # a stream that ends gives its slot back at once
        held.append(wait_for(lambda: _try_start(v4), 5, "the freed slot"))
    finally:
        for call in held:
            call.cancel()
        ch6.close()
        ch4.close()


def _try_start(s: pb_grpc.ControllerStub) -> Any:
    call = follow(s)
    try:
        return started(call)
    except AssertionError:
        return None


# The idle timeout is the window in which the third call must meet both silent calls
# held: 4 s, so one slow poll on a loaded machine (the first may land before they are
# admitted) cannot outlast it.
@pytest.mark.parametrize("controller", [["--max-client-calls", "2", "--max-calls", "3",
                                         "--stream-idle-timeout", "4"]], indirect=True)
def test_unary_calls_that_never_send_their_request_are_bounded_and_ended(controller: Cluster) -> None:
    """A unary call whose client sends the headers and never the message held a pool
    thread for as long as the client liked (grpcio reads it on a pool thread): now it
    holds a call slot, bounded, and is ended after the idle timeout."""
    ch6, v6 = stub(controller, True)
    ch4, _ = stub(controller, False)
    silent = ch6.stream_unary("/millwheel.v1.Controller/GetWatermark",
                              request_serializer=lambda m: m,
                              response_deserializer=pb.GetWatermarkResponse.FromString)
    feeds = [Silent(), Silent()]
    calls = [silent.future(iter(f)) for f in feeds]
    try:
        def third_refused() -> tuple[grpc.StatusCode, str] | None:
            try:
                v6.GetWatermark(pb.GetWatermarkRequest(), timeout=5)
                return None  # not both admitted yet
            except grpc.RpcError as exc:
                return exc.code(), exc.details() or ""
        code, details = wait_for(third_refused, 10, "a third call of the client to be refused")
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "unary calls in flight" in details and "--max-client-calls=2" in details
        assert controller.client.watermarks() is not None  # the other client is served

        began = time.monotonic()
        for call in calls:
            with pytest.raises(grpc.RpcError) as ended:
                call.result(timeout=10)
            assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "no message from the client for 4 s" in (ended.value.details() or "")
            assert "--stream-idle-timeout=4" in (ended.value.details() or "")
        assert time.monotonic() - began < 8
        wait_for(lambda: third_refused() is None, 5, "the client's slots to be free again")
    finally:
        for f in feeds:
            f.release.set()
        ch6.close()
        ch4.close()


@pytest.mark.parametrize("controller", [["--stream-idle-timeout", "1.5"]], indirect=True)
def test_an_inject_stream_sending_nothing_is_ended(controller: Cluster) -> None:
    ch6, v6 = stub(controller, True)
    feed = Silent()
    try:
        call = v6.Inject.future(iter(feed))
        began = time.monotonic()
        with pytest.raises(grpc.RpcError) as ended:
            call.result(timeout=10)
        took = time.monotonic() - began
        assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        details = ended.value.details() or ""
        assert "Inject: no message from the client for 1.5 s" in details
        assert "--stream-idle-timeout=1.5" in details
        assert 1.4 < took < 5
        assert controller.client.computations().injectors == [
            pb.InjectorSpec(name="in", stream="in")]  # nothing registered, nothing changed
    finally:
        feed.release.set()
        ch6.close()


def test_the_cluster_port_serves_heartbeats_to_cluster_members_only(tmp_path: Path) -> None:
    """The cluster port: Heartbeat under the same tokens as before (a client token is
    refused, without reading the request); nothing else (no Controller service, no
    health, no reflection), so no client can hold its threads."""
    token, secret = "client-token-x", "cluster-secret-y"
    c = Cluster(tmp_path, env={"MILLWHEEL_AUTH_TOKEN": token, "MILLWHEEL_CLUSTER_SECRET": secret},
                controller_args=["--cluster-port", "0"])
    c.client.close()
    c.client = type(c.client)(c.address, timeout_s=10, security=Security(client_token=token))
    c.start_controller()
    try:
        first = _heartbeat(c.address, secret)
        assert first.cluster_address and first.cluster_address != c.address
        again = _heartbeat(first.cluster_address, secret)
        assert again.cluster_address == first.cluster_address
        for who, tok, code in (("client", token, grpc.StatusCode.PERMISSION_DENIED),
                               ("nobody", None, grpc.StatusCode.UNAUTHENTICATED)):
            with pytest.raises(grpc.RpcError) as refused:
                _heartbeat(first.cluster_address, tok)
            assert refused.value.code() == code, who
        ch = grpc.insecure_channel(first.cluster_address)
        try:
            for method in ("/millwheel.v1.Controller/ClusterStatus", "/grpc.health.v1.Health/Check"):
                with pytest.raises(grpc.RpcError) as absent:
                    ch.unary_unary(method)(b"", timeout=5, metadata=(("authorization", f"Bearer {secret}"),))
                assert absent.value.code() == grpc.StatusCode.UNIMPLEMENTED, method
        finally:
            ch.close()
        assert not c.client.status().workers  # a liveness-only heartbeat joins nobody
    finally:
        c.stop()


def _heartbeat(address: str, token: str | None) -> pb.HeartbeatResponse:
    ch = grpc.insecure_channel(address)
    try:
        meta = (("authorization", f"Bearer {token}"),) if token else ()
        return pb_grpc.ClusterStub(ch).Heartbeat(
            pb.HeartbeatRequest(worker_id="probe", address="127.0.0.1:1", liveness_only=True),
            timeout=5, metadata=meta)
    finally:
        ch.close()



@pytest.mark.parametrize("controller", [["--max-client-streams", "3", "--max-streams", "3",
                                         "--max-client-calls", "2", "--max-calls", "2"]], indirect=True)
def test_refusals_are_answered_while_every_admitted_slot_is_held(controller: Cluster) -> None:
    """Every admitted slot held (3 streams, 2 unary calls whose request never comes):
    60 more calls (in waves of 10) are refused at once, each with its message, since the
    decision never waits for a request and the pool keeps threads beyond the slots."""
    ch6, v6 = stub(controller, True)
    silent = ch6.stream_unary("/millwheel.v1.Controller/GetWatermark", request_serializer=lambda m: m,
                              response_deserializer=pb.GetWatermarkResponse.FromString)
    feeds = [Silent(), Silent()]
    held = [started(follow(v6)) for _ in range(3)] + [silent.future(iter(f)) for f in feeds]
    try:
        wait_for(lambda: _refused(v6.GetWatermark.future(pb.GetWatermarkRequest(), timeout=5)), 5,
                 "the unary slots to be taken")
        began = time.monotonic()
        # In waves of 10 calls at once: 60 at once (with the 5 held) would pass gRPC's own
        # flood guard (2 x (3 + 2 + 8) calls) whenever the refusals are slow to complete, on a
        # loaded machine, and that guard's message names no limit.
        answers = []
        for wave in range(6):
            calls = ([v6.GetWatermark.future(pb.GetWatermarkRequest(), timeout=10) for _ in range(10)]
                     if wave < 3 else [follow(v6) for _ in range(10)])
            answers += [_refused(call) for call in calls]
        took = time.monotonic() - began
        assert all(answers), [a for a in answers if not a][:3]
        assert all("--max-client-calls=2" in a for a in answers[:30])
        assert all("--max-client-streams=3" in a for a in answers[30:])
        assert took < 5, f"60 refusals took {took:.1f} s"
        assert all(call.running() if hasattr(call, "running") else call.is_active() for call in held)
    finally:
        for f in feeds:
            f.release.set()
        for call in held:
            call.cancel()
        ch6.close()


def _refused(call: Any) -> str:
    """The details of a RESOURCE_EXHAUSTED refusal of ``call`` ('' if it was not one)."""
    try:
        if hasattr(call, "result"):
            call.result()
        else:
            for _ in call:
                pass
    except grpc.RpcError as exc:
        return (exc.details() or "") if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED else ""
    return ""
