"""The controller address list and the failover rule (no network: channels open lazily)."""

from __future__ import annotations

import threading

import grpc
import pytest

from millwheel.errors import InvalidSpecError
from services.rpc.controller_link import (
    AddressListError,
    ControllerLink,
    NoAnswer,
    fails_over,
    leader_hint,
    parse_addresses,
)


@pytest.mark.parametrize("text,addresses", [
    ("127.0.0.1:7070", ["127.0.0.1:7070"]),
    ("a:7070,b:7071", ["a:7070", "b:7071"]),
    (" a:7070 , b:7071 ", ["a:7070", "b:7071"]),
    ("ctl-0.ctl.svc:7070,[::1]:7070", ["ctl-0.ctl.svc:7070", "[::1]:7070"]),
    ("a:7070,b:7070,a:7070", ["a:7070", "b:7070"]),  # a repeat is tried once per cycle
])
def test_good_lists_parse_in_order(text: str, addresses: list[str]) -> None:
    assert parse_addresses(text) == addresses


@pytest.mark.parametrize("text,says", [
    ("a:7070,,b:7070", "entry 2 of 3 is empty"),
    ("a:7070,", "entry 2 of 2 is empty"),
    ("", "entry 1 of 1 is empty"),
    ("a:7070,localhost", "entry 2: controller address 'localhost' is not HOST:PORT"),
    ("a:7070,b:http", "entry 2: controller address 'b:http': port 'http' is not a number"),
    ("b:99999", "entry 1: controller address 'b:99999': port '99999' is not a number from 1 to 65535"),
    ("b:0", "port '0'"),
    (":7070", "':7070' is not HOST:PORT"),
    ("::1:7070", "write an IPv6 host in brackets"),
])
def test_bad_lists_name_the_entry(text: str, says: str) -> None:
    with pytest.raises(AddressListError) as info:
        parse_addresses(text)
    assert says in str(info.value)
    assert repr(text) in str(info.value)  # and the whole list, as given
    assert isinstance(info.value, InvalidSpecError)  # the CLI's "bad input" class: exit 2


def test_next_address_in_order_wrapping_around() -> None:
    link = ControllerLink("a:1,b:1,c:1", first_backoff_s=0, max_backoff_s=0)
    assert link.current == "a:1"
    assert [link.failover(x) for x in ("a:1", "b:1", "c:1", "a:1")] == ["b:1", "c:1", "a:1", "b:1"]


def test_leader_hint_wins_even_outside_the_list_and_the_list_order_resumes_after() -> None:
    link = ControllerLink("a:1,b:1,c:1", first_backoff_s=0, max_backoff_s=0)
    assert link.failover("a:1", hint="c:1") == "c:1"  # a listed leader: the order goes on from it
    assert link.failover("c:1") == "a:1"
    assert link.failover("a:1", hint="z:9") == "z:9"  # unlisted: used, the list position kept
    assert link.failover("z:9") == "b:1"
    assert link.failover("b:1", hint="b:1") == "c:1"  # a controller naming itself is no hint


def test_a_failure_of_a_controller_no_longer_current_changes_nothing() -> None:
    link = ControllerLink("a:1,b:1,c:1", first_backoff_s=0, max_backoff_s=0)
    assert link.failover("a:1") == "b:1"
    assert link.failover("a:1") == "b:1"  # a second thread's late report of the same failure


def test_concurrent_failures_of_one_controller_switch_once() -> None:
    link = ControllerLink("a:1,b:1,c:1,d:1", first_backoff_s=0, max_backoff_s=0)
    barrier = threading.Barrier(8)
    results: list[str] = []

    def fail() -> None:
        barrier.wait()
        results.append(link.failover("a:1"))

    threads = [threading.Thread(target=fail) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == ["b:1"] * 8 and link.current == "b:1"


def test_every_failed_cycle_backs_off_growing_to_the_cap_and_a_success_resets() -> None:
    link = ControllerLink("a:1,b:1", first_backoff_s=0.05, max_backoff_s=1.0)
    waits = []
    for _ in range(14):
        _, wait = link.choose(link.current)
        waits.append(wait)
    assert waits[0::2] == [0.0] * 7  # within a cycle: no wait
    cycle_waits = waits[1::2]
    caps = [0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    assert all(c * 0.5 <= w <= c for w, c in zip(cycle_waits, caps, strict=True)), cycle_waits
    link.succeeded(link.current)
    assert link.choose(link.current)[1] == 0.0
    assert 0.025 <= link.choose(link.current)[1] <= 0.05  # back to the first back-off


def test_only_a_list_or_a_hint_gives_somewhere_to_go() -> None:
    one = ControllerLink("a:1")
    assert not one.may_fail_over("a:1", None)  # one address, no hint: fail as before
    assert one.may_fail_over("a:1", "b:1")
    assert one.deadline_s == 5.0 and not one.several
    two = ControllerLink("a:1,b:1")
    assert two.may_fail_over("a:1", None) and two.deadline_s == 1.5


class _Refusal(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, metadata: tuple[tuple[str, str], ...]) -> None:
        self._code, self._metadata = code, metadata

    def code(self) -> grpc.StatusCode:
        return self._code

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata


def test_the_leader_hint_is_read_from_trailing_metadata_and_checked() -> None:
    standby = _Refusal(grpc.StatusCode.UNAVAILABLE, (("millwheel-leader", "10.0.0.1:7070"),))
    assert leader_hint(standby) == "10.0.0.1:7070" and fails_over(standby)
    assert leader_hint(_Refusal(grpc.StatusCode.UNAVAILABLE, ())) is None  # no leader known yet
    assert leader_hint(_Refusal(grpc.StatusCode.UNAVAILABLE, (("millwheel-leader", "nonsense"),))) is None
    assert fails_over(NoAnswer("a:1", 1.5))
    assert not fails_over(_Refusal(grpc.StatusCode.NOT_FOUND, ()))
    assert not fails_over(_Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, ()))
