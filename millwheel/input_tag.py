"""Which input stream a record came from, for the operators that must know it.

A record reaches a computation without its stream: the data plane (``DeliverBatch``,
the outbox, dead letters) carries records, and a consumer of two streams cannot tell
them apart. The joins (``interval_join``, ``window_join``, ``stream_join``) must. The
router (:mod:`millwheel.runtime.routing`) is the one place every delivery passes
through, in ``millwheel run`` and the service alike, so for a consumer whose operator
is in :data:`TAGGING_OPERATORS` it prefixes the value it delivers with the stream's
name, after the key extractor ran (which sees the record as produced). The operator
strips the prefix (:func:`untag`). Dead letters and their replay keep the tagged
value, so a replayed record still has its side.

Stream names hold no ``\\x1f`` (:data:`millwheel.limits.NAME_CHARSET`), so the prefix
parses unambiguously whatever the value holds.
"""

from __future__ import annotations

#: Built-in operators whose records carry their input stream's name.
TAGGING_OPERATORS = frozenset({"interval_join", "window_join", "stream_join"})
_PREFIX = b"\x00mw-input\x1f"


def tag_prefix(stream: str) -> bytes:
    """The bytes put before a value delivered from ``stream``."""
    return _PREFIX + stream.encode() + b"\x1f"


def untag(value: bytes) -> tuple[str | None, bytes]:
    """``(stream, value as produced)``; ``(None, value)`` for a value not tagged."""
    if not value.startswith(_PREFIX):
        return None, value
    stream, sep, rest = value[len(_PREFIX):].partition(b"\x1f")
    if not sep:
        return None, value
    return stream.decode(errors="replace"), rest
