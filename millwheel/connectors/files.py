"""A directory of JSON-lines files as a source: ``path`` is a glob (``in/*.jsonl``,
relative to the spec file), files are read in name order and a file that appears later
is picked up when the reader gets to it, so name new files so that they sort last (a
timestamp or a counter). Only complete lines (ending in a newline) are read: a file
being appended to is read up to its last full line, and on; once a later file is there,
an unfinished last line is given up (dead-lettered) and the next file read.

The position is the file's name and the byte offset after an entry's line; a line
without ``id`` gets the record ID ``file:NAME:OFFSET``. A file that sorts before the
one being read when it appears is never read, and a file rewritten in place is not
read again: append, or add files.
"""

from __future__ import annotations

import glob
import json
import os
import time
from pathlib import Path
from typing import Any

from millwheel.connectors import Entry
from millwheel.connectors.envelope import json_entry
from millwheel.errors import ConnectorError


class FilesSource:
    def __init__(self, settings: dict[str, Any], base: str) -> None:
        path = Path(settings["path"])
        self.pattern = str(path if path.is_absolute() else Path(base) / path)
        self.until_end = settings.get("until") == "end"
        self.name = ""
        self.offset = 0
        self.end: tuple[str, int] | None = None

    def _files(self) -> list[str]:
        return sorted(p for p in glob.glob(self.pattern) if os.path.isfile(p))

    def open(self, position: str | None) -> None:
        if position:
            self.name, self.offset = json.loads(position)
        if self.until_end:
            files = self._files()
            self.end = (files[-1], _last_full_line_end(files[-1])) if files else ("", 0)

    def read_batch(self, max_records: int, wait_s: float) -> list[Entry]:
        entries: list[Entry] = []
        try:
            while len(entries) < max_records and not self.finished():
                files = [f for f in self._files() if f >= self.name]
                if not files:
                    break
                if files[0] != self.name:
                    self.name, self.offset = files[0], 0
                entries += self._read(max_records - len(entries))
                later = [f for f in files if f > self.name]
                if len(entries) < max_records and later and self._read_all():
                    if not self._at_end():  # a last line never finished: a later file is there
                        self.offset = os.path.getsize(self.name)
                        entries.append(Entry(json.dumps([self.name, self.offset]),
                                             {"__bad__": b"incomplete last line (a later file appeared)"}))
                    self.name, self.offset = later[0], 0
                    continue
                break
        except OSError as exc:
            raise ConnectorError(f"files source {self.pattern!r}: {exc.strerror}: {exc.filename}") from None
        if not entries and not self.finished():
            time.sleep(wait_s)
        return entries

    def _at_end(self) -> bool:
        return self.offset >= os.path.getsize(self.name)

    def _read_all(self) -> bool:
        """Every complete line of the current file read."""
        return self.offset >= _last_full_line_end(self.name)

    def _read(self, n: int) -> list[Entry]:
        out: list[Entry] = []
        limit = self.end[1] if self.end is not None and self.end[0] == self.name else None
        with open(self.name, "rb") as fh:
            fh.seek(self.offset)
            while len(out) < n and (limit is None or self.offset < limit):
                line = fh.readline()
                if not line.endswith(b"\n"):
                    break  # none, or a line still being written
                self.offset += len(line)
                if line.strip():
                    out.append(json_entry(json.dumps([self.name, self.offset]), line))
        return out

    def record_id(self, entry: Entry) -> str:
        name, offset = json.loads(entry.position)
        return f"file:{os.path.basename(name)}:{offset}"

    def finished(self) -> bool:
        return self.end is not None and (self.name, self.offset) >= self.end

    def close(self) -> None:
        pass


def _last_full_line_end(path: str) -> int:
    """The offset after the file's last newline (a last line still being written is not
    part of what ``until: end`` reads)."""
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        pos = size
        while pos > 0:
            start = max(0, pos - 65536)
            fh.seek(start)
            chunk = fh.read(pos - start)
            i = chunk.rfind(b"\n")
            if i >= 0:
                return start + i + 1
            pos = start
    return 0
