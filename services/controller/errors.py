"""The controller's view of failing user code, and the replay of dead letters.

* :func:`error_info` fills ``ComputationInfo``'s error fields from what the error
  policy (:mod:`millwheel.runtime.poison`) keeps per range in the store: durable
  counts, the last given-up errors and the items being retried now; and the ranges
  failing as a whole, as their owners report them.
* :class:`Replayer` hands a computation's dead letters back to that computation only
  (not to the other consumers of its input streams), after its code was fixed.
  Exactly once: each replayed record's ID is derived from its dead letter's, so a
  batch resent after a failure is dropped by the range's dedup; and a durable cursor
  (the last dead-letter log position replayed, in the store's metadata) makes a second
  replay hand over only dead letters written since.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import AbstractContextManager
from typing import Any, Protocol, Sequence

from millwheel.errors import NotFoundError
from millwheel.keys import key_range
from millwheel.record import Record, derive_record_id
from millwheel.runtime.failures import letter_record
from millwheel.state.protocol import StateStore
from millwheel.topology import ComputationSpec, ErrorPolicy

from ..generated import millwheel_pb2 as pb
from ..rpc import convert
from ..rpc.status import UnavailableError
from ..rpc.worker_link import LinkError, PeerLink
from .assign import Assigner
from .registry import Registry

REPLAY_CURSOR = "replay-cursor:"  # + computation: last dead-letter log seq replayed
REPLAY_CHUNK = 500
REPLAY_TIMEOUT_S = 30.0


def _error_proto(raw: bytes, range_id: int, attempts: int | None = None, outcome: str = "") -> pb.ErrorInfo:
    try:
        e: dict[str, Any] = json.loads(raw)
    except ValueError:
        e = {"message": raw.decode("utf-8", "replace")}
    return pb.ErrorInfo(
        range_id=int(e.get("range_id", range_id)), key=str(e.get("key", "")),
        record_id=str(e.get("record_id", "")), time=int(e.get("time", 0)),
        attempts=int(e.get("attempts", 0) if attempts is None else attempts),
        exception_type=str(e.get("exception_type", "")), message=str(e.get("message", "")),
        outcome=outcome or str(e.get("outcome", "")))


def error_info(store: StateStore, spec: ComputationSpec,
               failing_ranges: Sequence[pb.RangeFailure] = ()) -> dict[str, Any]:
    """``ComputationInfo`` fields 5-10 for ``spec``, summed over its ranges; the ranges
    failing as a whole are what their owners report (services/controller/failing.py)."""
    counters: dict[str, int] = defaultdict(int)
    recent: list[pb.ErrorInfo] = []
    retrying: list[pb.ErrorInfo] = []
    failing = "failing" if spec.options.on_error is ErrorPolicy.FAIL else "retrying"
    for r in range(spec.options.key_ranges):
        report = store.read_errors(spec.name, r)
        for name, n in report.counters.items():
            counters[name] += n
        recent += [_error_proto(e, r) for e in report.recent]
        retrying += [_error_proto(err, r, n, failing) for _item, (n, err) in sorted(report.attempts.items())]
    recent.sort(key=lambda e: -e.time)
    return {"dead_lettered": counters["dead_lettered"], "skipped": counters["skipped"],
            "late_dropped": counters["late_dropped"], "recent_errors": recent[:20], "retrying": retrying,
            "failing_ranges": list(failing_ranges)}


class ReplayHost(Protocol):
    """What a replay needs of the controller (:class:`services.controller.service.ControllerService`
    is one): read at each use, since a change of leadership replaces the registry and
    the assignment."""

    @property
    def lock(self) -> AbstractContextManager[Any]: ...

    @property
    def store(self) -> StateStore: ...

    @property
    def registry(self) -> Registry: ...

    @property
    def assigner(self) -> Assigner: ...

    def _link(self, address: str) -> PeerLink: ...


class Replayer:
    def __init__(self, controller: ReplayHost) -> None:
        self.controller = controller

    def replay(self, name: str) -> pb.ReplayDeadLettersResponse:
        c = self.controller
        with c.lock:
            spec = c.registry.computation(name)
        if spec.options.on_error is not ErrorPolicy.DEAD_LETTER:
            raise NotFoundError(f"computation {name!r} has on_error {spec.options.on_error.value!r}: "
                                "it keeps no dead letters")
        cursor_key = REPLAY_CURSOR + name
        raw = c.store.get_meta(cursor_key)
        cursor = int(raw) if raw else 0
        replayed = skipped = 0
        while True:
            entries = c.store.read_log(spec.dead_letter_stream, cursor, REPLAY_CHUNK)
            if not entries:
                break
            by_range: dict[int, list[Record]] = defaultdict(list)
            for _seq, letter in entries:
                original = letter_record(json.loads(letter.value))
                if original is None:
                    skipped += 1
                    continue
                again = Record(original.key, original.value, original.timestamp,
                               derive_record_id(name, "replay\x1f" + letter.record_id, 0))
                by_range[key_range(again.key, spec.options.key_ranges)].append(again)
            for range_id, records in sorted(by_range.items()):
                self._hand_over(name, range_id, records)
                replayed += len(records)
            cursor = entries[-1][0]
            c.store.put_meta(cursor_key, str(cursor).encode())
        return pb.ReplayDeadLettersResponse(replayed=replayed, skipped=skipped)

    def _hand_over(self, name: str, range_id: int, records: list[Record]) -> None:
        """Deliver to the range's owner like a producer would; retried until acked."""
        c = self.controller
        deadline = time.monotonic() + REPLAY_TIMEOUT_S
        problem = "no live worker owns it"
        while time.monotonic() < deadline:
            owner = c.assigner.units.get((name, range_id))
            worker = c.assigner.workers.get(owner.worker_id or "") if owner else None
            if worker is not None and worker.alive:
                batch = pb.DeliverBatch(producer="replay", computation=name, range_id=range_id,
                                        topology_version=c.registry.version,
                                        records=[convert.record_to_proto(r) for r in records])
                try:
                    fut = c._link(worker.address).send(batch, wait_s=5)
                    ack = fut.result(timeout=10) if fut is not None else None
                    if ack is not None and ack.status == pb.DeliverAck.OK:
                        return
                    problem = ack.message if ack is not None else "too many batches in flight"
                except (LinkError, FutureTimeout) as exc:
                    problem = str(exc) or type(exc).__name__
            time.sleep(0.1)
        raise UnavailableError(f"cannot replay into {name}/{range_id}: {problem}; replay again "
                               "(what was handed over is not replayed twice)")
