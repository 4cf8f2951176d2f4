"""Drain (``millwheel savepoint create FILE --drain``): finish everything in flight, then
stop with savepoint.

1. **Stop taking records.** ``savepoint/draining`` is stored and ``Inject`` is refused
   with FAILED_PRECONDITION from then on (a new leader reads the marker, so a failover
   does not reopen the service). A dead-letter replay is refused too.
2. **Close every injector.** Each injector's owner is handed an empty Inject batch
   with the watermark +inf (what ``done`` sends), checkpointed with the injector's
   range; a pulled source whose injector is closed reads nothing more
   (services/worker/connectors.py). Sent again each round until the injector's stored
   watermark is +inf, so an owner killed before its checkpoint is covered.
3. **Wait** until every range of every injector and computation has a stored watermark
   of +inf (the watermark rule, millwheel/watermark_manager.py: an output watermark is
   held by pending productions and by event-time timers, so +inf everywhere means every
   event-time window fired and every production was taken), then check from the store
   that every outbox is empty. Workers go on meanwhile, so a worker killed during the
   drain is an ordinary range move. Progress every half second.
3b. **Wait for the sinks** (``sink:NAME``, docs/connectors.md): once nothing is left to
   append to any stream log, each sink's stream log has a last position, and the drain
   waits until every sink's committed position reaches it. The position is the one
   each worker reports with its heartbeats (``HeartbeatRequest.sink_positions``): what
   the sink's connector read back from the external system at open or got back from
   its last committed write, so never ahead of what the system holds. It comes from the
   workers rather than from the external system itself because only workers connect to
   external systems (their client libraries, addresses and credentials), and rather
   than from the store because the position lives in the external system's own
   transaction (docs/connectors.md); the controller keeps the highest reported per
   sink (a committed position never goes back). A sink behind is named in the progress
   and in the timeout's message, with how long it has been failing to write.
4. **Stop with savepoint** (services/controller/savepoint.py ``_cut`` with stop): the
   cut, read under every range's fence, is checked again: ``drained`` in its summary
   says every outbox in the file is empty and no event-time timer is pending.

Past the timeout the call fails (DEADLINE_EXCEEDED) and the service is left
*draining*: Inject refused, injectors closed (their watermarks cannot go back), ranges
running, nothing stopped and no file. Sending the drain again waits on from there;
``savepoint create --stop`` stops it with what is pending in the file.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass
from typing import Any, Callable

import grpc

from millwheel.errors import MillWheelError
from millwheel.nodes import injector_node, is_injector, sink_node
from millwheel.record import MAX_TIMESTAMP
from millwheel.state.protocol import StateStore

from ..generated import millwheel_pb2 as pb
from .assign import DRAINING_KEY
from .plane import ControlPlane

DEFAULT_TIMEOUT_S = 600.0
POLL_S = 0.2
PROGRESS_EVERY_S = 0.5


class DrainTimeoutError(MillWheelError):
    """The drain did not finish in time (DEADLINE_EXCEEDED): the service stays draining."""

    status = grpc.StatusCode.DEADLINE_EXCEEDED


#: How the drain hands an injector's closing batch to its owner (services/controller/inject.py).
HandOver = Callable[[str, pb.DeliverBatch], pb.DeliverAck]


def start_draining(host: ControlPlane, now_us: int) -> None:
    """Step 1, under the lock: from here on Inject is refused."""
    with host.lock:
        if not host.assigner.draining:
            host.store.put_meta(DRAINING_KEY, json.dumps({"at_us": now_us}).encode())
            host.assigner.draining = True


def drain(host: ControlPlane, hand_over: HandOver, timeout_s: float, report: Callable[[str, int, str], None]) -> None:
    """Steps 1-3 (the caller takes the cut); DrainTimeoutError past ``timeout_s``."""
    started = time.monotonic()
    deadline = started + (timeout_s if timeout_s > 0 else DEFAULT_TIMEOUT_S)
    start_draining(host, int(time.time() * 1e6))
    last_report = 0.0
    status = "closing injectors"
    while True:
        topo = host.registry.topology
        nodes = {injector_node(i.name): 1 for i in topo.injectors}
        nodes.update({c.name: c.options.key_ranges for c in topo.computations})
        short: list[tuple[int, str, int]] = []  # (watermark, node, range) below +inf
        for node, ranges in nodes.items():
            stored = host.store.read_watermarks(node)
            short.extend((stored.get(r, -(2**63)), node, r) for r in range(ranges)
                         if stored.get(r, -(2**63)) < MAX_TIMESTAMP)
        for node in sorted({n for _, n, _ in short if is_injector(n)}):
            _close(host, hand_over, node)
        pending = 0 if short else _pending(host.store, nodes)
        behind = [] if short or pending else sinks_behind(host)
        if not short and not pending and not behind:
            report("draining", 0, f"drained in {time.monotonic() - started:.1f} s: every watermark at +inf, "
                                  f"every outbox empty, every sink ({len(topo.sinks)}) written to its log's end")
            return
        if short:
            low = min(short)
            status = (f"{len(short)} of {sum(nodes.values())} key ranges below +inf; lowest "
                      f"{low[1]}/{low[2]} at {low[0] if low[0] > -(2**63) else 'none yet'}")
        elif pending:
            status = f"every watermark at +inf; {pending} records still pending in outboxes"
        else:
            status = (f"every watermark at +inf, every outbox empty; {len(behind)} of {len(topo.sinks)} sinks "
                      f"behind: " + "; ".join(b.text() for b in behind))
        if time.monotonic() - last_report >= PROGRESS_EVERY_S:
            last_report = time.monotonic()
            report("draining", len(short) + pending + sum(b.left for b in behind), status)
        if time.monotonic() > deadline:
            raise DrainTimeoutError(
                f"drain not finished within {time.monotonic() - started:.0f} s: {status} (see 'millwheel "
                "status' and 'millwheel describe NAME' for failing ranges and retried records, the console and "
                "the sink owner's log for a sink failing to write). The service "
                "is left draining: Inject is refused, its injectors are closed (watermark +inf), its key "
                "ranges keep running, nothing was stopped and no file was written. Run the drain again to "
                "wait longer, or 'millwheel savepoint create FILE --stop' to stop with what is pending in "
                "the file")
        time.sleep(POLL_S)


def _close(host: ControlPlane, hand_over: HandOver, node: str) -> None:
    """Step 2 for one injector: +inf to its owner (an Inject ``done`` without records).
    A failure (no owner yet, its outbox full) is retried at the next round."""
    batch = pb.DeliverBatch(computation=node, range_id=0, topology_version=host.registry.version,
                            inject_session=secrets.token_hex(8), inject_seq=1, watermark=MAX_TIMESTAMP)
    try:
        hand_over(node, batch)
    except MillWheelError:
        pass


@dataclass(frozen=True)
class SinkBehind:
    """A sink whose external system does not yet hold its whole stream log."""

    name: str
    position: int | None  # the committed log position reported (None: none yet)
    end: int  # the log's last position
    left: int  # log entries after the position
    down_s: float | None  # seconds it has been failing to write, if it is

    def text(self) -> str:
        at = "no position reported yet" if self.position is None else f"at log position {self.position}"
        down = "" if self.down_s is None else f", failing to write for {self.down_s:.0f} s (see the worker's log)"
        return f"sink {self.name} {at} of {self.end} ({self.left} records to write{down})"


def sinks_behind(host: ControlPlane) -> list[SinkBehind]:
    """Step 3b's check (read once nothing more is appended to any log): the sinks whose
    highest reported committed position is short of their stream log's last entry."""
    sinks = host.registry.topology.sinks
    with host.lock:
        reported = [dict(p) for p in host.sink_positions.values()]
        owners = {s.name: host.assigner.units.get((sink_node(s.name), 0)) for s in sinks}
        down = {name: host.sinks_down.get(o.worker_id or "", {}).get(name)
                for name, o in owners.items() if o is not None}
    out = []
    for sink in sinks:
        known = [p[sink.name] for p in reported if sink.name in p]
        position = max(known) if known else None
        end, left = host.store.log_end(sink.stream, position or 0)
        if left == 0:
            continue  # every entry of the log (none left past the position) is written
        out.append(SinkBehind(sink.name, position, end, left, down.get(sink.name)))
    return out


def _pending(store: StateStore, nodes: dict[str, int]) -> int:
    """Productions still in any outbox (read once every watermark is +inf: then none
    should be, and the read is small)."""
    return sum(len(store.read_outbox(node, r)) for node, ranges in nodes.items() for r in range(ranges))


def drained(counts: dict[str, Any]) -> bool:
    """Whether a cut's counts (millwheel/savepoint/capture.py) hold no pending work:
    no outbox entry and no timer."""
    return not counts.get("outbox") and not counts.get("timers")
