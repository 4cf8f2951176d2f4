"""The controller's two listeners: the client port and the cluster port.

Client calls (Inject, Subscribe, queries, registration) hold a pool thread each for as
long as they last; before, heartbeats shared that pool, so one client holding enough
streams got every worker declared dead. Now the ``Cluster`` service (heartbeats: how
workers join, stay alive, report watermarks and learn their key ranges) also has a
server of its own, the **cluster port** (``--cluster-port``; default: any free port),
with its own threads, serving nothing else (no health, no reflection: a client cannot
hold its threads with a stream), under the same tokens and TLS as the client port.

Workers need no new flag: they are given the client address as before; every
heartbeat answer (:class:`ClusterServicer`) names the cluster address, and they send
the next ones there (services/rpc/cluster_routes.py). The client port keeps serving
``Cluster`` for that first contact (outside client admission: cluster members only).
A standby refuses heartbeats on either port naming the leader's client address; the
worker goes there and learns the leader's cluster address from its answer.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any, Protocol

import grpc

from ..generated import millwheel_pb2 as pb
from ..rpc.admission import Admission, AdmissionLimits
from ..rpc.security import process
from ..rpc.server import ListenError, start_server

#: Threads of the cluster port: heartbeats are short and serialised on the controller's
#: lock, so more threads would only queue there; a worker has one heartbeat in flight
#: (and its watchdog one more).
CLUSTER_THREADS = 16


class HeartbeatHandler(Protocol):
    def Heartbeat(self, request: Any, context: grpc.ServicerContext) -> pb.HeartbeatResponse: ...


class ClusterServicer:
    """The Cluster service: the controller's Heartbeat, whose answer names the cluster
    address (where the next heartbeat should go)."""

    def __init__(self, controller: HeartbeatHandler, cluster_address: str) -> None:
        self.controller = controller
        self.cluster_address = cluster_address

    def Heartbeat(self, request: Any, context: grpc.ServicerContext) -> pb.HeartbeatResponse:
        resp = self.controller.Heartbeat(request, context)
        resp.cluster_address = self.cluster_address
        return resp


def advertised_host(host: str, advertise: str | None) -> str:
    """The host the others reach this controller at: ``advertise``, else ``host``, else
    (listening on every interface) this machine's name."""
    if advertise is not None:
        return advertise
    return socket.getfqdn() if host in ("0.0.0.0", "::", "") else host


def start_servers(controller: HeartbeatHandler, services: dict[str, Any], host: str, port: int,
                  cluster_port: int, advertise: str, limits: AdmissionLimits,
                  on_refused: Callable[[str, str], None] | None = None,
                  ) -> tuple[grpc.Server, int, int, Any]:
    """Start the cluster port, then the client port (``services`` plus Cluster, under
    ``limits``). Returns (client server, client port, cluster port, health); stopping
    the client server stops the cluster server too."""
    cluster = ClusterServicer(controller, "")  # its address once the port is bound
    try:
        cluster_server, cluster_bound, _ = start_server(
            f"{host}:{cluster_port}", {"Cluster": cluster}, max_workers=CLUSTER_THREADS,
            probes=False, pool_name="cluster")
    except ListenError as exc:
        raise ListenError(f"{exc} (--cluster-port)") from None
    cluster.cluster_address = f"{advertise}:{cluster_bound}"
    admission = Admission(limits, process().cluster_secret, on_refused)
    try:
        server, bound, health = start_server(
            f"{host}:{port}", {**services, "Cluster": cluster}, admission=admission, pool_name="client")
    except BaseException:
        cluster_server.stop(None)
        admission.close()
        raise
    stop = server.stop

    def stop_both(grace: float | None) -> Any:
        admission.close()
        cluster_server.stop(grace)
        return stop(grace)

    server.stop = stop_both  # type: ignore[method-assign]
    return server, bound, cluster_bound, health
