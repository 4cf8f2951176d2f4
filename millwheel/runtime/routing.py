"""Where a produced record goes: every consumer of its stream, re-keyed, plus the log.

Fan-out happens when a record is produced, so each outbox entry is addressed to one
consumer and carries that consumer's key; sender and receiver then agree on the key
range (and so the owner and token) without running user code again.
"""

from __future__ import annotations

from dataclasses import dataclass

from millwheel.keys import KeyFn
from millwheel.record import Record
from millwheel.state.protocol import Production
from millwheel.topology import Topology

LOG_PREFIX = "log:"


@dataclass(frozen=True)
class Route:
    consumer: str
    key_fn: KeyFn | None  # None for the stream log


class Router:
    def __init__(self, topology: Topology) -> None:
        self._routes: dict[str, list[Route]] = {}
        for spec in topology.computations:
            for inp in spec.inputs:
                self._routes.setdefault(inp.stream, []).append(
                    Route(spec.name, inp.key_extractor.compile())
                )
        for stream in topology.logged_streams():
            self._routes.setdefault(stream, []).append(Route(LOG_PREFIX + stream, None))

    def fan_out(self, stream: str, record: Record) -> list[Production]:
        out = []
        for route in self._routes.get(stream, ()):
            if route.key_fn is None:
                out.append(Production(route.consumer, stream, record))
            else:
                key = route.key_fn(record)
                rec = record if key == record.key else Record(key, record.value, record.timestamp, record.record_id)
                out.append(Production(route.consumer, stream, rec))
        return out
