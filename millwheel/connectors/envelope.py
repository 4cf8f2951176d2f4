"""An entry's fields as a record: the one convention every source shares.

An entry carries ``key`` (text), ``value`` (bytes, text or JSON), ``timestamp``
(integer microseconds, as decimal text) and optionally ``id``; a source's ``fields:``
setting maps these names onto an existing layout (``{timestamp: ts, key: user}``).
Without an ``id`` the record ID comes from the entry's position. An entry that breaks
the convention is not a record: :class:`BadEntry` says why, and the injector writes it
to its dead letters instead of stopping the source.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from millwheel.connectors import Entry
from millwheel.errors import MillWheelError
from millwheel.record import MAX_TIMESTAMP, MIN_TIMESTAMP, Record, well_formed


class BadEntry(MillWheelError):
    """A source entry that is not a record (missing field, bad timestamp, bad JSON)."""


def field_names(mapping: Mapping[str, Any]) -> dict[str, str]:
    names = {f: f for f in ("key", "value", "timestamp", "id")}
    names.update({k: str(v) for k, v in mapping.items()})
    return names


def entry_record(entry: Entry, names: Mapping[str, str], default_id: str) -> Record:
    """The record an entry holds, or BadEntry naming the position and what is wrong."""
    where = f"entry {entry.position}"
    fields = entry.fields
    if "__bad__" in fields:
        raise BadEntry(f"{where}: {fields['__bad__'].decode()}")
    for name in ("key", "timestamp"):
        if names[name] not in fields:
            raise BadEntry(f"{where}: missing field {names[name]!r}")
    try:
        key = fields[names["key"]].decode("utf-8")
        ts_text = fields[names["timestamp"]].decode("ascii").strip()
    except UnicodeDecodeError:
        raise BadEntry(f"{where}: key and timestamp must be text") from None
    if not ts_text.lstrip("-").isdigit():
        raise BadEntry(f"{where}: timestamp must be integer microseconds, got {ts_text[:40]!r}")
    ts = int(ts_text)
    if not MIN_TIMESTAMP < ts < MAX_TIMESTAMP:
        raise BadEntry(f"{where}: timestamp {ts} out of range")
    raw_id = fields.get(names["id"])
    record_id = raw_id.decode("utf-8", "replace") if raw_id else default_id
    value = fields.get(names["value"], b"")
    if not key or not well_formed(key, value, ts, record_id):
        raise BadEntry(f"{where}: key must be non-empty text and the record within limits")
    return Record(key, value, ts, record_id)


def json_entry(position: str, data: bytes) -> Entry:
    """An entry from a JSON object (a NATS message body, a JSON line): its values as
    bytes (strings as UTF-8, anything else as JSON). Bad JSON: an entry with no fields,
    so it fails as a missing key."""
    try:
        obj = json.loads(data)
    except ValueError:
        return Entry(position, {"__bad__": b"not valid JSON"})
    if not isinstance(obj, dict):
        return Entry(position, {"__bad__": b"not a JSON object"})
    return Entry(position, {str(k): v.encode() if isinstance(v, str) else json.dumps(v).encode()
                            for k, v in obj.items()})
