"""The data model: records, timers and the IDs that make exactly-once work.

Timestamps are integer microseconds since the epoch, everywhere.
"""

from __future__ import annotations

import enum
import functools
import hashlib
from dataclasses import dataclass
from datetime import UTC, datetime

from millwheel.errors import InvalidSpecError

#: The smallest and largest representable event times; the low watermark of a
#: finished source is ``MAX_TIMESTAMP``.
MIN_TIMESTAMP = -(2**62)
MAX_TIMESTAMP = 2**62


def event_time(us: int) -> str:
    """An event time for people (``millwheel watermark``'s reasons): UTC ISO to the
    millisecond; ``-inf`` at or below :data:`MIN_TIMESTAMP` (no watermark yet)."""
    if us <= MIN_TIMESTAMP:
        return "-inf"
    try:
        return datetime.fromtimestamp(us / 1e6, tz=UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
    except (OverflowError, ValueError, OSError):
        return f"{us} µs"


@dataclass(frozen=True, slots=True)
class Record:
    """One datum on a stream: ``(key, value, timestamp)`` plus a unique ``record_id``.

    ``record_id`` may be left out (``""``) only for a record about to be injected: the
    injector gives it one (``ControllerClient.inject_records``, an Inject call without
    ``id``). Everywhere else a record carries its ID (:meth:`validate` refuses an empty
    one); give your own IDs to make re-injecting the same records a no-op."""

    key: str
    value: bytes
    timestamp: int
    record_id: str = ""

    def validate(self, where: str = "record") -> None:
        """Raise :class:`InvalidSpecError` naming ``where`` if the record is malformed."""
        if not isinstance(self.key, str):
            raise InvalidSpecError(f"{where}: key must be a string, got {type(self.key).__name__}")
        if not isinstance(self.value, bytes):
            raise InvalidSpecError(
                f"{where}: value must be bytes, got {type(self.value).__name__}"
            )
        if isinstance(self.timestamp, bool) or not isinstance(self.timestamp, int):
            raise InvalidSpecError(
                f"{where}: timestamp must be integer microseconds, "
                f"got {type(self.timestamp).__name__}"
            )
        if not MIN_TIMESTAMP <= self.timestamp <= MAX_TIMESTAMP:
            raise InvalidSpecError(f"{where}: timestamp {self.timestamp} is out of range")
        if not self.record_id:
            raise InvalidSpecError(f"{where}: record_id must not be empty")


def well_formed(key: object, value: object, timestamp: object, record_id: object) -> bool:
    """True when :meth:`Record.validate` of these fields would pass (exact types only).

    The hot path (injectors, ``produce``) checks this and calls ``validate``, which
    builds its message, only when it is False. Keep the two in step."""
    return (
        type(key) is str and type(value) is bytes and type(timestamp) is int
        and MIN_TIMESTAMP <= timestamp <= MAX_TIMESTAMP and bool(record_id)
    )


class TimeDomain(enum.StrEnum):
    """Event-time timers fire on the input low watermark, processing-time on the clock."""

    EVENT = "event"
    PROCESSING = "processing"


@dataclass(frozen=True, slots=True)
class Timer:
    """A durable per-key timer. ``(key, tag)`` identifies it; setting it again moves it.

    An event-time timer at ``time`` fires once the input low watermark is past it
    (``watermark > time``): every record with timestamp <= ``time`` has arrived.
    While pending, it holds the computation's output watermark at ``time`` unless
    ``hold`` is False (garbage-collection timers should not hold it).
    """

    key: str
    tag: str
    time: int
    domain: TimeDomain = TimeDomain.EVENT
    hold: bool = True


def derive_record_id(computation: str, cause: str, index: int) -> str:
    """A deterministic ID for the ``index``-th record produced by ``cause``.

    ``cause`` is the consumed record's ID or a timer's identity, so re-running the
    same work (weak productions, at-least-once, a retried Spark job) yields the same
    IDs and downstream deduplication drops the repeats.
    """
    h = _prefix_hash(computation).copy()  # = blake2b(f"{computation}\x1f{cause}\x1f{index}")
    h.update(f"{cause}\x1f{index}".encode())
    return h.hexdigest()


@functools.lru_cache(maxsize=1024)
def _prefix_hash(computation: str) -> hashlib.blake2b:
    """The hash state after ``computation + "\x1f"``: copied per ID instead of rehashed."""
    return hashlib.blake2b(f"{computation}\x1f".encode(), digest_size=12)


def timer_cause(timer: Timer) -> str:
    return f"timer\x1f{timer.key}\x1f{timer.tag}\x1f{timer.time}"
