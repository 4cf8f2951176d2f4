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

**A value larger than a frame** (a key's state, a record's value, an error's JSON)
is not written inline: :meth:`Writer.value` writes it as ``part`` frames of at most
:data:`PART_BYTES` bytes each (``{"t": "part", "data": base64, "last": bool}``, the
last of a value marked), and the frame that holds it carries a reference
``{"split": j, "bytes": n}`` in the value's place: the j-th value (from 0) whose parts
came since the frame before it, ``n`` bytes long. :func:`frames` reassembles them and
hands the frame on with the value's bytes in the reference's place (``bytes``, where
an inline value is base64 text), so a reader holds the value itself and about one
part beyond it, whatever its size, and a writer one part (issue 34, item 4: one key's
state over ~12 MiB made every savepoint fail). References are looked for only in a
frame's ``items``, ``recent`` and ``attempts``; every value of the parts before a frame
must be referenced by it exactly once, and together they are at most
:data:`MAX_VALUE_BYTES` (what a restore holds in memory at once).

Part frames came without a format version bump: a file without a value over
:data:`PART_BYTES` is byte for byte what earlier writers wrote (values inline, up to
the frame's limit), and earlier readers still read it; an earlier reader refuses a file
with part frames at its check ("unknown frame type (a newer savepoint format?)"),
writing nothing.

Bounds (a restore reads a file it did not write): the file as a whole is at most
:data:`MAX_FILE_BYTES` (the controller spools it to disk, never into memory, up to its
--max-restore-bytes, :data:`DEFAULT_MAX_RESTORE_BYTES` by default), one frame at most
:data:`MAX_FRAME_BYTES` and at least :data:`MIN_FRAME_BYTES`; :class:`Verifier`
checks the structure as the bytes arrive, :mod:`millwheel.savepoint.restore` each
frame's fields.
"""

from __future__ import annotations

import base64
import binascii
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
#: What a controller takes by default (its --max-restore-bytes, at most MAX_FILE_BYTES).
DEFAULT_MAX_RESTORE_BYTES = 16 << 30
#: The largest frame: what :mod:`millwheel.savepoint.capture` writes stays near 1 MiB.
MAX_FRAME_BYTES = 16 << 20
#: The smallest frame: the end frame, ``{"t":"end","frames":0}``; a frame of any other
#: type carries more fields. Shorter ones (an empty one) are refused as they arrive.
MIN_FRAME_BYTES = len(b'{"t":"end","frames":0}')
READ_BYTES = 1 << 20  #: what :func:`verify` reads at a time
#: The largest value written inline, and the bytes of one part frame of a larger one
#: (about 1.4 MiB of base64 in its frame).
PART_BYTES = 1 << 20
#: The most bytes of split values one frame may reference (each value, and all of them
#: together): a reader holds them in memory until that frame. Redis keeps no value over
#: 512 MiB (its proto-max-bulk-len), so no store a savepoint is taken of holds a larger
#: one; a key's state is bounded below it where it is written
#: (:data:`millwheel.limits.MAX_STATE_BYTES`).
MAX_VALUE_BYTES = 512 << 20
#: Where :func:`frames` looks for split values' references.
SPLIT_FIELDS = ("items", "recent", "attempts")


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
        self._split = 0  # values written as parts since the last frame of another type
        self._write(MAGIC + struct.pack(">I", FORMAT_VERSION))

    def _write(self, data: bytes) -> None:
        self.hash.update(data)
        self.out.write(data)
        self.bytes += len(data)

    def frame(self, obj: dict[str, Any]) -> None:
        """One frame; the values :meth:`value` split since the frame before must be
        referenced in this one (its ``items``, ``recent`` or ``attempts``), each once."""
        if self._split and obj.get("t") != "part":
            got = sorted(ref["split"] for ref in _references(obj))
            if got != list(range(self._split)):
                raise SavepointFileError(f"savepoint frame of type {obj.get('t')!r} references split values "
                                         f"{got}, not the {self._split} written as parts before it")
            self._split = 0
        data = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()
        if len(data) > MAX_FRAME_BYTES:
            raise SavepointFileError(f"savepoint frame of type {obj.get('t')!r} is {len(data)} bytes, over "
                                     f"the limit of {MAX_FRAME_BYTES}")
        self._write(struct.pack(">I", len(data)) + data)
        self.frames += 1

    def value(self, data: bytes, what: str) -> str | dict[str, int]:
        """``data`` as a frame field: base64 text if it is at most :data:`PART_BYTES`,
        else written now as part frames, and the reference to put in its place (in the
        next frame of another type; ``what`` names it in a refusal). A value over
        :data:`MAX_VALUE_BYTES` is refused (no restore would take it)."""
        if len(data) <= PART_BYTES:
            return base64.b64encode(data).decode()
        if len(data) > MAX_VALUE_BYTES:
            raise SavepointFileError(f"savepoint: {what} is {len(data)} bytes, over the limit of "
                                     f"{MAX_VALUE_BYTES} bytes a savepoint carries for one value")
        view = memoryview(data)
        for i in range(0, len(data), PART_BYTES):
            self.frame({"t": "part", "data": base64.b64encode(view[i:i + PART_BYTES]).decode(),
                        "last": i + PART_BYTES >= len(data)})
        ref = {"split": self._split, "bytes": len(data)}
        self._split += 1
        return ref

    def finish(self) -> str:
        """Write the end frame and the digest; returns the digest (hex)."""
        if self._split:
            raise SavepointFileError(f"savepoint: {self._split} values written as parts that no frame references")
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
    check = Verifier()
    while data := _read_exact(f, READ_BYTES):
        check.feed(data)
    return check.finish()


class Verifier:
    """:func:`verify` fed as the bytes arrive (a restore checks an upload while it is
    received): :meth:`feed` raises :class:`SavepointFileError` at the first byte that
    cannot be a savepoint's (the magic and the format version as soon as those bytes
    are in, a frame's length as soon as its four bytes are), :meth:`finish` after the
    last byte returns the digest (hex) or says where the file was cut short.

    A frame's content is not buffered (only an end frame's, to count its frames), and
    frames wholly inside one piece are stepped over in a tight loop and hashed in one
    call: the work is one step per frame, and a frame is at least
    :data:`MIN_FRAME_BYTES` (an empty one is refused at once, issue 34, item 7)."""

    def __init__(self) -> None:
        self.hash = hashlib.sha256()
        self.pos = 0  #: bytes accepted so far
        self.frames = 0  #: frames before the end frame seen so far
        self.digest: bytes | None = None  #: once the end frame and the checksum are in
        self._part = bytearray()  # the head, a length, a frame's start, an end frame or the checksum, collected
        self._want = HEAD  # how many bytes _part is collected to
        self._state = _HEAD
        self._frame = 0  # the current frame's length (_PEEK, _END_FRAME)
        self._skip = 0  # bytes of the current frame still to step over (_SKIP)

    @property
    def headed(self) -> bool:
        """Magic and format version are in and right."""
        return self._state != _HEAD

    def feed(self, data: bytes) -> None:
        view = memoryview(data)
        i, n = 0, len(view)
        while i < n:
            state = self._state
            if state == _SKIP:
                take = min(self._skip, n - i)
                self.hash.update(view[i:i + take])
                i += take
                self.pos += take
                self._skip -= take
                if not self._skip:
                    self._next_frame()
                continue
            if state == _LEN and not self._part:  # whole frames in this piece: one step each
                i = self._whole_frames(data, view, i, n)
                continue
            if state == _DONE:
                raise SavepointFileError(f"savepoint file corrupt: unexpected bytes after its checksum (byte "
                                         f"{self.pos})")
            take = min(self._want - len(self._part), n - i)
            self._part += view[i:i + take]
            i += take
            self.pos += take
            if state == _HEAD and not MAGIC.startswith(bytes(self._part[:len(MAGIC)])):
                raise SavepointFileError(f"not a millwheel savepoint: it starts with {bytes(self._part[:16])!r}, "
                                         f"not {MAGIC!r}")
            if len(self._part) == self._want:
                part = bytes(self._part)
                self._part.clear()
                self._complete(state, part)

    def _whole_frames(self, data: bytes, view: memoryview, i: int, n: int) -> int:
        start = i
        frames = self.frames
        try:
            while i + 4 <= n:
                size = _LENGTH.unpack_from(data, i)[0]
                if not MIN_FRAME_BYTES <= size <= MAX_FRAME_BYTES or data.startswith(_END_START, i + 4) \
                        or i + 4 + size > n:
                    break  # refused, an end frame or one going on in the next piece: step by step
                i += 4 + size
                frames += 1
        finally:
            self.hash.update(view[start:i])
            self.pos += i - start
            self.frames = frames
        if i + 4 <= n:  # the length of a frame refused or stepped through (_complete hashes it)
            self.pos += 4
            self._complete(_LEN, bytes(view[i:i + 4]))
            return i + 4
        self._part += view[i:n]  # part of a length
        self.pos += n - i
        return n

    def _complete(self, state: int, part: bytes) -> None:
        if state == _HEAD:
            version = _LENGTH.unpack(part[len(MAGIC):])[0]
            if version != FORMAT_VERSION:
                raise SavepointFileError(f"savepoint format version {version}: this millwheel reads version "
                                         f"{FORMAT_VERSION} only")
            self.hash.update(part)
            self._next_frame()
        elif state == _LEN:
            size = _LENGTH.unpack(part)[0]
            at = self.pos - 4
            if size > MAX_FRAME_BYTES:
                raise SavepointFileError(f"savepoint file corrupt: frame {self.frames} at byte {at} claims {size} "
                                         f"bytes, over the limit of {MAX_FRAME_BYTES}")
            if size < MIN_FRAME_BYTES:
                raise SavepointFileError(f"savepoint file corrupt: frame {self.frames} at byte {at} is {size} "
                                         f"bytes, shorter than any frame (at least {MIN_FRAME_BYTES}: the format "
                                         "writes no empty frame)")
            self.hash.update(part)
            self._frame = size
            self._state, self._want = _PEEK, len(_END_START)
        elif state == _PEEK:
            self.hash.update(part)
            if part == _END_START:  # perhaps the end frame: kept whole to read its count
                self._state, self._want = _END_FRAME, self._frame
                self._part += part
            else:
                self._state, self._skip = _SKIP, self._frame - len(part)
        elif state == _END_FRAME:
            self.hash.update(part[len(_END_START):])
            try:
                end = json.loads(part)
            except ValueError:
                end = None
            if isinstance(end, dict) and end.get("t") == "end":
                if end.get("frames") != self.frames:
                    raise SavepointFileError(f"savepoint file corrupt: its end frame counts {end.get('frames')!r} "
                                             f"frames, the file has {self.frames}")
                self._state, self._want = _DIGEST, DIGEST
            else:
                self._next_frame()
        elif state == _DIGEST:
            if part != self.hash.digest():
                raise SavepointFileError("savepoint file corrupt: its SHA-256 checksum does not match its "
                                         f"contents ({self.pos} bytes; a byte changed somewhere)")
            self.digest = part
            self._state = _DONE

    def _next_frame(self) -> None:
        if self._state != _HEAD:
            self.frames += 1
        self._state, self._want = _LEN, 4

    def finish(self) -> str:
        """The digest (hex) of a whole file; SavepointFileError if it was cut short."""
        state, have = self._state, len(self._part)
        if state == _DONE and self.digest is not None:
            return self.digest.hex()
        if state == _HEAD:
            if have < len(MAGIC):
                raise SavepointFileError(f"not a millwheel savepoint: it starts with {bytes(self._part)!r}, "
                                         f"not {MAGIC!r}")
            raise SavepointFileError(f"savepoint file truncated: {self.pos} bytes, shorter than its header")
        if state == _LEN:
            raise SavepointFileError(f"savepoint file truncated: it ends at byte {self.pos} inside frame "
                                     f"{self.frames}'s length, before its end frame (corrupt or cut short)")
        if state == _DIGEST:
            raise SavepointFileError(f"savepoint file truncated: {have} of the {DIGEST} checksum bytes after the "
                                     f"end frame (byte {self.pos - have})")
        missing = self._skip if state == _SKIP else self._want - have + (
            self._frame - len(_END_START) if state == _PEEK else 0)
        raise SavepointFileError(f"savepoint file truncated: frame {self.frames} needs {self._frame} bytes, "
                                 f"{missing} more than the file has (the file is {self.pos} bytes)")


_HEAD, _LEN, _PEEK, _SKIP, _END_FRAME, _DIGEST, _DONE = range(7)
_LENGTH = struct.Struct(">I")
_END_START = b'{"t":"end"'


def frames(f: IO[bytes]) -> Iterator[dict[str, Any]]:
    """The frames of a file :func:`verify` accepted (``f`` at its start), end frame
    excluded, split values reassembled (part frames are not yielded). Each must be a
    JSON object with a string "t"."""
    for _index, obj in numbered_frames(f):
        yield obj


def numbered_frames(f: IO[bytes]) -> Iterator[tuple[int, dict[str, Any]]]:
    """:func:`frames` with each frame's number in the file (part frames counted, as a
    refusal names them)."""
    f.seek(HEAD)
    index = 0
    values: list[bytes] = []  # split values complete since the last frame of another type
    pieces: list[bytes] = []  # the one being reassembled
    held = 0  # bytes in values and pieces
    first = 0  # the frame number of the first part held
    while True:
        at = f.tell()
        head = _read_exact(f, 4)
        if len(head) < 4:
            raise SavepointFileError(f"savepoint file truncated: it ends at byte {at}, inside frame {index}'s "
                                     "length")
        n = struct.unpack(">I", head)[0]
        data = _read_exact(f, n)
        if len(data) < n:
            raise SavepointFileError(f"savepoint file truncated: frame {index} at byte {at} needs {n} bytes, "
                                     f"{n - len(data)} more than the file has")
        try:
            obj = json.loads(data)
        except ValueError as exc:
            raise SavepointFileError(f"savepoint frame {index} at byte {at}: not JSON ({exc})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("t"), str):
            raise SavepointFileError(f"savepoint frame {index} at byte {at}: not an object with a type 't'")
        if obj["t"] == "part":
            if not values and not pieces:
                first = index
            piece = _part(obj, index, at)
            held += len(piece)
            if held > MAX_VALUE_BYTES:
                raise SavepointFileError(f"savepoint frame {index} at byte {at}: the values split from frame "
                                         f"{first} on are over the limit of {MAX_VALUE_BYTES} bytes")
            pieces.append(piece)
            if obj.get("last") is True:
                values.append(b"".join(pieces))
                pieces = []
            index += 1
            continue
        if pieces:
            raise SavepointFileError(f"savepoint frame {index} at byte {at}: the value split from frame "
                                     f"{first} on has no last part before it")
        if values:
            _fill(obj, values, index, at, first)
            values, held = [], 0
        if obj["t"] == "end":
            return
        yield index, obj
        index += 1


def _part(obj: dict[str, Any], index: int, at: int) -> bytes:
    data, last = obj.get("data"), obj.get("last")
    if not isinstance(data, str) or not isinstance(last, bool) or set(obj) != {"t", "data", "last"}:
        raise SavepointFileError(f"savepoint frame {index} at byte {at}: a part must be "
                                 '{"t": "part", "data": base64, "last": bool}')
    try:
        piece = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise SavepointFileError(f"savepoint frame {index} at byte {at}: a part's data is not valid base64") from None
    if not piece or len(piece) > PART_BYTES:
        raise SavepointFileError(f"savepoint frame {index} at byte {at}: a part of {len(piece)} bytes (1.."
                                 f"{PART_BYTES})")
    return piece


def _references(obj: dict[str, Any]) -> list[dict[str, Any]]:
    """The split values' references in ``obj``'s :data:`SPLIT_FIELDS` (nested lists)."""
    out: list[dict[str, Any]] = []
    for name in SPLIT_FIELDS:
        stack = [obj.get(name)]
        while stack:
            v = stack.pop()
            if isinstance(v, list):
                stack.extend(v)
            elif isinstance(v, dict) and set(v) == {"split", "bytes"}:
                out.append(v)
    return out


def _fill(obj: dict[str, Any], values: list[bytes], index: int, at: int, first: int) -> None:
    """Put each of ``values`` in its reference's place in ``obj`` (each referenced once,
    with its length)."""
    used: set[int] = set()
    for name in SPLIT_FIELDS:
        stack = [obj.get(name)]
        while stack:
            v = stack.pop()
            if not isinstance(v, list):
                continue
            for i, x in enumerate(v):
                if isinstance(x, list):
                    stack.append(x)
                elif isinstance(x, dict) and set(x) == {"split", "bytes"}:
                    j = x["split"]
                    if not isinstance(j, int) or isinstance(j, bool) or not 0 <= j < len(values) \
                            or j in used or x["bytes"] != len(values[j]):
                        raise SavepointFileError(f"savepoint frame {index} at byte {at}: a reference {x} to none "
                                                 f"of the {len(values)} values split from frame {first} on (or "
                                                 "to one referenced already)")
                    v[i] = values[j]
                    used.add(j)
    if len(used) != len(values):
        raise SavepointFileError(f"savepoint frame {index} at byte {at}: it references {len(used)} of the "
                                 f"{len(values)} values split from frame {first} on (each must be, once)")
