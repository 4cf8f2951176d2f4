"""Whether a running computation may be changed to a new spec (UpdateComputation).

Checked from the specs' data and the store alone, before anything changes: nothing
named in a spec is imported here (built-ins are built as registration builds them,
:func:`millwheel.operators.schema.validate_spec`). Every refusal is a
:class:`~services.rpc.status.PreconditionError` (FAILED_PRECONDITION) that says which
field is incompatible and why; a spec that cannot be built is INVALID_ARGUMENT, as at
registration.

The rules:

* the name stays (it is how the update finds the computation);
* ``options.key_ranges`` stays: a key's state, timers and consumed IDs live in the
  range its key maps to, and moving them (rescale) is not built yet;
* an input stream must keep the key extractor it had in every earlier version since the
  computation was registered (its keys would map to other keys and ranges than the
  state they left): the check is against the registry's record of every stream the
  computation ever consumed with its extractor (``keyed``), not only the running spec,
  so removing an input in one update and adding it back with another extractor in the
  next is refused too (issue 34, item 9). Inputs and outputs may otherwise change under
  the rules of registration: every input of every computation still produced by
  something, no cycle, and no logged stream left unwritten. (A registry from before
  the record, or restored from a savepoint, starts it from the running spec.)
* a built-in ``window_aggregate`` whose window (size or period) or aggregation (its
  ``aggregation``, ``field``, ``p``, ``k``, ``by``) changes, or that is replaced by other
  code, while windows are open is refused unless the caller says what to do with them
  (``drop``, or ``flush``: services/controller/flush.py). The open windows' state is the
  old aggregation's (an incremental accumulator, or a buffer of records), which the new
  operator would misread;
* the same for windows kept in append-only buffers (``spark_aggregate``, and
  ``window_aggregate`` with a holistic aggregation: :mod:`millwheel.holistic`), except
  that ``drop`` and ``flush`` are not built for them (their records are in the window
  buffers, which those paths do not read): refused until the windows close.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from millwheel.errors import InvalidSpecError
from millwheel.holistic import HOLISTIC
from millwheel.importing import AllowList, module_of
from millwheel.operators.schema import check_allowed, import_paths, validate_spec
from millwheel.state.protocol import StateStore
from millwheel.topology import ComputationSpec, Topology

from ..rpc.status import PreconditionError

ON_OPEN_WINDOWS = ("refuse", "drop", "flush")
WINDOW_TAGS = ("end:", "gc:")  # the timers of millwheel.operators.aggregate's windows
BUFFERED_TAGS = ("fire:", "gc:")  # the timers of windows kept in buffers (millwheel.spark.stage)
WINDOWED = ("window_aggregate", "spark_aggregate")
AGGREGATION_PARAMS = ("aggregation", "field", "p", "k", "by")


def check_directive(value: str) -> str:
    """The ``on_open_windows`` value, defaulting to refuse; INVALID_ARGUMENT otherwise."""
    value = value or "refuse"
    if value not in ON_OPEN_WINDOWS:
        raise InvalidSpecError(f"on_open_windows: must be one of {list(ON_OPEN_WINDOWS)}, got {value[:40]!r}")
    return value


def keyed_history(recorded: Mapping[str, str], running: ComputationSpec) -> dict[str, str]:
    """Every input stream ``running``'s computation has consumed since it was registered
    -> the key extractor it was keyed by: the registry's record (``recorded``), and the
    running spec's inputs (a registry from before the record has only those)."""
    return {**{i.stream: i.key_extractor.spec for i in running.inputs}, **recorded}


def code_modules(spec: ComputationSpec) -> list[str]:
    """The user modules of ``spec``'s code (its class, or a built-in's ``function``), by
    their import paths' shape: what a worker imports again for a new version
    (services/worker/code.py). Not ``import:`` key extractors: what they compute must not
    change (keys would map away from their state), so they are not reloaded for it."""
    return list(dict.fromkeys(module_of(path) for what, path in import_paths(spec) if not what.endswith(".key")))


