"""The caller's side of several controllers: which one to talk to, and when to switch.

Every process that calls a controller (the Python client and the CLI, a worker, its
watchdog) is given a list of controller addresses, ``a:7070,b:7070``, and holds a
:class:`ControllerLink` over it: one channel per address (opened on first use), the
*current* address, and the failover rule, the same everywhere:

* a call to the current controller fails with UNAVAILABLE (killed, restarting, or a
  standby refusing what only the leader serves) or DEADLINE_EXCEEDED (stopped, or cut
  off): switch;
* to the leader the failed controller named in its ``millwheel-leader`` trailing
  metadata, when it named one (even an address not in the list: the list is where to
  start, the leader is where to go);
* else to the next address in the list, in order, wrapping around;
* every full cycle of failures without a success waits before going on (0.05 s,
  doubling to 1 s, jittered) so that callers of a cluster that is down poll it gently
  and do not all retry in step.

The link knows nothing of the stub or the call: it hands out the channel (or a stub of
any kind) of the current address, and the caller reports a failure (:meth:`failover`)
or a success (:meth:`succeeded`). It is thread-safe: when several threads fail on the
same controller at once, only the first switch counts.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from typing import Any, Callable, TypeVar, cast

import grpc

from millwheel.errors import InvalidSpecError

from .security import Security
from .server import channel

log = logging.getLogger("millwheel.controller_link")
S = TypeVar("S")

#: The status codes that mean "this controller cannot serve us now; try another".
FAILOVER_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
#: Trailing metadata of a standby's refusal: where the leader is (host:port).
LEADER_METADATA = "millwheel-leader"
#: How long a heartbeat, or the start of any call, may take before the caller moves on
#: when there is somewhere to move to (a stopped controller answers nothing, ever).
SEVERAL_DEADLINE_S = 1.5
SINGLE_DEADLINE_S = 5.0
#: Calls on a link's channels are pinged this often and fail (UNAVAILABLE, so the caller
#: fails over) when a ping goes unanswered as long: a SIGSTOPped or cut-off controller
#: sends no reset, and a follow-mode Subscribe or a worker's heartbeat stream to it
#: would otherwise wait forever. (Controllers accept pings every 1 s: services/rpc/server.py.)
LINK_KEEPALIVE_S = 3.0
FIRST_BACKOFF_S, MAX_BACKOFF_S = 0.05, 1.0


class AddressListError(InvalidSpecError):
    """A controller address list with an entry that is not ``HOST:PORT``."""


def parse_address(entry: str) -> str:
    """One ``HOST:PORT`` (``[v6]:PORT`` for IPv6), stripped; AddressListError if not."""
    entry = entry.strip()
    host, sep, port = entry.rpartition(":")
    if not sep or not host or not port:
        raise AddressListError(f"controller address {entry!r} is not HOST:PORT")
    if host.startswith("[") != host.endswith("]") or (":" in host and not host.startswith("[")):
        raise AddressListError(f"controller address {entry!r}: write an IPv6 host in brackets, "
                               "[::1]:7070")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise AddressListError(f"controller address {entry!r}: port {port!r} is not a number "
                               "from 1 to 65535")
    return entry


def parse_addresses(text: str) -> list[str]:
    """The addresses of a comma-separated list (``--controller``,
    ``$MILLWHEEL_CONTROLLER``), in order and without repeats. An empty entry or one that
    is not ``HOST:PORT`` is an :class:`AddressListError` naming it and the list."""
    entries = text.split(",")
    addresses: list[str] = []
    for n, entry in enumerate(entries, 1):
        if not entry.strip():
            raise AddressListError(f"controller address list {text!r}: entry {n} of "
                                   f"{len(entries)} is empty")
        try:
            address = parse_address(entry)
        except AddressListError as exc:
            raise AddressListError(f"controller address list {text!r}: entry {n}: {exc}") from None
        if address not in addresses:
            addresses.append(address)
    return addresses


def leader_hint(exc: grpc.RpcError) -> str | None:
    """The leader a refusing standby named (``millwheel-leader``), or None."""
    try:
        metadata: Any = exc.trailing_metadata() or ()
    except Exception:  # noqa: BLE001 - an error that is not a finished call has none
        return None
    for key, value in metadata:
        if key == LEADER_METADATA and isinstance(value, str):
            try:
                return parse_address(value)
            except AddressListError:
                log.warning("ignoring a malformed %s hint %r", LEADER_METADATA, value)
    return None


def fails_over(exc: BaseException) -> bool:
    """Whether a failed call is one another controller may serve."""
    return isinstance(exc, grpc.RpcError) and exc.code() in FAILOVER_CODES


class ControllerLink:
    """Channels to a list of controllers and the current one (see the module docstring).

    ``security``/``token`` are passed to :func:`services.rpc.server.channel` as they
    are: None for a cluster member's internal channel (the process's TLS and cluster
    secret), a client's own settings and token otherwise."""

    def __init__(self, addresses: str | list[str], security: Security | None = None,
                 token: str | None = None, *, first_backoff_s: float = FIRST_BACKOFF_S,
                 max_backoff_s: float = MAX_BACKOFF_S) -> None:
        self.addresses = parse_addresses(addresses) if isinstance(addresses, str) \
            else parse_addresses(",".join(addresses))
        self.security = security
        self.token = token
        self.first_backoff_s = first_backoff_s
        self.max_backoff_s = max_backoff_s
        self._lock = threading.Lock()
        self._current = self.addresses[0]
        self._index = 0  # the list position last used (a leader hint does not move it)
        self._failures = 0  # since the last success or the last back-off
        self._since_success = 0  # failures since the last success (the first is logged)
        self._backoff_s = first_backoff_s
        self._channels: dict[str, grpc.Channel] = {}
        self._stubs: dict[tuple[Any, str], Any] = {}

    @property
    def several(self) -> bool:
        """More than one controller is known: a call that hangs is worth cutting short."""
        return len(self.addresses) > 1

    @property
    def deadline_s(self) -> float:
        """The deadline of a short call (a heartbeat): short enough, with several
        controllers, to leave a stopped one within a couple of heartbeat timeouts."""
        return SEVERAL_DEADLINE_S if self.several else SINGLE_DEADLINE_S

    @property
    def current(self) -> str:
        with self._lock:
            return self._current

    def channel(self, address: str | None = None) -> grpc.Channel:
        """The channel of ``address`` (default: the current one), opened on first use."""
        with self._lock:
            address = address or self._current
            ch = self._channels.get(address)
            if ch is None:
                ch = self._channels[address] = channel(address, self.security, self.token,
                                                       keepalive_s=LINK_KEEPALIVE_S)
            return ch

    def stub(self, factory: Callable[[grpc.Channel], S], address: str | None = None) -> S:
        """A stub made by ``factory`` (e.g. ``ClusterStub``) on ``address``'s channel
        (default: the current one), made once per address."""
        address = address or self.current
        key = (factory, address)
        with self._lock:
            found = self._stubs.get(key)
        if found is None:
            found = self._stubs.setdefault(key, factory(self.channel(address)))
        return cast(S, found)

    def may_fail_over(self, failed: str, hint: str | None) -> bool:
        """Whether there is anywhere to go from ``failed``: a leader hint, or another
        address in the list. (One address and no hint: the caller fails as it always did.)"""
        return (hint is not None and hint != failed) or any(a != failed for a in self.addresses)

    def choose(self, failed: str, hint: str | None = None) -> tuple[str, float]:
        """Make the next controller current after ``failed`` failed, and say how long to
        wait before calling it (0 unless a full cycle has failed). A failure of an
        address that is no longer current (another thread moved on) changes nothing."""
        with self._lock:
            if failed != self._current:
                return self._current, 0.0
            if hint is not None and hint != failed:
                new = hint
                if hint in self.addresses:
                    self._index = self.addresses.index(hint)
            else:
                self._index = (self._index + 1) % len(self.addresses)
                new = self.addresses[self._index]
            self._current = new
            self._failures += 1
            wait = 0.0
            if self._failures >= len(self.addresses):  # a full cycle without a success
                wait = self._backoff_s * random.uniform(0.5, 1.0)
                self._backoff_s = min(self.max_backoff_s, self._backoff_s * 2)
                self._failures = 0
            self._since_success += 1
            first = self._since_success == 1
        (log.info if first else log.debug)(
            "controller %s failed; trying %s%s", failed, new,
            " (the leader it named)" if new == hint else f" in {wait:.2f} s" if wait else "")
        return new, wait

    def failover(self, failed: str, hint: str | None = None) -> str:
        """:meth:`choose`, waiting as it says; returns the new current address."""
        new, wait = self.choose(failed, hint)
        if wait > 0:
            time.sleep(wait)
        return new

    def failover_from(self, failed: str, exc: grpc.RpcError) -> str:
        """:meth:`failover` after ``exc``, following its leader hint if any."""
        return self.failover(failed, leader_hint(exc))

    def succeeded(self, address: str) -> None:
        """A call to ``address`` worked: the next failure starts a fresh cycle."""
        with self._lock:
            if address == self._current:
                self._failures = self._since_success = 0
                self._backoff_s = self.first_backoff_s

    def close(self) -> None:
        with self._lock:
            channels, self._channels, self._stubs = list(self._channels.values()), {}, {}
        for ch in channels:
            ch.close()


