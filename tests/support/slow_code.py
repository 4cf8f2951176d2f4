"""User code for the liveness and deadline tests, loaded by workers by import path
(``tests.support.slow_code:CountAndMaybeSpin``) exactly as a user's class would be.

Each record increments its key's count (the state) and produces
``{"value": ..., "n": count}`` to stream ``out``: a record processed twice, or lost,
changes every later output of its key, so comparing outputs with a failure-free run
proves exactly-once. A record whose value is ``b"spin"`` first computes
``3999999 ** exponent``: one C call that holds the interpreter (GIL) for seconds,
which no thread of the worker can interrupt (``exponent=999_999`` takes ~7 s here).
A record whose value is ``b"spin-timer"`` sets an event-time timer at its timestamp;
the timer spins the same way, then produces ``{"timer": tag}``.
"""

from __future__ import annotations

import json

from millwheel.computation import Computation, Context
from millwheel.record import Record, Timer


class CountAndMaybeSpin(Computation):
    def __init__(self, exponent: int = 999_999) -> None:
        self.exponent = exponent
        self.spins = 0

    def process_record(self, ctx: Context, record: Record) -> None:
        if record.value == b"spin":
            _ = 3_999_999 ** self.exponent  # holds the GIL throughout
            self.spins += 1
        if record.value == b"spin-timer":
            ctx.set_timer("spin", record.timestamp)
        n = int(ctx.state or b"0") + 1
        ctx.set_state(str(n).encode())
        ctx.produce("out", ctx.key, json.dumps({"value": record.value.decode(), "n": n}).encode(),
                    record.timestamp)

    def process_timer(self, ctx: Context, timer: Timer) -> None:
        _ = 3_999_999 ** self.exponent
        ctx.produce("out", ctx.key, json.dumps({"timer": timer.tag}).encode(), timer.time)
