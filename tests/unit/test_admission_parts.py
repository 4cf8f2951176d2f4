"""The parts of client admission and heartbeat routing that need no network: who a
client is, which limits are accepted, and where a worker sends its next heartbeat."""

from __future__ import annotations

import pytest

from millwheel.errors import InvalidSpecError
from services.rpc.admission import RESERVE_THREADS, AdmissionLimits, peer_host
from services.rpc.cluster_routes import ClusterRoutes


@pytest.mark.parametrize(("peer", "host"), [
    ("ipv4:10.0.0.7:51234", "10.0.0.7"),
    ("ipv6:%5B::1%5D:37470", "::1"),
    ("ipv6:[fe80::1%25eth0]:5", "fe80::1%eth0"),
    ("unix:/tmp/sock", "unix"),
    ("", ""),
])
def test_a_client_is_its_host(peer: str, host: str) -> None:
    assert peer_host(peer) == host


def test_limits_are_checked_and_size_the_pool() -> None:
    limits = AdmissionLimits(client_streams=4, client_calls=2, streams=10, calls=5)
    limits.check()
    assert limits.threads == 10 + 5 + RESERVE_THREADS
    for bad, flag in ((AdmissionLimits(client_streams=0), "--max-client-streams"),
                      (AdmissionLimits(streams=10**6), "--max-streams"),
                      (AdmissionLimits(client_calls=65, calls=64), "cannot exceed its total"),
                      (AdmissionLimits(idle_s=float("nan")), "--stream-idle-timeout"),
                      (AdmissionLimits(idle_s=0), "--stream-idle-timeout")):
        with pytest.raises(InvalidSpecError, match=flag):
            bad.check()


def test_heartbeats_follow_the_cluster_address_a_controller_names() -> None:
    routes = ClusterRoutes()
    assert routes.target("a:7070") == "a:7070"  # first contact: the client address
    routes.answered("a:7070", "a:7070", "a:7090")
    assert routes.target("a:7070") == "a:7090"
    routes.answered("a:7070", "a:7090", "")  # a controller without a cluster port
    assert routes.target("a:7070") == "a:7070"


def test_a_failed_cluster_address_is_relearned_then_avoided_after_two_failures() -> None:
    routes = ClusterRoutes()
    routes.answered("a:7070", "a:7070", "a:7090")
    routes.failed("a:7070", "a:7090")  # e.g. the controller restarted: ask it again
    assert routes.target("a:7070") == "a:7070"
    routes.answered("a:7070", "a:7070", "a:7090")
    assert routes.target("a:7070") == "a:7090"
    routes.failed("a:7070", "a:7090")  # twice in a row: a firewall, say
    routes.answered("a:7070", "a:7070", "a:7090")
    assert routes.target("a:7070") == "a:7070"  # heartbeats stay on the client port
    routes.answered("b:7070", "b:7070", "b:7090")  # other controllers are not affected
    assert routes.target("b:7070") == "b:7090"


def test_a_success_on_the_cluster_address_clears_its_failures() -> None:
    routes = ClusterRoutes()
    routes.answered("a:7070", "a:7070", "a:7090")
    routes.failed("a:7070", "a:7090")
    routes.answered("a:7070", "a:7070", "a:7090")
    routes.answered("a:7070", "a:7090", "a:7090")  # it works again
    routes.failed("a:7070", "a:7090")
    routes.answered("a:7070", "a:7070", "a:7090")
    assert routes.target("a:7070") == "a:7090"  # one failure since the success: still used
