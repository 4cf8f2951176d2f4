"""An injector: reads its source and checkpoints each batch into its outbox.

The source cursor is written in the same checkpoint as the batch's records, under
the injector's own sequencer token, so a crash replays from exactly the last
checkpoint and record IDs (which the source derives from positions) repeat exactly;
consumers drop the repeats. The batch's watermark is written in that checkpoint too
(:data:`WATERMARK_KEY`): the cursor has moved past whatever gave it, so a crash before
the watermark was reported would otherwise lose it until the source gives another.
"""

from __future__ import annotations

import json

from millwheel.clock import Clock
from millwheel.nodes import injector_node
from millwheel.record import MIN_TIMESTAMP, Record, well_formed
from millwheel.runtime.outbox import Outbox
from millwheel.runtime.range_worker import CrashHook, no_crash
from millwheel.runtime.routing import Router
from millwheel.sources import Source
from millwheel.state.protocol import Checkpoint, StateStore
from millwheel.topology import InjectorSpec

CURSOR_KEY = "__cursor__"
WATERMARK_KEY = "__watermark__"


class InjectorWorker:
    def __init__(
        self, spec: InjectorSpec, source: Source, store: StateStore, router: Router,
        clock: Clock, crash: CrashHook = no_crash, token: int | None = None,
    ) -> None:
        self.spec = spec
        self.node = injector_node(spec.name)
        self.source = source
        self.store = store
        self.router = router
        self.clock = clock
        self.crash = crash
        self.token = store.acquire(self.node, 0) if token is None else token
        self.outbox = Outbox(store, self.node, 0)
        saved = store.read_state(self.node, [CURSOR_KEY, WATERMARK_KEY])
        self.cursor = saved.get(CURSOR_KEY)
        self.watermark = max([*store.read_watermarks(self.node).values(),
                              int(saved.get(WATERMARK_KEY) or MIN_TIMESTAMP)])
        self.done = False
        self.injected = 0

    def pull(self, max_records: int, max_pending: int) -> int:
        """Read and checkpoint one batch unless the outbox is full; returns its size."""
        if self.done or len(self.outbox) >= max_pending:
            return 0
        batch = self.source.read(self.cursor, max_records)
        if not batch.records and not batch.rejected and batch.cursor == self.cursor and not batch.done:
            return 0  # nothing new (a quiet pulled source): no checkpoint
        for i, record in enumerate(batch.records):
            if not well_formed(record.key, record.value, record.timestamp, record.record_id):
                record.validate(f"injector {self.spec.name!r} record {i}")  # says what is wrong
        productions = self.router.fan_out_many(self.spec.stream, batch.records)
        cp = Checkpoint(
            computation=self.node, range_id=0, token=self.token, now_us=self.clock.now_us(),
            state_writes={CURSOR_KEY: batch.cursor}, productions=productions,
        )
        watermark = max(self.watermark, batch.watermark)
        if watermark != self.watermark:
            cp.state_writes[WATERMARK_KEY] = str(watermark).encode()
        if batch.rejected:  # entries that are not records: dead letters, in the same checkpoint
            dead_letters(cp, self.spec, self.router, batch.rejected)
        self.store.checkpoint(cp)
        self.outbox.add(cp.productions)
        self.cursor = batch.cursor
        self.watermark = watermark
        self.done = batch.done
        self.injected += len(batch.records)
        self.crash("after_inject")
        return len(batch.records)

    def hold(self) -> int:
        return self.outbox.hold()


def dead_letters(cp: Checkpoint, spec: InjectorSpec, router: Router, letters: list[Record]) -> None:
    """Add a source's rejected entries to the injector's checkpoint: the letters to its
    dead-letter stream, their errors to its recent errors, their count to its
    ``dead_lettered`` counter (``millwheel errors injector:NAME``)."""
    productions = router.fan_out_many(spec.dead_letter_stream, letters)
    cp.productions.extend(productions)
    for letter in letters:
        body = json.loads(letter.value)
        cp.errors.append(json.dumps({
            "record_id": letter.record_id, "key": letter.key, "time": letter.timestamp,
            "exception_type": "BadEntry", "message": body["message"], "traceback": [],
            "attempts": 1, "outcome": "dead_letter", "range_id": 0}).encode())
    cp.counters["dead_lettered"] = cp.counters.get("dead_lettered", 0) + len(letters)