class Tried:
    """The controllers one call tried, how each failed, and when to stop trying
    (``window_s`` after the first failure): what a caller that gives up reports."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.deadline: float | None = None
        self.failures: dict[str, str] = {}

    def add(self, address: str, exc: grpc.RpcError) -> None:
        self.failures.pop(address, None)  # keep the order of the last failures
        self.failures[address] = f"{exc.code().name}: {exc.details()}"
        if self.deadline is None:
            self.deadline = time.monotonic() + self.window_s

    def left(self) -> float:
        return max(0.0, (self.deadline or 0.0) - time.monotonic())

    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline

    def describe(self, addresses: list[str]) -> str:
        return (f"no controller of {','.join(addresses)} served the call within {self.window_s:g} s: "
                + "; ".join(f"{a} ({why})" for a, why in self.failures.items()))


class NoAnswer(grpc.RpcError):
    """A call whose controller did not even start it in time (a stopped process: the
    kernel accepts the connection, nobody reads it). Cancelled by the caller and
    handled as DEADLINE_EXCEEDED: the call never ran, so going elsewhere is safe."""

    def __init__(self, address: str, within_s: float) -> None:
        super().__init__()
        self._details = f"controller {address} did not answer within {within_s:g} s"

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[()]:
        return ()

    def __str__(self) -> str:
        return self._details


def await_start(call: Any, address: str, within_s: float) -> None:
    """Wait until ``call`` (a future or a streaming call) has its initial metadata (every
    millwheel server sends it first thing, before any work) or has ended; if neither
    happens within ``within_s`` the call is cancelled and :class:`NoAnswer` raised."""
    lock = threading.Lock()
    state = {"answered": False, "expired": False}

    def expire() -> None:
        with lock:
            if not state["answered"]:
                state["expired"] = True
                call.cancel()

    timer = threading.Timer(within_s, expire)
    timer.daemon = True
    timer.start()
    try:
        call.initial_metadata()  # returns at the metadata, or when the call ends (cancelled too)
    finally:
        with lock:
            state["answered"] = True
        timer.cancel()
    if state["expired"]:
        raise NoAnswer(address, within_s)
