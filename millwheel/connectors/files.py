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

In the service a worker confines the source (:meth:`FilesSource.confine`) to the
directories its operator allowed (``--allow-source-path``,
:class:`~millwheel.connectors.spec.SourcePaths`): the pattern is checked again before
every listing (a directory swapped for a symbolic link after registration), a file
that is a symbolic link or lies through a directory resolving elsewhere is refused
(``PermissionDeniedError``: the source's failure, shown in status), and each file is
opened with ``O_NOFOLLOW`` and checked once open by what the descriptor names; a file
with more than one hard link is refused too (``fstat`` of the open descriptor): a hard
link made inside an allowed directory could name any file of the worker's user. Local
mode (``millwheel run``) reads any path the user's own process may.
"""

from __future__ import annotations

import errno
import glob
import json
import os
import stat
import time
from pathlib import Path
from typing import IO, Any

from millwheel.connectors import Entry
from millwheel.connectors.envelope import json_entry
from millwheel.connectors.spec import SourcePaths
from millwheel.errors import ConnectorError, PermissionDeniedError


class FilesSource:
    def __init__(self, settings: dict[str, Any], base: str) -> None:
        path = Path(settings["path"])
        self.pattern = str(path if path.is_absolute() else Path(base) / path)
        self.until_end = settings.get("until") == "end"
        self.name = ""
        self.offset = 0
        self.end: tuple[str, int] | None = None
        #: None: local mode, any path; else the directories a service's worker reads under
        self.allowed: SourcePaths | None = None

    def confine(self, allowed: SourcePaths) -> None:
        """Read only under ``allowed`` from now on (a service's worker, before the first
        read); the pattern is checked at once, as the controller checked it."""
        allowed.check_pattern(self.pattern, "files source path")
        self.allowed = allowed

    def _files(self) -> list[str]:
        if self.allowed is None:
            return sorted(p for p in glob.glob(self.pattern) if os.path.isfile(p))
        allowed = self.allowed
        allowed.check_pattern(self.pattern, "files source path")  # again: a directory may have been swapped
        files = []
        for p in glob.glob(self.pattern):
            try:
                mode = os.lstat(p).st_mode
            except FileNotFoundError:
                continue  # gone since the listing
            if not allowed.holds(os.path.realpath(os.path.dirname(p))):
                # a wildcard matched through a directory that is a link elsewhere: the
                # pattern is named, not what it found there
                raise allowed.refusal("files source path", self.pattern,
                                      "matches files through a directory that resolves elsewhere")
            if stat.S_ISLNK(mode):
                raise allowed.refusal("files source file", p, "is a symbolic link; the service reads "
                                                              "regular files only")
            if stat.S_ISREG(mode):
                files.append(p)
        return sorted(files)

    def _open(self, name: str) -> IO[bytes]:
        """``name`` opened for reading; confined: with ``O_NOFOLLOW`` (a symbolic link
        put in its place is not followed), non-blocking (a FIFO put there does not hang
        the worker), then checked by what the descriptor itself names (a directory
        swapped between the listing and the open is caught too) and refused if its inode
        has more than one name (a hard link: a name inside an allowed directory for a
        file that may lie anywhere), all judged on the open descriptor, so nothing can
        change between the check and the read."""
        if self.allowed is None:
            return open(name, "rb")  # noqa: SIM115 - the caller closes it
        allowed = self.allowed
        try:
            fd = os.open(name, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.EMLINK):  # O_NOFOLLOW met a link
                raise allowed.refusal("files source file", name, "is a symbolic link; the service reads "
                                                                 "regular files only") from None
            raise
        fh = os.fdopen(fd, "rb")
        try:
            proc = f"/proc/self/fd/{fd}"
            real = os.readlink(proc) if os.path.exists(proc) else os.path.realpath(name)
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or not allowed.holds(real):
                raise allowed.refusal("files source file", name, "is not a regular file under a directory "
                                                                 "this service reads files from")
            if st.st_nlink > 1:  # the same inode has a name elsewhere, which no path check can see
                raise allowed.refusal("files source file", name, f"has {st.st_nlink} hard links: a file "
                                      "reached by a hard link could be any file of the worker's user; "
                                      "copy it instead")
        except BaseException:
            fh.close()
            raise
        return fh

    def _size(self, name: str) -> int:
        with self._open(name) as fh:
            return os.fstat(fh.fileno()).st_size

    def open(self, position: str | None) -> None:
        if position:
            self.name, self.offset = json.loads(position)
        if self.until_end:
            files = self._files()
            if files:
                with self._open(files[-1]) as fh:
                    self.end = (files[-1], _last_full_line_end(fh))
            else:
                self.end = ("", 0)

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
                        self.offset = self._size(self.name)
                        entries.append(Entry(json.dumps([self.name, self.offset]),
                                             {"__bad__": b"incomplete last line (a later file appeared)"}))
                    self.name, self.offset = later[0], 0
                    continue
                break
        except (OSError, PermissionDeniedError) as exc:
            if entries:  # what was read before it goes out first; the next call meets it again
                return entries
            if isinstance(exc, PermissionDeniedError):
                raise
            raise ConnectorError(f"files source {self.pattern!r}: {exc.strerror}: {exc.filename}") from None
        if not entries and not self.finished():
            time.sleep(wait_s)
        return entries

    def _at_end(self) -> bool:
        return self.offset >= self._size(self.name)

    def _read_all(self) -> bool:
        """Every complete line of the current file read."""
        with self._open(self.name) as fh:
            return self.offset >= _last_full_line_end(fh)

    def _read(self, n: int) -> list[Entry]:
        out: list[Entry] = []
        limit = self.end[1] if self.end is not None and self.end[0] == self.name else None
        with self._open(self.name) as fh:
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


def _last_full_line_end(fh: IO[bytes]) -> int:
    """The offset after the open file's last newline (a last line still being written is
    not part of what ``until: end`` reads)."""
    pos = os.fstat(fh.fileno()).st_size
    while pos > 0:
        start = max(0, pos - 65536)
        fh.seek(start)
        chunk = fh.read(pos - start)
        i = chunk.rfind(b"\n")
        if i >= 0:
            return start + i + 1
        pos = start
    return 0
