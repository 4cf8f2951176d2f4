"""The worker process: owns key ranges and moves records between them.

Three loops share the owned ranges (each range's lock serialises them):

* heartbeat (every ``heartbeat_s``): report each owned range's low watermark with its
  token; receive every range's owner and token, the registry and input watermarks;
  take new ranges (a :class:`~millwheel.runtime.range_worker.RangeWorker` built with
  the controller's token) and drop ranges that moved;
* pump: fire due timers, and send each range's outbox in slices: sink streams go to
  the stream log, consumer ranges owned here are processed in place, others go to
  their owner over a :class:`~services.worker_link.PeerLink`; entries are deleted
  (``outbox.ack``) only once the consumer has checkpointed them;
* the Deliver servicer: dedup, run user code and checkpoint a received batch, then
  ack it (the exactly-once sequence of ``millwheel.runtime.range_worker``).

A :class:`~millwheel.errors.FencedError` anywhere means the range moved: drop it.
SIGTERM drains: the controller moves every range away, then the process exits.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import OrderedDict, defaultdict
from dataclasses import dataclass
from typing import Any, Iterator

import grpc

from millwheel.clock import SystemClock
from millwheel.errors import FencedError, UserCodeError
from millwheel.importing import AllowList
from millwheel.keys import key_range
from millwheel.operators import build_computation
from millwheel.record import MIN_TIMESTAMP, Record
from millwheel.runtime import poison
from millwheel.runtime.context import RangeTransaction
from millwheel.runtime.crash import crash_hook_from_env
from millwheel.runtime.range_worker import RangeWorker
from millwheel.runtime.routing import LOG_PREFIX, Router
from millwheel.state.protocol import Production
from millwheel.topology import Productions, Topology

from . import convert, overruns, watchdog
from .generated import millwheel_pb2 as pb
from .generated import millwheel_pb2_grpc as pb_grpc
from .grpc_server import Malformed, channel, start_server
from .health_monitor import HealthMonitor
from .metrics import PrometheusSensors
from .store_lock import open_service_store
from .worker_link import PeerLink
from .worker_progress import NoProgress, ProgressBlock
from .worker_units import OwnedRange, Slice

log = logging.getLogger("millwheel.worker")
Unit = tuple[str, int]


@dataclass(frozen=True)
class OwnerInfo:
    worker_id: str
    address: str
    token: int


class WorkerProcess:
    def __init__(
        self, controller: str, store_url: str, *, host: str = "127.0.0.1", port: int = 0,
        metrics_port: int | None = 0, worker_id: str | None = None, advertise: str | None = None,
        batch_size: int = 5000,
        max_inflight: int = 8, max_slices: int = 4, max_injector_outbox: int = 50_000,
        heartbeat_s: float = 0.1, delivery_timeout_s: float = 5.0, weak_wait_s: float = 1.0,
        min_heartbeat_s: float = 0.025, allow_code: str | None = None, use_watchdog: bool = True,
    ) -> None:
        self.allow_code = AllowList.parse(allow_code)
        self.store = open_service_store(store_url)
        self.sensors = PrometheusSensors("worker")
        self.clock = SystemClock()
        self.crash = crash_hook_from_env()
        self.batch_size = batch_size
        self.max_inflight = max_inflight
        self.max_slices = max_slices
        self.max_injector_outbox = max_injector_outbox
        self.weak_wait_s = weak_wait_s
        self.min_heartbeat_s = min(min_heartbeat_s, heartbeat_s)
        self._hb_wake = threading.Event()
        self._wake = threading.Event()
        self.heartbeat_s = heartbeat_s
        self.delivery_timeout_s = delivery_timeout_s
        self.topology = Topology()
        self.version = -1
        self.router = Router(self.topology)
        self.units: dict[Unit, OwnedRange] = {}
        self.owners: dict[Unit, OwnerInfo] = {}
        self.input_wms: dict[str, int] = {}
        self.links: dict[str, PeerLink] = {}
        self.draining = threading.Event()
        self.stopped = threading.Event()
        self._units_lock = threading.Lock()
        # (injector node, Inject session) -> last message accepted, for in-order injection
        self._inject_seqs: OrderedDict[tuple[str, str], int] = OrderedDict()
        # (node, range, token) rejected by the store: not taken again under that token, and
        # reported to the controller, which then issues a fresh one if it still means us.
        self._fenced_tokens: set[tuple[str, int, int]] = set()
        self._fenced_unreported: list[tuple[str, int, int]] = []
        self.server, self.port, self.health = start_server(
            f"{host}:{port}", {"Worker": DeliverServicer(self)})
        if advertise is None:
            advertise = socket.getfqdn() if host in ("0.0.0.0", "::", "") else host
        self.address = f"{advertise}:{self.port}"
        self.worker_id = worker_id or f"{self.address}/{os.getpid()}"
        self.metrics_port = self.sensors.serve(host, metrics_port) if metrics_port is not None else 0
        self.metrics_address = f"{advertise}:{self.metrics_port}" if self.metrics_port else ""
        self._controller_channel = channel(controller)
        self.controller = pb_grpc.ClusterStub(self._controller_channel)
        # User code runs under a deadline kept by a watchdog process (services/watchdog.py).
        self.progress = ProgressBlock() if use_watchdog else NoProgress()
        self.watchdog = watchdog.start(
            self.progress.fd, controller=controller, store_url=store_url, worker_id=self.worker_id,
            address=self.address, metrics_address=self.metrics_address, heartbeat_s=heartbeat_s,
        ) if isinstance(self.progress, ProgressBlock) else None
        self._hb_failing_since: float | None = None
        self.health_monitor = HealthMonitor(self.health, self.store, controller_failing_s=lambda: (
            0.0 if self._hb_failing_since is None else time.monotonic() - self._hb_failing_since))
        self._threads = [
            threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True),
            threading.Thread(target=self._pump_loop, name="pump", daemon=True),
        ]
        for t in self._threads:
            t.start()
        log.info("worker %s listening on %s (metrics %s)", self.worker_id, self.address,
                 self.metrics_address or "off")

    # -- lifecycle ---------------------------------------------------------------------
    def drain_and_stop(self, timeout_s: float = 15.0) -> None:
        """Graceful shutdown: ask the controller to move every range away, wait until
        none is left (or the timeout), then stop. Every checkpoint is already durable."""
        log.info("worker %s draining", self.worker_id)
        self.draining.set()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and (self.units or not self._drain_seen):
            time.sleep(0.05)
        self.stop()

    _drain_seen = False

    def stop(self) -> None:
        self.stopped.set()
        self.server.stop(grace=1.0).wait(2.0)
        for t in self._threads:
            t.join(timeout=2.0)
        for link in self.links.values():
            link.close()
        self._controller_channel.close()
        self.health_monitor.stop()
        if self.watchdog is not None:
            self.watchdog.stop()
        self.store.close()
        log.info("worker %s stopped", self.worker_id)

    # -- heartbeat ---------------------------------------------------------------------
    def _heartbeat_loop(self) -> None:
        """Heartbeat every ``heartbeat_s``, or sooner (at most every ``min_heartbeat_s``)
        when a watermark may have moved: an input watermark came in, an outbox drained,
        timers fired or an injector advanced. A watermark then crosses a stage in about
        a round trip to the controller rather than a heartbeat period."""
        last_error = 0.0
        while not self.stopped.is_set():
            self._hb_wake.wait(self.heartbeat_s)
            self._hb_wake.clear()
            started = time.monotonic()
            try:
                self._heartbeat_once()
                self.progress.heartbeat_ok()
                self._hb_failing_since = None
            except grpc.RpcError as exc:
                self._hb_failing_since = self._hb_failing_since or time.monotonic()
                if time.monotonic() - last_error > 5.0:
                    last_error = time.monotonic()
                    log.warning("heartbeat to controller failed: %s: %s; working on with "
                                "current ranges", exc.code().name, exc.details())
            except Exception:
                log.exception("heartbeat failed")
            self.stopped.wait(max(0.0, self.min_heartbeat_s - (time.monotonic() - started)))

    def _heartbeat_once(self) -> None:
        reports = []
        draining = self.draining.is_set()
        for owned in list(self.units.values()):
            wm = owned.report_nowait(self.input_wms.get(owned.node, MIN_TIMESTAMP))  # never waits
            if owned.dropped or wm is None:
                continue
            reports.append(pb.WatermarkReport(node=owned.node, range_id=owned.range_id,
                                              token=owned.token, watermark=wm,
                                              pending=len(owned.outbox) if owned.outbox is not None else 0))
        fenced, self._fenced_unreported = self._fenced_unreported, []
        reports += [pb.WatermarkReport(node=n, range_id=r, token=t, watermark=MIN_TIMESTAMP)
                    for n, r, t in fenced]
        resp = self.controller.Heartbeat(pb.HeartbeatRequest(
            worker_id=self.worker_id, address=self.address, metrics_address=self.metrics_address,
            draining=draining, known_topology_version=self.version, reports=reports), timeout=5.0)
        if draining:
            self._drain_seen = True
        self._apply(resp)

    def _apply(self, resp: pb.HeartbeatResponse) -> None:
        if resp.topology_json:
            self._set_topology(convert.topology_from_json(resp.topology_json), resp.topology_version)
        self.owners = {
            (a.node, a.range_id): OwnerInfo(a.worker_id, a.worker_address, a.token)
            for a in resp.assignments
        }
        for node, wm in resp.input_watermarks.items():
            if wm > self.input_wms.get(node, MIN_TIMESTAMP):
                self.input_wms[node] = wm
                if any(u[0] == node for u in self.units):
                    self._hb_wake.set()  # report what the new input watermark lets through
        fenced = {(f.node, f.range_id, f.token) for f in resp.fenced}
        mine = {u: o.token for u, o in self.owners.items() if o.worker_id == self.worker_id}
        for unit, owned in list(self.units.items()):
            if mine.get(unit) != owned.token or (unit[0], unit[1], owned.token) in fenced:
                self._drop(owned, "moved to another worker")
        for unit, token in sorted(mine.items()):
            if unit not in self.units and (unit[0], unit[1], token) not in self._fenced_tokens:
                self._take(unit, token)
        self.sensors.owned_ranges(len(self.units))
        self._wake.set()

    def _set_topology(self, topology: Topology, version: int) -> None:
        self.topology = topology
        self.version = version
        self.router = Router(topology, self.allow_code)
        self.sensors.keep_nodes({c.name for c in topology.computations}
                                | {f"injector:{i.name}" for i in topology.injectors})
        for owned in list(self.units.values()):
            if owned.worker is not None:
                owned.worker.router = self.router
        log.info("registry version %d: %d computations, %d injectors", version,
                 len(topology.computations), len(topology.injectors))

    def _new_range_worker(self, node: str, range_id: int, token: int) -> RangeWorker:
        spec = self.topology.computation(node)
        return RangeWorker(spec, range_id, self.store, build_computation(spec, self.allow_code), self.router,
                           self.clock, self.sensors, self.crash, token=token)

    def _take(self, unit: Unit, token: int) -> None:
        node, range_id = unit
        if node.startswith("injector:"):
            owned = OwnedRange(node, range_id, token, self.store)
        elif any(c.name == node for c in self.topology.computations):
            owned = OwnedRange(node, range_id, token, self.store,
                               worker=self._new_range_worker(node, range_id, token))
        else:
            return
        with self._units_lock:
            self.units[unit] = owned
        log.info("took %s/%d (token %d)", node, range_id, token)

    def _drop(self, owned: OwnedRange, reason: str) -> None:
        owned.dropped = True  # without the lock: a batch may hold it (its writes are fenced)
        with self._units_lock:
            if self.units.get((owned.node, owned.range_id)) is owned:
                del self.units[(owned.node, owned.range_id)]
        log.info("dropped %s/%d (token %d): %s", owned.node, owned.range_id, owned.token, reason)

    def _fenced(self, owned: OwnedRange, exc: FencedError) -> None:
        self.sensors.fenced(owned.node, owned.range_id)
        entry = (owned.node, owned.range_id, owned.token)
        if entry not in self._fenced_tokens:
            self._fenced_tokens.add(entry)
            self._fenced_unreported.append(entry)
        self._drop(owned, str(exc))

    # -- receiving ---------------------------------------------------------------------
    def inject_order(self, batch: pb.DeliverBatch) -> pb.DeliverAck | None:
        """A refusal if this injection message's predecessor was not accepted here (the
        controller then resends from the first refused one, one at a time)."""
        key = (batch.computation, batch.inject_session)
        with self._units_lock:
            last = self._inject_seqs.get(key)
            if last is None or batch.inject_resync:
                last = self._inject_seqs[key] = batch.inject_seq - 1
                self._inject_seqs.move_to_end(key)
                while len(self._inject_seqs) > 4096:
                    self._inject_seqs.popitem(last=False)
        if batch.inject_seq > last + 1:
            return pb.DeliverAck(status=pb.DeliverAck.FAILED,
                                 message=f"injection message {batch.inject_seq} is out of order "
                                         f"(last accepted {last})")
        return None

    def injected_in_order(self, batch: pb.DeliverBatch) -> None:
        key = (batch.computation, batch.inject_session)
        with self._units_lock:
            self._inject_seqs[key] = max(self._inject_seqs.get(key, 0), batch.inject_seq)

    def inject(self, node: str, records: list[Record], watermark: int | None) -> pb.DeliverAck:
        """Injected records from the controller: checkpoint them into the injector's outbox."""
        owned = self.units.get((node, 0))
        name = node[len("injector:"):]
        stream = next((i.stream for i in self.topology.injectors if i.name == name), None)
        if owned is None or not owned.is_injector or stream is None:
            return pb.DeliverAck(status=pb.DeliverAck.NOT_OWNER,
                                 message=f"{self.worker_id} does not own {node}")
        with owned.lock:
            if owned.dropped:
                return pb.DeliverAck(status=pb.DeliverAck.NOT_OWNER, message="range moved")
            assert owned.outbox is not None
            if len(owned.outbox) >= self.max_injector_outbox:
                # Backpressure: the pipeline drains this outbox slower than it fills.
                return pb.DeliverAck(
                    status=pb.DeliverAck.BUSY, watermark=owned.injector_wm,
                    message=f"injector {name!r} is busy: {len(owned.outbox)} records wait in its "
                            f"outbox (limit {self.max_injector_outbox})")
            try:
                owned.inject(records, watermark, self.router, stream, self.clock.now_us())
            except FencedError as exc:
                self._fenced(owned, exc)
                return pb.DeliverAck(status=pb.DeliverAck.NOT_OWNER, message=str(exc))
            self.crash("after_inject")
            self._wake.set()
            if watermark is not None:
                self._hb_wake.set()
            return pb.DeliverAck(status=pb.DeliverAck.OK, watermark=owned.injector_wm)

    def _commit(self, owned: OwnedRange, txn: RangeTransaction) -> None:
        """Step 3. With weak productions the outputs are sent first and only those not
        acked within ``weak_wait_s`` are checkpointed (into the outbox, resent by the
        pump); the caller holds the range's lock throughout, so the range's watermark
        report waits until the outputs are delivered or checkpointed. A crash before
        the checkpoint makes the sender resend the input: the code runs again and its
        outputs, under the same derived IDs, are dropped downstream as duplicates.
        While older outputs wait in the outbox, newer ones are checkpointed behind them
        (as strong productions), so consumers see them in production order."""
        rw = owned.worker
        assert rw is not None
        assert owned.outbox is not None
        if txn.productions and rw.spec.options.productions is Productions.WEAK and not len(owned.outbox):
            txn.productions = self._deliver_weak(owned.node, txn.productions)
            self.crash("after_weak_send")
        rw.commit(txn)
        owned.changed()

    def _deliver_weak(self, producer: str, productions: list[Production]) -> list[Production]:
        """Deliver ``productions`` now; returns those not acked in time (to checkpoint)."""
        logs, groups, slow = self._route(productions)
        for stream, items in logs.items():
            self.store.append_log(stream, [p.record for p in items])
        waiting = []
        deadline = time.monotonic() + self.weak_wait_s
        for (consumer, range_id), items in groups.items():
            owner = self.owners.get((consumer, range_id))
            if owner is None or not owner.worker_id:
                slow += items
            elif owner.worker_id == self.worker_id:
                ack = self.process(consumer, range_id, [p.record for p in items])
                if ack.status != pb.DeliverAck.OK:
                    slow += items
            else:
                batch = self._batch(producer, consumer, range_id, items)
                fut = self._link(owner.address).send(batch, max(0.0, deadline - time.monotonic()))
                if fut is None:
                    slow += items
                else:
                    waiting.append((fut, items))
        for fut, items in waiting:
            try:
                ack = fut.result(timeout=max(0.0, deadline - time.monotonic()))
                if ack.status != pb.DeliverAck.OK:
                    slow += items
            except Exception:  # a timeout or a broken link: slow to be acked
                slow += items
        return slow

    def process(self, computation: str, range_id: int, records: list[Record]) -> pb.DeliverAck:
        """Steps 1-3 for a batch addressed to one of our ranges; the ack is step 4."""
        owned = self.units.get((computation, range_id))
        if owned is None or owned.worker is None:
            return pb.DeliverAck(status=pb.DeliverAck.NOT_OWNER,
                                 message=f"{self.worker_id} does not own {computation}/{range_id}")
        with owned.lock:
            if owned.dropped or owned.worker is None:
                return pb.DeliverAck(status=pb.DeliverAck.NOT_OWNER, message="range moved")
            rw = owned.worker
            try:
                # Records that overran their deadline before run alone; see services/overruns.py.
                seen = owned.fresh_overruns() if self.watchdog else owned.overruns
                segments, refused = overruns.plan(records, seen) if seen else ([records], [])
                if refused:  # overran alone: the error policy gives them up without running
                    refused = overruns.hand_to_policy(rw, refused, seen)
                    if not refused:  # they go in line with the rest; suspects still run alone
                        segments = overruns.plan(records, {i: v for i, v in seen.items() if not v["alone"]})[0]
                wm = self.input_wms.get(computation, MIN_TIMESTAMP)
                for segment in segments:  # the error policy isolates failing records (fail: raises)
                    with self.progress.batch(computation, range_id, owned.token,
                                             rw.spec.options.max_batch_seconds, segment):
                        poison.process_batch(rw, segment, wm, lambda txn: self._commit(owned, txn))
                if refused:  # on_error "fail": refused, visibly, never run again
                    raise overruns.exceeded(computation, range_id, refused[0], seen)
            except FencedError as exc:
                self._fenced(owned, exc)
                return pb.DeliverAck(status=pb.DeliverAck.NOT_OWNER, message=str(exc))
            except UserCodeError as exc:  # logged (rate-limited) and rolled back by the policy
                return pb.DeliverAck(status=pb.DeliverAck.FAILED, message=str(exc))
            except Exception as exc:
                log.error("processing a batch for %s/%d failed: %s", computation, range_id, exc)
                # The in-memory cache may hold half a batch: rebuild the range from the store.
                owned.worker = self._new_range_worker(computation, range_id, owned.token)
                owned.outbox = owned.worker.outbox
                owned.reset_slices()
                owned.changed()
                return pb.DeliverAck(status=pb.DeliverAck.FAILED, message=str(exc))
        self._wake.set()
        return pb.DeliverAck(status=pb.DeliverAck.OK)

    # -- sending -----------------------------------------------------------------------
    def wake(self) -> None:
        """New work for the pump (an ack arrived, an outbox grew, watermarks moved)."""
        self._wake.set()

    def _pump_loop(self) -> None:
        while not self.stopped.is_set():
            self._wake.clear()
            moved = 0
            for owned in list(self.units.values()):
                try:
                    moved += self._pump(owned)
                except FencedError as exc:
                    self._fenced(owned, exc)
                except UserCodeError:
                    pass  # on_error fail: logged by the policy, retried after its backoff
                except Exception:
                    log.exception("pump of %s/%d failed", owned.node, owned.range_id)
                    owned.reset_slices()
                    owned.backoff()
            if not moved:
                # Acks, deliveries and heartbeats wake us; the timeout covers
                # processing-time timers and retry deadlines.
                self._wake.wait(0.01)

    def _pump(self, owned: OwnedRange) -> int:
        moved = 0
        planned: list[Slice] = []
        with owned.lock:
            if owned.dropped:
                return 0
            for s in [s for s in owned.slices if s.ready()]:
                moved += self._finish(owned, s)
            self._check_overdue(owned)
            rw = owned.worker
            if rw is not None:
                deadline = rw.spec.options.max_batch_seconds
                seen = owned.fresh_overruns(0.5) if self.watchdog else owned.overruns
                if overruns.fire_timers(rw, seen, lambda ids: self.progress.batch(
                        owned.node, owned.range_id, owned.token, deadline, ids=ids),  # noqa: B023 - called at once
                        self.input_wms.get(owned.node, MIN_TIMESTAMP), lambda txn: self._commit(owned, txn)):
                    self._hb_wake.set()
                    moved += 1
                rw.expire_record_ids()
            while len(owned.slices) < self.max_slices and time.monotonic() >= owned.retry_at:
                entries = owned.sendable(self.batch_size)
                if not entries:
                    break
                s = Slice(time.monotonic(), entries)
                owned.slices.append(s)
                owned.inflight.update(s.keys())
                planned.append(s)
        # Sent without the range's lock: deliveries into this range, injection and
        # heartbeats go on meanwhile; only this thread finishes the slices.
        for i, s in enumerate(planned):
            moved += self._send(owned, s)
            if s.failed:  # e.g. a consumer range has no owner: back off, send the rest later
                with owned.lock:
                    for later in planned[i + 1:]:
                        owned.slices.remove(later)
                        owned.inflight.difference_update(later.keys())
                break
        return moved

    def _link(self, address: str) -> PeerLink:
        link = self.links.get(address)
        if link is None:
            link = self.links[address] = PeerLink(address, self.max_inflight, self.sensors)
        return link

    def _route(self, entries: list[Production]
               ) -> tuple[dict[str, list[Production]], dict[Unit, list[Production]], list[Production]]:
        """(stream-log entries by stream, entries by consumer range, entries of consumers
        not registered here: they stay until the consumer is back)."""
        logs: dict[str, list[Production]] = defaultdict(list)
        groups: dict[Unit, list[Production]] = defaultdict(list)
        unknown: list[Production] = []
        for p in entries:
            if p.consumer.startswith(LOG_PREFIX):
                logs[p.consumer[len(LOG_PREFIX):]].append(p)
            else:
                try:
                    ranges = self.topology.computation(p.consumer).options.key_ranges
                except Exception:
                    unknown.append(p)
                    continue
                groups[(p.consumer, key_range(p.record.key, ranges))].append(p)
        return logs, groups, unknown

    def _batch(self, producer: str, consumer: str, range_id: int, items: list[Production]
               ) -> pb.DeliverBatch:
        return pb.DeliverBatch(producer=producer, computation=consumer, range_id=range_id,
                               topology_version=self.version,
                               records=[convert.record_to_proto(p.record) for p in items])

    def _send(self, owned: OwnedRange, s: Slice) -> int:
        """Deliver a planned slice: stream-log entries and consumer ranges owned here at
        once, others to their owner's link if it has room (else they are released for a
        later slice). Returns the entries delivered or sent."""
        logs, groups, released = self._route(s.entries)
        for stream, items in logs.items():
            self.store.append_log(stream, [p.record for p in items])  # idempotent by record id
            s.done_now += [(p.consumer, p.record.record_id) for p in items]
        busy = set().union(*(other.busy() for other in owned.slices if other is not s))
        for (consumer, range_id), items in groups.items():
            owner = self.owners.get((consumer, range_id))
            if owner is None or not owner.worker_id:
                s.failed = True
                continue
            if (consumer, range_id) in busy:
                released += items  # one batch in flight per consumer range: keeps order
                continue
            if owner.worker_id == self.worker_id:
                ack = self.process(consumer, range_id, [p.record for p in items])
                if ack.status == pb.DeliverAck.OK:
                    s.done_now += [(p.consumer, p.record.record_id) for p in items]
                else:
                    s.failed = True
                continue
            fut = self._link(owner.address).try_send(self._batch(owned.node, consumer, range_id, items))
            if fut is None:
                released += items  # no room at that destination: a later slice takes them
                continue
            fut.add_done_callback(lambda _f: self._wake.set())
            s.remote.append((fut, items, owner.address))
            s.units.add((consumer, range_id))
        if released:
            keys = {(p.consumer, p.record.record_id) for p in released}
            with owned.lock:
                s.entries = [p for p in s.entries if (p.consumer, p.record.record_id) not in keys]
                owned.inflight.difference_update(keys)
        s.sent = True
        return len(s.done_now) + sum(len(items) for _, items, _ in s.remote)

    def _check_overdue(self, owned: OwnedRange) -> None:
        now = time.monotonic()
        for s in owned.slices:
            if now - s.started > self.delivery_timeout_s:
                for fut, _, address in s.remote:
                    if not fut.done():
                        self._link(address).reset("a batch is overdue")

    def _finish(self, owned: OwnedRange, s: Slice) -> int:
        assert owned.outbox is not None
        acked = list(s.done_now)
        failed = s.failed
        for fut, items, address in s.remote:
            exc = fut.exception()
            if exc is None and fut.result().status == pb.DeliverAck.OK:
                acked += [(p.consumer, p.record.record_id) for p in items]
            else:
                failed = True
                self.sensors.retry(address)
                log.debug("delivery to %s failed: %s", address,
                          exc if exc is not None else fut.result().message)
        owned.slices.remove(s)
        owned.inflight.difference_update(s.keys())
        if acked:
            owned.outbox.ack(owned.token, acked)
            owned.changed()
            self.crash("after_ack")
            self._hb_wake.set()
        if failed:
            owned.backoff()
        elif acked:
            owned.succeeded()
        return len(acked)


