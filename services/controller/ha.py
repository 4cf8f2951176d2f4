"""Controller replicas: what a controller does as the leader or as a standby.

Any number of controllers run over one store; :class:`services.controller.leader.Elector` makes
one of them the leader. Only the leader writes (registry, assignment, tokens, the
watermark reports of workers), each write fenced by its epoch
(:class:`services.controller.leader.LeaderStore`). A standby

* answers reads itself from the store: watermarks, state, keys, the registry
  (re-read when its version changes: checked every STANDBY_REFRESH_S, and before each
  DescribeComputation and ListComputations, so a client reads its own registration or
  update made through any controller), Subscribe;
* forwards public writes (register, unregister, Inject, dead-letter replay) and
  ClusterStatus (worker liveness is known to the leader alone) to the leader, with
  the cluster secret (else the process's client token), marked so a request is
  forwarded once at most (two controllers that each think the other leads cannot
  bounce it) and naming the client it is for, whose admission limits it counts
  against at the leader too (services/rpc/admission.py);
* refuses worker heartbeats with UNAVAILABLE and the leader's address in the
  ``millwheel-leader`` trailing metadata: workers go to the leader themselves.

On election the new leader reloads the registry and the assignment from the store and
gives the workers found there ``takeover_grace_s`` to heartbeat before declaring any
dead, so a leader change moves no range whose worker is alive.

:class:`Leadership` is the part that does it; whether this controller leads is
:meth:`services.controller.plane.ControlPlane.leading`.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
from typing import Any, Callable, Iterator, Protocol, TypeVar

import grpc

from ..generated import millwheel_pb2_grpc as pb_grpc
from ..rpc.admission import FORWARDED_FOR, client_key
from ..rpc.controller_link import LEADER_METADATA  # a refused heartbeat's pointer to the leader
from ..rpc.security import process
from ..rpc.server import channel, check
from ..rpc.status import NotLeaderError, UnavailableError
from .assign import Assigner
from .plane import ControlPlane
from .registry import REGISTRY_KEY, Registry

log = logging.getLogger("millwheel.controller")

FORWARDED_METADATA = "millwheel-forwarded"  # set on a request a standby forwards: never forwarded again
STANDBY_REFRESH_S = 0.5  # how often a standby re-reads the registry version and the assignment
TAKEOVER_READ_S = 10.0  # how long a new leader waits for the stored watermarks before it leads
FORWARD_KEEPALIVE_S = 2.0  # a forward to a leader that stops answering pings fails after ~2x this


class RemoteError(UnavailableError):
    """The leader's answer to a forwarded request, passed on with the leader's status."""

    def __init__(self, message: str, status: grpc.StatusCode) -> None:
        super().__init__(message)
        self.status = status


F = TypeVar("F", bound=Callable[..., Any])


class _Servicer(Protocol):
    leadership: Leadership


def leader_only(fn: F) -> F:
    """A public write RPC of a servicer holding ``leadership``: run by the leader; a
    standby forwards the call (a well-formed request, by the method's name) and passes
    the leader's answer back."""

    @functools.wraps(fn)
    def wrapper(self: _Servicer, request: Any, context: grpc.ServicerContext) -> Any:
        if not self.leadership.plane.leading():
            check(request)
            return self.leadership.forward(fn.__name__, request, context)
        return fn(self, request, context)

    return wrapper  # type: ignore[return-value]


class Leadership:
    """Leader or standby: taking over when elected, the standby's view, forwarding to
    the leader. It binds itself to the plane's elector at construction (the elector calls
    :meth:`elected` and :meth:`deposed` from its thread). ``finish_interrupted``: run on
    election before anything is assigned, with the registry as stored (a rescale cut
    short is finished or undone: services/controller/rescale.py)."""

    def __init__(self, plane: ControlPlane, finish_interrupted: Callable[[Registry], None]) -> None:
        self.plane = plane
        self._finish_interrupted = finish_interrupted
        self._view_at = 0.0
        self._view_lock = threading.Lock()  # standby passes one at a time: the view kept is the last read
        self._leaderless_since: float | None = None
        self._leader_channels: dict[str, grpc.Channel] = {}
        self._forwards: dict[int, tuple[str, Any]] = {}  # forwarded calls in flight: (their leader, the call)
        self._forwards_lock = threading.Lock()
        plane.elector.on_elected = self.elected
        plane.elector.on_deposed = self.deposed

    def readiness_problem(self) -> str:
        """'' while this controller can serve a request (it leads, or it knows the
        leader to forward to); else, after two lease TTLs without a leader, why not."""
        elector = self.plane.elector
        if self.plane.leading() or elector.leader_address:
            self._leaderless_since = None
            return ""
        now = time.monotonic()
        self._leaderless_since = self._leaderless_since or now
        if now - self._leaderless_since > 2 * elector.ttl_s:
            return f"no controller has led for {now - self._leaderless_since:.0f} s"
        return ""

    def close(self) -> None:
        for ch in self._leader_channels.values():
            ch.close()

    # -- role changes (called by the elector's thread) --------------------------------
    def elected(self, epoch: int) -> None:
        """Take over: the registry and the assignment as stored, workers given a grace."""
        p = self.plane
        started = time.monotonic()
        # Read outside the lock (a standby's queries go on meanwhile); the moves it
        # decides run off the lock too (services/controller/assign.py).
        registry = Registry(p.store, p.allow_code)
        self._finish_interrupted(registry)  # a rescale cut short: one layout, before any assignment
        timeouts = p.timeouts
        assigner = Assigner(p.store, timeouts.heartbeat_s,
                            grace_s=max(timeouts.takeover_grace_s, timeouts.heartbeat_s),
                            work=p.work, lock=p.lock)
        p.wms.refresh_now(registry.nodes(), TAKEOVER_READ_S)  # serve nothing below the store
        with p.lock:
            p.registry, p.assigner = registry, assigner
            p.registry_changed()  # units for every registered node; moves only orphans
            p.led_epoch = epoch
        log.info("leader %s (epoch %d) took over in %.3f s: registry version %d, %d ranges, "
                    "%d known workers", p.address, epoch, time.monotonic() - started,
                    p.registry.version, len(p.assigner.units), len(p.assigner.workers))

    def deposed(self) -> None:
        self.plane.led_epoch = None
        self._view_at = 0.0  # re-read the store's view at the next standby pass

    def fresh_view(self) -> bool:
        """A read on a standby named something its view lacks: re-read the store's view
        now, since a registration made through the leader reaches a standby's periodic
        pass up to STANDBY_REFRESH_S later. True if the view was re-read (worth looking
        again); False on the leader, whose view is the truth."""
        if self.plane.leading():
            return False
        self.standby_pass(force=True)
        return True

    def current_view(self) -> None:
        """Before a read answered from the registry (DescribeComputation,
        ListComputations): on a standby, the registry the store holds now rather than
        the view of up to STANDBY_REFRESH_S ago, so a client that just registered or
        updated through any controller reads its own write here (issue 34). One
        metadata read compares the stored version with the view's; the view is re-read
        only when it moved. The leader's view is the truth: nothing to do."""
        p = self.plane
        if p.leading():
            return
        raw = p.store.get_meta(REGISTRY_KEY)  # None: a store of an older layout, left to the passes
        if raw is not None and _stored_version(raw, p.registry) != p.registry.version:
            self.standby_pass(force=True)

    def standby_pass(self, force: bool = False) -> None:
        """A standby's view: the registry when its version changed, and the assignment
        (read only, for status and the console), every STANDBY_REFRESH_S; ``force``:
        now. Passes run one at a time, so a pass that read the store earlier never
        replaces the view of one that read it later."""
        p = self.plane
        with self._view_lock:
            now = time.monotonic()
            if not force and now - self._view_at < STANDBY_REFRESH_S:
                return
            self._view_at = now
            version = _stored_version(p.store.get_meta(REGISTRY_KEY), p.registry)
            registry = Registry(p.store, p.allow_code) if version != p.registry.version else None
            view = Assigner(p.store, p.timeouts.heartbeat_s, check_tokens=False)
            with p.lock:
                if p.elector.epoch is not None:  # elected meanwhile: the takeover loads its own
                    return
                if registry is not None:
                    p.registry = registry
                for w in view.workers.values():
                    w.alive = False  # unknown here: heartbeats go to the leader
                p.assigner = view

    # -- answering for the leader --------------------------------------------------------
    def _not_leader(self) -> str:
        address, leader = self.plane.address, self.plane.elector.leader_address
        if leader and leader != address:
            return f"controller {address} is a standby; the leader is {leader}"
        return f"controller {address} is a standby and no leader is elected yet; retry shortly"

    def redirect(self, context: grpc.ServicerContext) -> NotLeaderError:
        """Refuse a worker's call: UNAVAILABLE (raise what this returns), with where the
        leader is in the trailing metadata."""
        leader = self.plane.elector.leader_address
        if leader and leader != self.plane.address:
            context.set_trailing_metadata(((LEADER_METADATA, leader),))
        return NotLeaderError(self._not_leader())

    def _leader_stub(self, context: grpc.ServicerContext) -> tuple[str, pb_grpc.ControllerStub]:
        if any(k == FORWARDED_METADATA for k, _v in context.invocation_metadata()):
            raise NotLeaderError(f"{self._not_leader()} (a forwarded request is not forwarded again)")
        leader = self.plane.elector.leader_address
        if not leader or leader == self.plane.address:
            raise NotLeaderError(self._not_leader())
        ch = self._leader_channels.get(leader)
        if ch is None:
            sec = process()
            ch = self._leader_channels[leader] = channel(leader, sec, sec.cluster_secret or sec.client_token,
                                                         keepalive_s=FORWARD_KEEPALIVE_S)
        return leader, pb_grpc.ControllerStub(ch)

    def forward(self, method: str, request: Any, context: grpc.ServicerContext) -> Any:
        """Forward a unary call to the leader and pass its answer (or status) back."""
        leader, stub = self._leader_stub(context)
        remaining = context.time_remaining()
        call = getattr(stub, method).future(request, timeout=min(remaining or 120.0, 120.0),
                                            metadata=_forwarded(self.plane.address, context))
        return self._forwarded(leader, call, context)

    def forward_stream(self, method: str, requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
        """Forward a client-streaming call (Inject) to the leader, message by message as
        they arrive; its trailing metadata (backpressure hints) comes back too."""
        leader, stub = self._leader_stub(context)
        call = getattr(stub, method).future(requests, metadata=_forwarded(self.plane.address, context))
        return self._forwarded(leader, call, context)

    def _forwarded(self, leader: str, call: Any, context: grpc.ServicerContext) -> Any:
        """Wait for a forwarded call. It is cancelled when its caller goes away, and when
        ``leader`` stops being the leader (:meth:`cancel_stale_forwards`): a partitioned
        leader sends no reset, so nothing else would end it before the partition heals."""
        with self._forwards_lock:
            self._forwards[id(call)] = (leader, call)
        context.add_callback(call.cancel)
        try:
            return call.result()
        except grpc.FutureCancelledError:
            raise NotLeaderError(f"the request was forwarded to {leader}, which stopped leading "
                                 "meanwhile; send it again (to the new leader)") from None
        except grpc.RpcError as exc:
            raise self._remote(exc, context) from None
        finally:
            with self._forwards_lock:
                self._forwards.pop(id(call), None)

    def cancel_stale_forwards(self) -> None:
        """Cancel the forwarded calls whose leader no longer leads (called every reaper pass)."""
        leader = self.plane.elector.leader_address
        with self._forwards_lock:
            stale = [call for target, call in self._forwards.values() if target != leader]
        for call in stale:
            call.cancel()

    def _remote(self, exc: grpc.RpcError, context: grpc.ServicerContext) -> RemoteError:
        trailing = exc.trailing_metadata()
        if trailing:
            context.set_trailing_metadata(tuple((m.key, m.value) for m in trailing))
        code = exc.code()
        details = exc.details() or code.name
        if code == grpc.StatusCode.UNAVAILABLE:
            details = f"leader {self.plane.elector.leader_address}: {details}"
        return RemoteError(details, code)


def _stored_version(raw: bytes | None, registry: Registry) -> int:
    """The version of the registry as stored, from its head entry ``raw`` (0: none
    stored). With no head, a view read from an older layout is what the store holds:
    only a change writes the head (services/controller/registry.py)."""
    if raw is None:
        return registry.version if registry.older_layout else 0
    return int(json.loads(raw)["version"])


def _forwarded(address: str, context: grpc.ServicerContext) -> tuple[tuple[str, str], ...]:
    """The metadata of a forwarded request: by whom (never forwarded again), for whom."""
    return ((FORWARDED_METADATA, address), (FORWARDED_FOR, client_key(context)))
