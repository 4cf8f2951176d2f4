"""Handing a computation's dead letters back to it (``ReplayDeadLetters``), bounded.

A replay hands each dead letter's record to the computation alone (not to the other
consumers of its input streams), after its code was fixed. While the code still
fails, every replayed record is dead-lettered again under a new ID, into the very
stream the replay reads; so a replay that read "until nothing more" fed itself (10
dead letters became 219) and ran on in the controller after its caller had gone.
Hence:

* **What**: the dead letters present when the replay starts. It fixes the stream's
  end position first (:meth:`~millwheel.state.protocol.StateStore.log_end`) and reads
  no further. A letter whose record this replay handed over (possible before the end
  only when an earlier call was cut off before it saved its cursor) is left for the
  next replay too.
* **Retried**: a call cut off before it finished leaves its end position in the
  cursor; the next call finishes that replay, up to that end, and no further (the
  letters the first call's records wrote meanwhile are the next replay's).
* **How long**: until the call's deadline, less a margin for the answer, or until it
  is cancelled; one range's hand-over is given up after :data:`REPLAY_TIMEOUT_S` in
  any case. What is left is reported (``remaining``, or the error's message).
* **Once**: each replayed record's ID is derived from its letter's, so a batch sent
  again (after a lost ack) is dropped by the range's dedup; and a durable cursor in
  the store's metadata records what was handed over, range by range: the log
  position up to which every letter was settled, and the letters after it that were.
  A retried replay skips both. Replays of one computation run one at a time: a retry
  waits (within its own deadline) for the call it replaces to finish its last step.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections import defaultdict
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol

from millwheel.errors import NotFoundError
from millwheel.keys import key_range
from millwheel.record import Record, derive_record_id
from millwheel.runtime.failures import letter_record
from millwheel.runtime.retention import read_retained
from millwheel.topology import ComputationSpec, ErrorPolicy

from ..generated import millwheel_pb2 as pb
from ..rpc import convert
from ..rpc.status import UnavailableError
from ..rpc.worker_link import LinkError, PeerLink
from .plane import ControlPlane

log = logging.getLogger("millwheel.controller")

REPLAY_CURSOR = "replay-cursor:"  # + computation: what was handed over (see Cursor)
REPLAY_CHUNK = 500
REPLAY_TIMEOUT_S = 30.0  # one range's hand-over at most, whatever the deadline
ANSWER_MARGIN_S = 1.0  # stop this long before the deadline (at most a tenth of the call)


def replay_id(computation: str, letter_id: str) -> str:
    """The replayed record's ID: derived from its dead letter's, the same every time."""
    return derive_record_id(computation, "replay\x1f" + letter_id, 0)


class Call(Protocol):
    """The part of a ``grpc.ServicerContext`` a replay watches."""

    def is_active(self) -> bool: ...

    def time_remaining(self) -> float | None: ...


class Budget:
    """How long a replay may go on: until its call is cancelled, or its deadline less a
    margin, so that the answer (what was done, what remains) still reaches the caller."""

    def __init__(self, call: Call | None) -> None:
        self.call = call
        left = call.time_remaining() if call is not None else None
        self.margin = 0.0 if left is None else min(ANSWER_MARGIN_S, 0.1 * max(left, 0.0))

    def left(self) -> float:
        if self.call is None:
            return math.inf
        if not self.call.is_active():
            return 0.0
        left = self.call.time_remaining()
        return math.inf if left is None else left - self.margin

    def why(self) -> str:
        cancelled = self.call is not None and not self.call.is_active()
        return "stopped: the call was cancelled" if cancelled else "stopped at its deadline"


@dataclass
class Cursor:
    """What earlier replays settled (handed over, or found not replayable): every letter
    up to log position ``after``, and the letters in ``done`` after it. ``done`` holds
    what a replay cut off part-way through a chunk settled (a chunk is handed over range
    by range), so a retry hands none of it over again; ``end`` is the end position of a
    replay cut off (None once one finished). Stored as JSON; an older cursor is the
    bare position."""

    after: int = 0
    done: set[int] = field(default_factory=set)
    end: int | None = None

    @classmethod
    def load(cls, raw: bytes | None) -> Cursor:
        if not raw:
            return cls()
        if not raw.startswith(b"{"):
            return cls(int(raw))
        d = json.loads(raw)
        end = d.get("end")
        return cls(int(d["after"]), {int(s) for s in d.get("done", ())}, None if end is None else int(end))

    def dump(self) -> bytes:
        return json.dumps({"after": self.after, "done": sorted(self.done), "end": self.end}).encode()

    def settle(self, seqs: Iterable[int], chunk: list[int], chunk_after: int) -> None:
        """Mark ``seqs`` settled; move ``after`` over the settled start of ``chunk`` (the
        positions read after ``chunk_after``, in order) if nothing before it is open."""
        self.done.update(seqs)
        if self.after == chunk_after:
            start = 0
        elif self.after in chunk:
            start = chunk.index(self.after) + 1
        else:
            return
        for seq in chunk[start:]:
            if seq not in self.done:
                break
            self.done.discard(seq)
            self.after = seq


class Replayer:
    """One per controller: it keeps replays of one computation from running at once.
    ``link``: the controller's kept-open link to a worker's address (services/controller/inject.py)."""

    def __init__(self, controller: ControlPlane, link: Callable[[str], PeerLink]) -> None:
        self.controller = controller
        self.link = link
        self._guard = threading.Lock()
        self._running: dict[str, threading.Lock] = {}

    def replay(self, name: str, call: Call | None = None) -> pb.ReplayDeadLettersResponse:
        c = self.controller
        with c.lock:
            spec = c.registry.computation(name)
        if spec.options.on_error is not ErrorPolicy.DEAD_LETTER:
            raise NotFoundError(f"computation {name!r} has on_error {spec.options.on_error.value!r}: "
                                "it keeps no dead letters")
        budget = Budget(call)
        with self._guard:
            one = self._running.setdefault(name, threading.Lock())
        wait = budget.left()
        if not one.acquire(timeout=-1 if wait == math.inf else max(wait, 0.0)):
            raise UnavailableError(f"a replay of {name!r} is still running (a call cut off finishes its "
                                   "last hand-over first); replay again shortly")
        try:
            return _Run(c, self.link, spec, budget).run()
        finally:
            one.release()


class _Run:
    """One replay call (see the module docstring)."""

    def __init__(self, controller: ControlPlane, link: Callable[[str], PeerLink], spec: ComputationSpec,
                 budget: Budget) -> None:
        self.c = controller
        self.link = link
        self.spec = spec
        self.name = spec.name
        self.budget = budget
        self.cursor_key = REPLAY_CURSOR + spec.name
        self.cursor = Cursor.load(controller.store.get_meta(self.cursor_key))
        self.handed: set[str] = set()  # IDs of the records this replay handed over
        self.replayed = self.skipped = self.total = 0
        self.expired = 0  # the log position through which retention removed letters not replayed

    def run(self) -> pb.ReplayDeadLettersResponse:
        store, stream, cursor = self.c.store, self.spec.dead_letter_stream, self.cursor
        if cursor.end is not None:
            log.info("replay of %r: finishing the one cut off, up to dead-letter log position %d",
                     self.name, cursor.end)
        start = store.log_start(stream)
        if start > cursor.after:  # retention removed letters not yet replayed: say so
            self.expired = start
            log.warning("replay of %r: dead letters through position %d were removed by log "
                        "retention before they were replayed", self.name, start)
            cursor.after, cursor.done = start, {s for s in cursor.done if s > start}
            store.put_meta(self.cursor_key, cursor.dump())
        end, count = store.log_end(stream, cursor.after, cursor.end)
        self.total = count - sum(1 for s in cursor.done if s <= end)
        if cursor.end is None and self.total:
            cursor.end = end
            store.put_meta(self.cursor_key, cursor.dump())
        pos = cursor.after
        while pos < end and self.budget.left() > 0:
            read_from, got = read_retained(store, stream, pos, REPLAY_CHUNK, skip_removed=True)
            if read_from > pos:  # removed by retention during this replay
                self.expired = read_from
                self.total = self.replayed + self.skipped + store.log_end(stream, read_from, end)[1]
                cursor.after, cursor.done = read_from, {s for s in cursor.done if s > read_from}
                store.put_meta(self.cursor_key, cursor.dump())
                pos = read_from
            chunk = [(s, letter) for s, letter in got if s <= end]
            if not chunk:
                break
            chunk_after, pos = pos, chunk[-1][0]
            seqs = [s for s, _l in chunk]
            by_range, settled = self._sort(chunk)
            self._save(settled, seqs, chunk_after)
            for range_id, items in sorted(by_range.items()):
                if self.budget.left() <= 0:
                    break
                problem = self._hand_over(range_id, [r for _s, r in items])
                if problem is not None:
                    raise UnavailableError(self._cut_short(f"cannot replay into {self.name}/{range_id}: {problem}"))
                self.handed.update(r.record_id for _s, r in items)
                self.replayed += len(items)
                self._save([s for s, _r in items], seqs, chunk_after)
        remaining = self._remaining()
        if self.budget.left() <= 0 and remaining:
            log.warning("%s", self._cut_short(f"replay of {self.name!r} {self.budget.why()}"))
        elif cursor.end is not None:  # finished: the next replay fixes its own end
            cursor.end = None
            store.put_meta(self.cursor_key, cursor.dump())
        return pb.ReplayDeadLettersResponse(replayed=self.replayed, skipped=self.skipped, remaining=remaining,
                                            expired_through=self.expired)

    def _sort(self, chunk: list[tuple[int, Record]]) -> tuple[dict[int, list[tuple[int, Record]]], list[int]]:
        """The chunk's letters to hand over, by range; and those settled at once (not
        replayable: a timer's, an unkeyable record's, an unreadable letter)."""
        by_range: dict[int, list[tuple[int, Record]]] = defaultdict(list)
        settled: list[int] = []
        for seq, letter in chunk:
            if seq in self.cursor.done:
                continue
            try:
                original = letter_record(json.loads(letter.value))
            except (ValueError, KeyError, TypeError):
                original = None
            if original is None:
                self.skipped += 1
                settled.append(seq)
            elif original.record_id not in self.handed:  # else: our own output, for the next replay
                again = Record(original.key, original.value, original.timestamp, replay_id(self.name, letter.record_id))
                by_range[key_range(again.key, self.spec.options.key_ranges)].append((seq, again))
        return by_range, settled

    def _save(self, settled: list[int], chunk: list[int], chunk_after: int) -> None:
        if settled:
            self.cursor.settle(settled, chunk, chunk_after)
            self.c.store.put_meta(self.cursor_key, self.cursor.dump())

    def _remaining(self) -> int:
        return max(0, self.total - self.replayed - self.skipped)

    def _cut_short(self, what: str) -> str:
        remaining = self._remaining()
        why = f" ({self.budget.why()})" if self.budget.left() <= 0 else ""
        return (f"{what}{why}; {self.replayed} of {self.total} dead letters handed over, {remaining} remain"
                + (": replay again (nothing is handed over twice)" if remaining else ""))

    def _hand_over(self, range_id: int, records: list[Record]) -> str | None:
        """Deliver to the range's owner like a producer would, retried until acked, the
        budget runs out or :data:`REPLAY_TIMEOUT_S` passes; None when acked, else the
        last problem. A batch whose ack was not awaited may still be applied: a retry's
        resend of its records (same IDs) is dropped by the range's dedup."""
        c = self.c
        give_up = time.monotonic() + REPLAY_TIMEOUT_S
        problem = "no live worker owns it"
        while (left := min(give_up - time.monotonic(), self.budget.left())) > 0:
            owner = c.assigner.units.get((self.name, range_id))
            worker = c.assigner.workers.get(owner.worker_id or "") if owner else None
            if worker is not None and worker.alive:
                batch = pb.DeliverBatch(producer="replay", computation=self.name, range_id=range_id,
                                        topology_version=c.registry.version,
                                        records=[convert.record_to_proto(r) for r in records])
                try:
                    fut = self.link(worker.address).send(batch, wait_s=min(5.0, left))
                    if fut is None:
                        problem = "too many batches in flight"
                    else:
                        wait = min(10.0, self.budget.left(), give_up - time.monotonic())
                        ack = fut.result(timeout=max(0.0, wait))
                        if ack.status == pb.DeliverAck.OK:
                            return None
                        problem = ack.message
                except (LinkError, FutureTimeout) as exc:
                    problem = str(exc) or f"no ack in time ({type(exc).__name__})"
            time.sleep(min(0.1, max(0.0, left)))
        return problem