class DeliverServicer:
    """The Worker service: batches in on a bidirectional stream, one ack per batch."""

    def __init__(self, worker: WorkerProcess) -> None:
        self.worker = worker

    def Deliver(self, request_iterator: Iterator[Any], context: grpc.ServicerContext) -> Iterator[pb.DeliverAck]:
        for batch in request_iterator:
            if isinstance(batch, Malformed):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"malformed {batch.what} message: {batch.error}")
            if batch.inject_session:
                refusal = self.worker.inject_order(batch)
                if refusal is not None:
                    refusal.batch_id = batch.batch_id
                    yield refusal
                    continue
            if batch.topology_version > self.worker.version:
                yield pb.DeliverAck(batch_id=batch.batch_id, status=pb.DeliverAck.FAILED,
                                    message=f"registry version {batch.topology_version} not yet "
                                            f"known here (have {self.worker.version})")
                continue
            records = convert.records_from_proto(batch.records)
            if batch.computation.startswith("injector:"):
                wm = batch.watermark if batch.HasField("watermark") else None
                ack = self.worker.inject(batch.computation, records, wm)
                if batch.inject_session and ack.status == pb.DeliverAck.OK:
                    self.worker.injected_in_order(batch)
            else:
                ack = self.worker.process(batch.computation, batch.range_id, records)
            ack.batch_id = batch.batch_id
            yield ack
