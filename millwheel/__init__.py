"""millwheel: keyed, stateful, exactly-once stream computations (after Google's MillWheel)."""

__version__ = "0.2.0"  # the one place the version is set (pyproject.toml reads it)

from millwheel.clock import Clock, ManualClock, SystemClock
from millwheel.computation import Computation, Context
from millwheel.errors import MillWheelError
from millwheel.keys import KeyExtractor
from millwheel.record import Record, TimeDomain, Timer
from millwheel.topology import (
    CodeRef,
    ComputationSpec,
    InjectorSpec,
    InputSpec,
    LatePolicy,
    Options,
    Productions,
    Topology,
)

__all__ = [
    "Clock", "CodeRef", "Computation", "ComputationSpec", "Context", "InjectorSpec", "InputSpec",
    "KeyExtractor", "LatePolicy", "ManualClock", "MillWheelError", "Options", "Productions",
    "Record", "SystemClock", "TimeDomain", "Timer", "Topology",
]
