"""Replayable record sources behind injectors.

A source is read from an opaque cursor and returns the next cursor; the injector
checkpoints the cursor atomically with the records it produced, so after a crash it
resumes exactly where its last checkpoint ended. Each batch also carries the
source's low watermark: a promise that every later record has timestamp >= it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence

from millwheel import jsonvalue
from millwheel.errors import InvalidSpecError
from millwheel.record import MAX_TIMESTAMP, MIN_TIMESTAMP, Record


@dataclass(frozen=True)
class SourceBatch:
    records: list[Record]
    cursor: bytes
    watermark: int
    done: bool
    #: Dead letters for entries that were not records (connector sources only): they
    #: go to the injector's dead-letter stream in the same checkpoint.
    rejected: list[Record] = dataclasses.field(default_factory=list)


class Source(Protocol):
    def read(self, cursor: bytes | None, max_records: int) -> SourceBatch: ...


class BoundedDisorder:
    """Watermark for sources whose event times are at most ``max_disorder_us`` out of
    order: the largest timestamp seen so far minus the bound."""

    def __init__(self, max_disorder_us: int) -> None:
        self.max_disorder_us = max_disorder_us

    def watermark(self, max_seen: int) -> int:
        return MIN_TIMESTAMP if max_seen == MIN_TIMESTAMP else max_seen - self.max_disorder_us


class ListSource:
    """Records from memory (tests, embedding): cursor is the next index."""

    def __init__(self, records: Sequence[Record], max_disorder_us: int = 0) -> None:
        self.records = list(records)
        self.disorder = BoundedDisorder(max_disorder_us)

    def read(self, cursor: bytes | None, max_records: int) -> SourceBatch:
        state = json.loads(cursor) if cursor else {"i": 0, "max": MIN_TIMESTAMP}
        i = state["i"]
        batch = self.records[i : i + max_records]
        max_seen = max([state["max"], *(r.timestamp for r in batch)])
        done = i + len(batch) >= len(self.records)
        new_cursor = json.dumps({"i": i + len(batch), "max": max_seen}).encode()
        wm = MAX_TIMESTAMP if done else self.disorder.watermark(max_seen)
        return SourceBatch(batch, new_cursor, wm, done)


class JsonLinesSource:
    """A file of JSON lines ``{"key", "value", "timestamp"[, "id"]}``; value is text or
    JSON. Cursor: byte offset and line number. IDs default to ``FILE:LINE``."""

    def __init__(self, path: str | Path, max_disorder_us: int = 0) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise InvalidSpecError(f"source file {str(self.path)!r} does not exist")
        self.disorder = BoundedDisorder(max_disorder_us)

    def read(self, cursor: bytes | None, max_records: int) -> SourceBatch:
        state = json.loads(cursor) if cursor else {"offset": 0, "line": 0, "max": MIN_TIMESTAMP}
        records: list[Record] = []
        offset, line_no, max_seen = state["offset"], state["line"], state["max"]
        with self.path.open("rb") as fh:
            fh.seek(offset)
            while len(records) < max_records:
                line = fh.readline()
                if not line:
                    break
                offset += len(line)
                line_no += 1
                if not line.strip():
                    continue
                record = parse_json_record(line, f"{self.path}:{line_no}")
                records.append(record)
                max_seen = max(max_seen, record.timestamp)
            done = not fh.readline()
        new_cursor = json.dumps({"offset": offset, "line": line_no, "max": max_seen}).encode()
        wm = MAX_TIMESTAMP if done else self.disorder.watermark(max_seen)
        return SourceBatch(records, new_cursor, wm, done)


_DECODE = json.JSONDecoder().decode


def parse_json_record(line: bytes | str, where: str) -> Record:
    """One JSON-lines record, with errors that name the file and line."""
    obj = jsonvalue.fast(line)  # orjson where it answers as json does (millwheel/jsonvalue.py)
    if obj is jsonvalue.NOT_FAST:
        try:
            # a decoder made once, on text: json.loads built the call and guessed the bytes'
            # encoding per line (a fifth of reading a file of records); a BOM is allowed
            obj = _DECODE(line if isinstance(line, str) else line.decode("utf-8-sig"))
        except ValueError as exc:  # UnicodeDecodeError too
            raise InvalidSpecError(f"{where}: not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise InvalidSpecError(f"{where}: expected a JSON object")
    for field in ("key", "timestamp"):
        if field not in obj:
            raise InvalidSpecError(f"{where}: missing field {field!r}")
    value = obj.get("value", "")
    value_bytes = value.encode() if isinstance(value, str) else json.dumps(value).encode()
    ts = obj["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, int):
        raise InvalidSpecError(f"{where}: timestamp must be integer microseconds, got {ts!r}")
    key = obj["key"]
    if not isinstance(key, str) or not key:
        raise InvalidSpecError(f"{where}: key must be a non-empty string, got {key!r}")
    record = Record(key, value_bytes, ts, str(obj.get("id") or where))
    record.validate(where)
    return record
