"""The limits on one Inject message (and one Write batch of parallel ingestion,
services/worker/ingest.py), checked before anything of it is sent on.

Every limit is a field of :class:`InjectLimits` with its default here and a flag of
``millwheel controller`` (docs/service.md, "Limits"); a message over one is refused
whole, with a message naming the message, the record and the limit:

* records per message (``--max-inject-records``): RESOURCE_EXHAUSTED;
* a value's size (``--max-value-bytes``): RESOURCE_EXHAUSTED;
* a key over 4 KiB, a record ID over 256 bytes (UTF-8), an empty key: INVALID_ARGUMENT;
* a timestamp or watermark more than ``--max-future-us`` ahead of the controller's
  clock (a typo'd year would otherwise move the injector's watermark past every later
  on-time record): INVALID_ARGUMENT;
* a watermark at or past the "done" value (2^62): INVALID_ARGUMENT; ``done`` is the
  only way to close an injector;
* injector and stream names as any other name (:mod:`millwheel.limits`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from millwheel.errors import InvalidSpecError, ResourceLimitError
from millwheel.limits import check_name
from millwheel.record import MAX_TIMESTAMP, MIN_TIMESTAMP

DAY_US = 86_400_000_000


@dataclass(frozen=True)
class InjectLimits:
    max_records: int = 100_000  #: records per Inject message
    max_value_bytes: int = 1024 * 1024
    max_key_bytes: int = 4096
    max_id_bytes: int = 256
    max_future_us: int = DAY_US  #: 0: no limit on how far ahead of the clock

    def check_names(self, msg: Any, index: int) -> None:
        """The injector and stream names of message ``index`` (before they are looked up,
        logged or put in a message)."""
        where = f"inject message {index}"
        if msg.injector:
            check_name(msg.injector, f"{where}: injector")
        if msg.stream:
            check_name(msg.stream, f"{where}: stream")

    def check_message(self, msg: Any, index: int, now_us: int, where: str = "") -> list[int]:
        """Every limit on message ``index`` (``where`` names it in errors); returns the
        indexes of records without an ID (the controller assigns them)."""
        where = where or f"inject message {index}"
        count = len(msg.records)
        if count > self.max_records:
            raise ResourceLimitError(f"{where}: {count} records, over the limit of "
                                     f"{self.max_records} records per message (--max-inject-records)")
        horizon = now_us + self.max_future_us if self.max_future_us > 0 else MAX_TIMESTAMP
        missing = []
        for j, m in enumerate(msg.records):
            at = f"{where} record {j}"
            if not m.key:
                raise InvalidSpecError(f"{at}: key must not be empty")
            if len(m.key) * 4 > self.max_key_bytes and len(m.key.encode()) > self.max_key_bytes:
                raise InvalidSpecError(f"{at}: key of {len(m.key.encode())} bytes, over the limit "
                                       f"of {self.max_key_bytes} bytes")
            if len(m.value) > self.max_value_bytes:
                raise ResourceLimitError(
                    f"{at}: value of key {m.key[:100]!r} is {len(m.value)} bytes, over the "
                    f"limit of {self.max_value_bytes} bytes (--max-value-bytes)")
            if not m.id:
                missing.append(j)
            elif len(m.id) * 4 > self.max_id_bytes and len(m.id.encode()) > self.max_id_bytes:
                raise InvalidSpecError(f"{at}: id of {len(m.id.encode())} bytes, over the limit of "
                                       f"{self.max_id_bytes} bytes")
            if not MIN_TIMESTAMP <= m.timestamp <= MAX_TIMESTAMP:
                raise InvalidSpecError(f"{at}: timestamp {m.timestamp} is out of range")
            if m.timestamp > horizon:
                raise InvalidSpecError(
                    f"{at} (key {m.key[:100]!r}, id {m.id[:100]!r}): timestamp {m.timestamp} ({_iso(m.timestamp)}) is "
                    f"more than --max-future-us={self.max_future_us} ahead of the "
                    f"service's clock ({_iso(now_us)})")
        if "watermark" in msg.DESCRIPTOR.fields_by_name and msg.HasField("watermark"):
            self.check_watermark(msg.watermark, where, now_us)
        return missing

    def check_watermark(self, wm: int, where: str, now_us: int,
                        done_hint: str = "to close the injector for good send done=true") -> None:
        """A watermark below the "done" value (2^62) and within ``--max-future-us`` of the
        clock (an Inject message's; a parallel-ingestion writer's, services/controller/writers.py)."""
        if wm >= MAX_TIMESTAMP or wm < MIN_TIMESTAMP:
            raise InvalidSpecError(f"{where}: watermark {wm} is out of range (below 2^62, the 'done' value); "
                                   f"{done_hint}")
        if self.max_future_us > 0 and wm > now_us + self.max_future_us:
            raise InvalidSpecError(
                f"{where}: watermark {wm} ({_iso(wm)}) is more than --max-future-us="
                f"{self.max_future_us} ahead of the controller's clock ({_iso(now_us)})")


def _iso(us: int) -> str:
    try:
        return datetime.fromtimestamp(us / 1e6, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    except (OverflowError, ValueError, OSError):
        return "out of calendar range"
