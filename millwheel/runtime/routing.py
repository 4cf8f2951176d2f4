"""Where a produced record goes: every consumer of its stream, re-keyed, plus the log.

Fan-out happens when a record is produced, so each outbox entry is addressed to one
consumer and carries that consumer's key; sender and receiver then agree on the key
range (and so the owner and token) without running user code again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from millwheel.errors import MillWheelError
from millwheel.importing import AllowList
from millwheel.input_tag import TAGGING_OPERATORS, tag_prefix
from millwheel.keys import KeyExtractor, KeyFn
from millwheel.record import Record
from millwheel.state.protocol import Production
from millwheel.topology import Topology

LOG_PREFIX = "log:"
#: The key of a record whose consumer's key extractor failed on it: this prefix, the
#: stream and the producer's key. It still goes to the consumer (to a fixed range), whose
#: error policy dead-letters or skips it without running code; so a data error never
#: fails the producer (an ``Inject`` call, or the upstream computation).
KEY_ERROR_PREFIX = "\x00key-error\x1f"
_IDENTITY = KeyExtractor("key").compile()

_new = object.__new__
_set_consumer = Production.__dict__["consumer"].__set__
_set_stream = Production.__dict__["stream"].__set__
_set_record = Production.__dict__["record"].__set__


_set_key = Record.__dict__["key"].__set__
_set_value = Record.__dict__["value"].__set__
_set_timestamp = Record.__dict__["timestamp"].__set__
_set_record_id = Record.__dict__["record_id"].__set__


def record_of(key: str, value: bytes, timestamp: int, record_id: str) -> Record:
    """``Record(key, value, timestamp, record_id)`` built through its slots, as
    :func:`production` (no validation: callers validate)."""
    r = _new(Record)
    _set_key(r, key)
    _set_value(r, value)
    _set_timestamp(r, timestamp)
    _set_record_id(r, record_id)
    return r


def production(consumer: str, stream: str, record: Record) -> Production:
    """``Production(consumer, stream, record)``, the same frozen object, built through its
    slots: the dataclass ``__init__`` goes through ``object.__setattr__`` per field and
    cost twice as much, once per record on the hot path."""
    p = _new(Production)
    _set_consumer(p, consumer)
    _set_stream(p, stream)
    _set_record(p, record)
    return p


@dataclass(frozen=True)
class Route:
    consumer: str
    key_fn: KeyFn | None  # None for the stream log


class Router:
    def __init__(self, topology: Topology, allow: AllowList | None = None) -> None:
        self._routes: dict[str, list[Route]] = {}
        for spec in topology.computations:
            for inp in spec.inputs:
                self._routes.setdefault(inp.stream, []).append(
                    Route(spec.name, _compiled(inp.key_extractor, allow))
                )
        for stream in topology.logged_streams():
            self._routes.setdefault(stream, []).append(Route(LOG_PREFIX + stream, None))
        # (stream, consumer) -> the prefix its values get (millwheel.input_tag)
        self._tags: dict[tuple[str, str], bytes] = {
            (inp.stream, spec.name): tag_prefix(inp.stream)
            for spec in topology.computations if spec.code.is_builtin and spec.code.name in TAGGING_OPERATORS
            for inp in spec.inputs
        }
        # (consumer, key function or None when the record keeps its key), per stream
        self._plain: dict[str, list[tuple[str, KeyFn | None]]] = {
            stream: [(r.consumer, None if r.key_fn in (None, _IDENTITY) else r.key_fn) for r in routes]
            for stream, routes in self._routes.items()
        }

    def fan_out(self, stream: str, record: Record) -> list[Production]:
        """``record`` addressed to every consumer of ``stream`` (re-keyed by its key
        extractor) and to the stream log if logged."""
        out = []
        tags = self._tags
        for consumer, key_fn in self._plain.get(stream, ()):
            if tags and (stream, consumer) in tags:
                out.append(production(consumer, stream, self._tagged(stream, consumer, key_fn, record)))
            elif key_fn is None:
                out.append(production(consumer, stream, record))
            else:
                try:
                    key = key_fn(record)
                    if type(key) is not str:
                        raise TypeError(f"key extractor returned {type(key).__name__}, not str")
                except Exception:  # noqa: BLE001 - any failure is the record's, for the consumer's policy
                    key = f"{KEY_ERROR_PREFIX}{stream}\x1f{record.key}"
                rec = record if key == record.key else record_of(key, record.value, record.timestamp, record.record_id)
                out.append(production(consumer, stream, rec))
        return out

    def _tagged(self, stream: str, consumer: str, key_fn: KeyFn | None, record: Record) -> Record:
        """``record`` keyed for ``consumer`` with its value tagged with ``stream``; a record
        whose key cannot be extracted is not tagged (its error path runs the extractor
        again on the value as produced, and no operator code sees it)."""
        key = record.key
        if key_fn is not None:
            try:
                key = key_fn(record)
                if type(key) is not str:
                    raise TypeError(f"key extractor returned {type(key).__name__}, not str")
            except Exception:  # noqa: BLE001 - any failure is the record's, for the consumer's policy
                return record_of(f"{KEY_ERROR_PREFIX}{stream}\x1f{record.key}", record.value,
                                 record.timestamp, record.record_id)
        return record_of(key, self._tags[(stream, consumer)] + record.value, record.timestamp, record.record_id)

    def key_error(self, consumer: str, record: Record) -> tuple[str, str, str] | None:
        """For a record routed with :data:`KEY_ERROR_PREFIX`: (the producer's key, the
        exception type, its message), found by running the consumer's key extractor
        again (it is deterministic); None if ``record`` is not such a record."""
        if not record.key.startswith(KEY_ERROR_PREFIX):
            return None
        stream, _, key = record.key[len(KEY_ERROR_PREFIX):].partition("\x1f")
        original = record_of(key, record.value, record.timestamp, record.record_id)
        for name, key_fn in self._plain.get(stream, ()):
            if name == consumer and key_fn is not None:
                try:
                    key_fn(original)
                except Exception as exc:  # noqa: BLE001 - reported, not raised
                    return key, type(exc).__name__, str(exc)
        return key, "KeyExtractionError", f"the key extractor of stream {stream!r} failed on the record"

    def fan_out_many(self, stream: str, records: Iterable[Record]) -> list[Production]:
        """:meth:`fan_out` of each record in turn, concatenated."""
        routes = self._plain.get(stream, ())
        if len(routes) == 1 and routes[0][1] is None and not self._tags:  # one consumer, keys kept
            consumer = routes[0][0]
            return [production(consumer, stream, record) for record in records]
        out: list[Production] = []
        for record in records:
            out.extend(self.fan_out(stream, record))
        return out


def _compiled(extractor: KeyExtractor, allow: AllowList | None) -> KeyFn:
    """The key function of ``extractor``. Under an allow-list (a service worker), one
    this process may not load (refused, or not importable here) fails on every record
    instead of failing the whole router, and with it every route of the worker: that
    consumer's records go to it as key errors (its error policy has them; a worker that
    may not run its extractor may not build it either). ``millwheel run`` (no
    allow-list) fails at once, as before."""
    try:
        return extractor.compile(allow)
    except MillWheelError as exc:
        if allow is None:
            raise
        kind, message = type(exc), str(exc)

        def refused(record: Record) -> str:
            raise kind(message)

        return refused