def candidate(topology: Topology, new: ComputationSpec, allow: AllowList,
              keyed: Mapping[str, str] | None = None) -> tuple[Topology, dict[str, str]]:
    """The registry with ``new`` in place of its namesake, checked as registration
    checks it, and the computation's key-extractor record with ``new``'s inputs added.
    InvalidSpecError (INVALID_ARGUMENT) for a spec that is wrong in itself,
    PreconditionError for one that does not fit what runs. ``keyed``: every stream the
    computation consumed in an earlier version -> its key extractor (:func:`keyed_history`;
    None: the running spec's inputs only)."""
    validate_spec(new)
    check_allowed(new, allow)
    old = next(c for c in topology.computations if c.name == new.name)
    where = f"update of computation {new.name!r}"
    if new.options.key_ranges != old.options.key_ranges:
        raise PreconditionError(
            f"{where}: options.key_ranges {old.options.key_ranges} -> {new.options.key_ranges}: a "
            "computation's key-range count cannot change in an update (its keys' state lives in "
            "their ranges; use 'millwheel rescale NAME --key-ranges N')")
    history = keyed_history({} if keyed is None else keyed, old)
    running = {i.stream for i in old.inputs}
    for inp in new.inputs:
        before = history.get(inp.stream)
        if before is not None and before != inp.key_extractor.spec:
            earlier = "" if inp.stream in running else (
                f" (the input was removed by an earlier update, but its state is still keyed by "
                f"{before!r}: adding it back with another key extractor is the same change)")
            raise PreconditionError(
                f"{where}: inputs[{inp.stream!r}].key_extractor changed: {before!r} -> "
                f"{inp.key_extractor.spec!r}: its records' keys would map to other key ranges than "
                f"their state{earlier} (register a new computation instead)")
    gone = [s for s in topology.log_streams if s in old.all_outputs() and s not in new.all_outputs()]
    if gone:
        raise PreconditionError(f"{where}: logged stream {gone[0]!r} would no longer be written by it "
                                "(a log stream must be an output of some computation)")
    # Everything else of the topology as it is: injectors, log streams and connector sinks
    # (a field left out here was dropped by every update: issue 34, item 1).
    topo = dataclasses.replace(topology, computations=tuple(new if c.name == new.name else c
                                                            for c in topology.computations))
    try:
        topo.validate()
    except InvalidSpecError as exc:
        raise PreconditionError(f"{where}: {exc}") from None
    return topo, {**{i.stream: i.key_extractor.spec for i in new.inputs}, **history}


def window_params(spec: ComputationSpec) -> tuple[int, int] | None:
    """(size, period) of a built-in windowed aggregation, None for any other code."""
    if spec.code.name not in WINDOWED:
        return None
    params: Mapping[str, Any] = spec.code.params
    size = int(params.get("size_us", 0))
    return size, int(params.get("period_us") or size)


def buffered(spec: ComputationSpec) -> bool:
    """Whether ``spec``'s windows are kept in append-only buffers (fired by ``fire:``
    timers), not as accumulators in the key's state."""
    return spec.code.name == "spark_aggregate" or (
        spec.code.name == "window_aggregate" and spec.code.params.get("aggregation") in HOLISTIC)


def window_change(old: ComputationSpec, new: ComputationSpec) -> str | None:
    """What changes about the open windows of ``old`` under ``new``, or None."""
    before, after = window_params(old), window_params(new)
    if before is None:
        return None
    if after is None or new.code.name != old.code.name:
        return f"code {old.code.name} -> {new.code.name!r} (the open windows' timers would run other code)"
    if before != after:
        return (f"code.params window size/period {before[0]}/{before[1]} us -> {after[0]}/{after[1]} us "
                "(the open windows would be closed with the new window's end)")
    changed = [k for k in AGGREGATION_PARAMS if old.code.params.get(k) != new.code.params.get(k)]
    if changed:
        return (f"code.params {', '.join(changed)} (the open windows hold the old aggregation's "
                "state, which the new one would misread)")
    return None


def open_windows(store: StateStore, spec: ComputationSpec) -> tuple[int, int]:
    """(open windows, key ranges holding some) of a windowed aggregation, from its timers
    (a window's end timer, or for buffered windows its firing timer)."""
    tag = "fire:" if buffered(spec) else "end:"
    windows = ranges = 0
    for r in range(spec.options.key_ranges):
        n = sum(1 for t in store.read_timers(spec.name, r) if t.tag.startswith(tag))
        windows += n
        ranges += n > 0
    return windows, ranges


def refuse_open_windows(store: StateStore, old: ComputationSpec, new: ComputationSpec,
                        directive: str) -> str | None:
    """Raise PreconditionError when ``new`` changes open windows under "refuse"; the
    change (to act on) when windows are open and the directive is "drop" or "flush";
    else None."""
    change = window_change(old, new)
    if change is None:
        return None
    windows, ranges = open_windows(store, old)
    if not windows:
        return None
    if directive != "refuse" and buffered(old):
        raise PreconditionError(
            f"update of computation {new.name!r}: {change} while {windows} window(s) are open in "
            f"{ranges} key range(s); on_open_windows {directive!r} is not built for windows kept in "
            "buffers (spark_aggregate, or a holistic aggregation), whose records those paths do "
            "not read: update once they have closed")
    if directive == "refuse":
        raise PreconditionError(
            f"update of computation {new.name!r}: {change} while {windows} window(s) are open in "
            f"{ranges} key range(s); pass on_open_windows 'flush' (CLI: --on-open-windows flush) to "
            "emit their results so far with the old window first, 'drop' to discard them, or update "
            "once they have closed")
    return change
