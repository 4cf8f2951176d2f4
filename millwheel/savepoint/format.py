"""The savepoint file: one portable, versioned, checksummed byte stream.

Layout (every integer big-endian)::

    MAGIC (12 bytes) | format version (u32) | frame* | end frame | SHA-256 (32 bytes)
    frame = length (u32) | JSON object (UTF-8, ``length`` bytes) with a "t" (type) field

The SHA-256 covers every byte before it (magic and version included), so a flipped
byte anywhere, a truncation or bytes appended are found by :func:`verify` before one
frame is believed. The last frame is ``{"t": "end", "frames": N}`` (the frames before
it), so a file cut exactly at a frame boundary is still found truncated. JSON keeps
the file readable by any language and independent of the store that wrote it (byte
values are base64); no record of one backend's layout is in it.

Bounds (a restore reads a file it did not write): the file as a whole is at most
:data:`MAX_FILE_BYTES` (the controller spools it to disk, never into memory), one
frame at most :data:`MAX_FRAME_BYTES`; :mod:`millwheel.savepoint.content` checks each
frame's fields.
"""

from __future__ import annotations

import hashlib
import json
import struct
from typing import IO, Any, Iterator

from millwheel.errors import InvalidSpecError

MAGIC = b"MWSAVEPOINT\x00"
FORMAT_VERSION = 1
HEAD = len(MAGIC) + 4
DIGEST = 32
#: The largest savepoint file a controller accepts (spooled to a temporary file).
MAX_FILE_BYTES = 64 << 30
#: The largest frame: what :mod:`millwheel.savepoint.capture` writes stays near 1 MiB.
MAX_FRAME_BYTES = 16 << 20


class SavepointFileError(InvalidSpecError):
    """The file is not a savepoint this version can read (foreign, corrupt, truncated,
    too large, or of another format version): INVALID_ARGUMENT, nothing written."""


class Writer:
    """Frames to a binary file object, hashing as it goes; :meth:`finish` seals it."""

    def __init__(self, out: IO[bytes]) -> None:
        self.out = out
        self.hash = hashlib.sha256()
        self.frames = 0
        self.bytes = 0
        self._write(MAGIC + struct.pack(">I", FORMAT_VERSION))

    def _write(self, data: bytes) -> None:
        self.hash.update(data)
        self.out.write(data)
        self.bytes += len(data)

    def frame(self, obj: dict[str, Any]) -> None:
        data = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()
        if len(data) > MAX_FRAME_BYTES:
            raise SavepointFileError(f"savepoint frame of type {obj.get('t')!r} is {len(data)} bytes, over "
                                     f"the limit of {MAX_FRAME_BYTES}")
        self._write(struct.pack(">I", len(data)) + data)
        self.frames += 1

    def finish(self) -> str:
        """Write the end frame and the digest; returns the digest (hex)."""
        frames = self.frames
        self.frame({"t": "end", "frames": frames})
        digest = self.hash.digest()
        self.out.write(digest)
        self.bytes += DIGEST
        return digest.hex()


def _read_exact(f: IO[bytes], n: int) -> bytes:
    data = f.read(n)
    return data if isinstance(data, bytes) else bytes(data)


def verify(f: IO[bytes], size: int) -> str:
    """Check a whole file (``size`` bytes, ``f`` at its start) before anything of it is
    used: magic, format version, frame structure, end frame, SHA-256. Returns the
    digest (hex); raises :class:`SavepointFileError` saying what is wrong and where."""
    if size > MAX_FILE_BYTES:
        raise SavepointFileError(f"savepoint file: {size} bytes, over the limit of {MAX_FILE_BYTES}")
    head = _read_exact(f, HEAD)
    if len(head) < len(MAGIC) or head[:len(MAGIC)] != MAGIC:
        raise SavepointFileError(f"not a millwheel savepoint: it starts with {head[:16]!r}, not {MAGIC!r}")
    if len(head) < HEAD:
        raise SavepointFileError(f"savepoint file truncated: {size} bytes, shorter than its header")
    version = struct.unpack(">I", head[len(MAGIC):])[0]
    if version != FORMAT_VERSION:
        raise SavepointFileError(f"savepoint format version {version}: this millwheel reads version "
                                 f"{FORMAT_VERSION} only")
    h = hashlib.sha256(head)
    pos, frames = HEAD, 0
    while True:
        raw = _read_exact(f, 4)
        if len(raw) < 4:
            raise SavepointFileError(f"savepoint file truncated: it ends at byte {size} inside frame "
                                     f"{frames}'s length, before its end frame (corrupt or cut short)")
        n = struct.unpack(">I", raw)[0]
        if n > MAX_FRAME_BYTES:
            raise SavepointFileError(f"savepoint file corrupt: frame {frames} at byte {pos} claims {n} bytes, "
                                     f"over the limit of {MAX_FRAME_BYTES}")
        data = _read_exact(f, n)
        if len(data) < n:
            raise SavepointFileError(f"savepoint file truncated: frame {frames} at byte {pos} needs {n} bytes, "
                                     f"{len(data)} remain (the file is {size} bytes)")
        h.update(raw)
        h.update(data)
        pos += 4 + n
        if data.startswith(b'{"t":"end"'):
            try:
                end = json.loads(data)
            except ValueError:
                end = None
            if isinstance(end, dict) and end.get("t") == "end":
                if end.get("frames") != frames:
                    raise SavepointFileError(f"savepoint file corrupt: its end frame counts {end.get('frames')!r} "
                                             f"frames, the file has {frames}")
                break
        frames += 1
    digest = _read_exact(f, DIGEST + 1)
    if len(digest) < DIGEST:
        raise SavepointFileError(f"savepoint file truncated: {len(digest)} of the {DIGEST} checksum bytes "
                                 f"after the end frame (byte {pos})")
    if len(digest) > DIGEST or size != pos + DIGEST:
        raise SavepointFileError(f"savepoint file corrupt: {size - pos - DIGEST} unexpected bytes after its "
                                 f"checksum (byte {pos + DIGEST})")
    if digest != h.digest():
        raise SavepointFileError("savepoint file corrupt: its SHA-256 checksum does not match its contents "
                                 f"({size} bytes; a byte changed somewhere)")
    return digest.hex()


def frames(f: IO[bytes]) -> Iterator[dict[str, Any]]:
    """The frames of a file :func:`verify` accepted (``f`` at its start), end frame
    excluded. Each must be a JSON object with a string "t"."""
    f.seek(HEAD)
    index = 0
    while True:
        n = struct.unpack(">I", _read_exact(f, 4))[0]
        data = _read_exact(f, n)
        try:
            obj = json.loads(data)
        except ValueError as exc:
            raise SavepointFileError(f"savepoint frame {index}: not JSON ({exc})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("t"), str):
            raise SavepointFileError(f"savepoint frame {index}: not an object with a type 't'")
        if obj["t"] == "end":
            return
        yield obj
        index += 1
