"""Key extractors and the stable key -> key-range mapping.

A consumer re-keys every record it receives with the extractor of that input stream.
Ranges come from a stable hash (never Python's salted ``hash``), so every process
agrees on which range, and so which owner and sequencer token, a key belongs to.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from typing import Callable

from millwheel.errors import InvalidSpecError
from millwheel.importing import import_object
from millwheel.record import Record

KeyFn = Callable[[Record], str]


def key_range(key: str, range_count: int) -> int:
    """The key range (0..range_count-1) that owns ``key``."""
    return zlib.crc32(key.encode()) % range_count


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
        self.compile()  # fail at registration, not at the first record

    def compile(self) -> KeyFn:
        spec = self.spec
        if spec == "key":
            return _identity
        if spec.startswith("json:") and len(spec) > 5:
            return _json_field(spec[5:])
        if spec.startswith("import:"):
            fn = import_object(spec[7:], what="key extractor")
            if not callable(fn):
                raise InvalidSpecError(f"key extractor {spec!r} is not callable")
            return fn  # type: ignore[no-any-return]
        raise InvalidSpecError(
            f"key extractor {spec!r} not understood; use 'key', 'json:FIELD' or "
            "'import:pkg.module:function'"
        )


def _identity(record: Record) -> str:
    return record.key


def _json_field(field: str) -> KeyFn:
    def extract(record: Record) -> str:
        try:
            value = json.loads(record.value)[field]
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidSpecError(
                f"record {record.record_id}: cannot extract key field {field!r} "
                f"from its JSON value ({exc.__class__.__name__}: {exc})"
            ) from None
        return str(value)

    return extract
