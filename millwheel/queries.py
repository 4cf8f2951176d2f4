"""What a deployment's read queries answer, as core types.

The Python client (``millwheel_service.client``) returns these from ``watermarks()``
and ``state()``, so a script works with plain frozen dataclasses and
:class:`~millwheel.record.Timer` objects, never protocol messages. The attribute names
are those of the gRPC answers (docs/api.md), so code written against either reads the
same.
"""

from __future__ import annotations

from dataclasses import dataclass

from millwheel.record import MAX_TIMESTAMP, MIN_TIMESTAMP, Timer


@dataclass(frozen=True, slots=True)
class NodeWatermark:
    """The low watermarks of one node (a computation, or ``injector:NAME``), in µs.

    ``lag_us`` is how far ``low_watermark`` is behind the wall clock (0 when it is
    done or has seen nothing yet)."""

    node: str
    low_watermark: int
    input_low_watermark: int
    lag_us: int
    #: What holds ``low_watermark`` where it is, in words ("input: NODE", a range's own
    #: pending work, an injector's least live writer, ...); empty once done.
    held_by: str = ""

    @property
    def done(self) -> bool:
        """True once no more input can come: the watermark is +infinity."""
        return self.low_watermark >= MAX_TIMESTAMP

    @property
    def started(self) -> bool:
        """False while the node has seen nothing (the watermark is -infinity)."""
        return self.low_watermark > MIN_TIMESTAMP


@dataclass(frozen=True, slots=True)
class KeyState:
    """One key's state and pending timers in a computation.

    ``exists`` is False when the key has neither; ``state`` is ``b""`` when it has no
    state. ``range_id`` is the key range the key belongs to."""

    computation: str
    key: str
    exists: bool
    state: bytes
    timers: tuple[Timer, ...]
    range_id: int
