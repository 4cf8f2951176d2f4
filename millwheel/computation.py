"""The user-facing computation API (MillWheel §3).

A computation is user code with :meth:`Computation.process_record` and
:meth:`Computation.process_timer`. The framework calls them serially per key and
hands them a :class:`Context`; everything the code does through ``ctx`` (state,
timers, productions) becomes part of one atomic checkpoint, so user code never
talks to the store and never needs to be idempotent under strong productions.
"""

from __future__ import annotations

from typing import Protocol

from millwheel.record import Record, TimeDomain, Timer


class Context(Protocol):
    """What user code may see and do while it handles one record or timer of one key."""

    @property
    def key(self) -> str: ...

    @property
    def state(self) -> bytes | None:
        """This key's state as last written (None if it has none)."""
        ...

    def set_state(self, value: bytes | None) -> None:
        """Replace this key's state; ``None`` deletes it."""
        ...

    def set_timer(
        self,
        tag: str,
        time: int,
        domain: TimeDomain = TimeDomain.EVENT,
        *,
        hold: bool = True,
    ) -> None: ...

    def clear_timer(self, tag: str) -> None: ...

    def produce(self, stream: str, key: str, value: bytes, timestamp: int) -> None: ...

    @property
    def input_watermark(self) -> int:
        """The computation's input low watermark (µs) when this work started."""
        ...

    @property
    def is_late(self) -> bool:
        """True when the record being processed is behind the input low watermark."""
        ...

    @property
    def processing_time(self) -> int: ...


class Computation:
    """Base class for user computations; override one or both hooks.

    Two optional batch hooks may be defined as well (not on this base class, so the
    framework can tell whether a computation has them):

    * ``process_records(self, ctx, records)``: called once per key per input batch
      instead of ``process_record`` once per record. ``records`` holds that key's new
      records of the batch in arrival order, after deduplication and the late-data
      policy (dropped and routed records are not in it); it supports ``len()`` and
      iteration. While the code iterates ``records``, ``ctx`` follows the record of
      the current iteration: ``ctx.is_late`` is that record's, and records produced
      get the same IDs ``process_record`` would have given them. State read once
      through ``ctx.state`` and written once with ``ctx.set_state`` per batch is the
      point: a built-in aggregate decodes and encodes its state once per key per
      batch instead of once per record. A subclass that overrides ``process_record``
      below the class defining ``process_records`` gets the per-record path.
    * ``process_timer_batch(self, items)``: every due timer of a key range at once,
      as ``(ctx, timer)`` pairs (a Spark stage runs one job for them).
    """

    def process_record(self, ctx: Context, record: Record) -> None:
        """Handle one input record of ``ctx.key``."""

    def process_timer(self, ctx: Context, timer: Timer) -> None:
        """Handle one fired timer of ``ctx.key``."""
