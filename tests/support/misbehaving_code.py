"""User code that a deployment allows (``--allow-code tests.support.misbehaving_code``)
but that misbehaves, for the tests of what one computation may do to the others.

The module imports ``os`` and ``subprocess`` at top level, as real modules do: their
objects are reachable as ``tests.support.misbehaving_code:os.system`` or
``...:subprocess.Popen``, and ``system`` is re-exported here, yet none of them is code
of this module, and the allow-list must refuse every one of them.
"""

from __future__ import annotations

import os  # noqa: F401 - reachable through this module: what the allow-list must refuse
import subprocess  # noqa: F401
import sys
from os import system  # noqa: F401 - a re-export: defined in posix, not here

from millwheel.computation import Computation, Context
from millwheel.record import Record, Timer


class FailsToBuild(Computation):
    """Raises when constructed, as code does whose resource is missing: no worker can
    build its ranges."""

    def __init__(self, **params: object) -> None:
        raise RuntimeError(f"cannot connect to the feature store (params {sorted(params)})")

    def process_record(self, ctx: Context, record: Record) -> None:  # pragma: no cover
        raise AssertionError("never built")

    def process_timer(self, ctx: Context, timer: Timer) -> None:  # pragma: no cover
        raise AssertionError("never built")


class ExitsWhenBuilt(FailsToBuild):
    """Calls ``sys.exit()`` in its constructor: it must cost its ranges, not the
    worker's heartbeat thread."""

    def __init__(self, **params: object) -> None:
        sys.exit(3)


class PassThrough(Computation):
    """Forwards every record to its output unchanged (the allowed code of these tests)."""

    def __init__(self, output: str) -> None:
        self.output = output

    def process_record(self, ctx: Context, record: Record) -> None:
        ctx.produce(self.output, record.key, record.value, record.timestamp)

    def process_timer(self, ctx: Context, timer: Timer) -> None:
        pass


def first_char_key(record: Record) -> str:
    """A key extractor defined here: allowed."""
    return record.key[:1] or "_"


class SlowToBuild(PassThrough):
    """Takes ``seconds`` to construct (a slow connection, a large model to load), then
    forwards records as :class:`PassThrough`: building its range must not hold up the
    worker's heartbeats."""

    def __init__(self, output: str, seconds: float = 8.0) -> None:
        import time

        time.sleep(seconds)
        super().__init__(output)
