"""Key extractors and the stable key -> key-range mapping.

A consumer re-keys every record it receives with the extractor of that input stream.
Ranges come from a stable hash (never Python's salted ``hash``), so every process
agrees on which range, and so which owner and sequencer token, a key belongs to.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Callable

from millwheel import jsonvalue
from millwheel.errors import InvalidSpecError
from millwheel.importing import AllowList, check_import_path, import_object
from millwheel.limits import MAX_KEY_EXTRACTOR_CHARS
from millwheel.record import Record

KeyFn = Callable[[Record], str]


def key_range(key: str, range_count: int) -> int:
    """The key range (0..range_count-1) that owns ``key``."""
    return zlib.crc32(key.encode()) % range_count


def misrouted(records: list[Record], range_id: int, range_count: int) -> str | None:
    """What is wrong if any record's key is not range ``range_id``'s under ``range_count``
    ranges, else None. A sender routes by the registry it holds; across a rescale it may
    hold the other key-range count, and a range must take only its own keys (their
    state, timers and consumed IDs are there)."""
    for rec in records:
        r = key_range(rec.key, range_count)
        if r != range_id:
            return (f"record {rec.record_id[:200]!r}: its key belongs to range {r} of {range_count}, "
                    f"not {range_id}")
    return None


@dataclass(frozen=True)
class KeyExtractor:
    """How a consumer derives its key from a record.

    ``spec`` is one of:
      * ``"key"`` — keep the producer's key (the default);
      * ``"json:FIELD"`` — the field ``FIELD`` of the JSON object in the value;
      * ``"import:pkg.module:function"`` — a function ``Record -> str``.
    """

    spec: str = "key"

    def __post_init__(self) -> None:
        self.check()  # fail at registration, not at the first record

    def check(self) -> None:
        """Check the spec's shape from its text alone: an ``import:`` path is never
        imported here (validation must not run user code)."""
        spec = self.spec
        if len(spec) > MAX_KEY_EXTRACTOR_CHARS:
            raise InvalidSpecError(f"key extractor of {len(spec)} characters, over the limit of "
                                   f"{MAX_KEY_EXTRACTOR_CHARS}")
        if spec == "key" or (spec.startswith("json:") and len(spec) > 5):
            return
        if spec.startswith("import:"):
            check_import_path(spec[7:], "key extractor")
            return
        raise InvalidSpecError(
            f"key extractor {spec!r} not understood; use 'key', 'json:FIELD' or "
            "'import:pkg.module:function'"
        )

    def import_paths(self) -> tuple[str, ...]:
        return (self.spec[7:],) if self.spec.startswith("import:") else ()

    def compile(self, allow: AllowList | None = None) -> KeyFn:
        """The key function; an ``import:`` function is imported (from an allowed
        module when ``allow`` is given)."""
        spec = self.spec
        if spec == "key":
            return _identity
        if spec.startswith("json:") and len(spec) > 5:
            return _json_field(spec[5:])
        fn = import_object(spec[7:], what="key extractor", allow=allow)
        if not callable(fn):
            raise InvalidSpecError(f"key extractor {spec!r} is not callable")
        return fn  # type: ignore[no-any-return]


def _identity(record: Record) -> str:
    return record.key


def _json_field(field: str) -> KeyFn:
    def extract(record: Record) -> str:
        try:
            value = jsonvalue.loads(record.value)[field]
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidSpecError(
                f"record {record.record_id}: cannot extract key field {field!r} "
                f"from its JSON value ({exc.__class__.__name__}: {exc})"
            ) from None
        return str(value)

    return extract
