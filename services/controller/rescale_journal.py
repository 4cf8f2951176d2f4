"""A rescale's journal and its data steps (services/controller/rescale.py says how they
make it exactly once, and which of them run under the controller's lock: none of the
copies). Every function here is a sequence of store calls made without the controller's
lock; :func:`recover` and :func:`apply` may run again after a crash at any point.

The journal entry ``rescale/NAME`` (JSON in the store's metadata) says how far a
rescale got: ``staging`` (the old layout stands, untouched), ``commit`` (the new layout
is the outcome; the staged data is whole), ``cleanup`` (the registry names the new
layout; only the staging node is left to delete). ``"ids": "once"`` (written by this
version) says the staging node holds each consumed ID once, in its range 0, to be
spread into every range when the staged layout is copied in; an entry without it
(an older controller's) staged them in every range already.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any, Callable, TypeVar

from millwheel.runtime.crash import crash_hook_from_env, hold_hook_from_env
from millwheel.savepoint import repartition
from millwheel.state.protocol import StateStore
from millwheel.topology import ComputationSpec

from ..rpc.status import PreconditionError
from .assign import Assigner
from .errors import note_ranges
from .registry import Registry
from .watermarks import Watermarks

log = logging.getLogger("millwheel.controller")

T = TypeVar("T")
JOURNAL = "rescale/"  #: metadata: rescale/NAME -> the rescale under way (JSON)
STAGE = "rescale:"  #: the staging node's prefix (names never hold ':')
COPYING, CLEANUP = "copying", "cleanup"  #: Assigner.rescaling's phases (a rescale under way here)
#: ``MILLWHEEL_CRASH_AT=rescale_staged|rescale_committed|rescale_copied``: the controller
#: kills itself -9 there (the crash tests); nothing otherwise.
crash = crash_hook_from_env()
#: ``MILLWHEEL_HOLD_AT=rescale_staged:SECONDS``: step 2's copy takes that much longer (tests
#: that watch a rescale under way, also on a fast machine); nothing otherwise.
hold = hold_hook_from_env()


def check_not_copying(assigner: Assigner, name: str, what: str) -> None:
    """FAILED_PRECONDITION (nothing changed) while a rescale of ``name`` copies its data
    off the controller's lock: its ranges' tokens and data belong to that rescale until
    the registry names the new layout (an update's fence, an unregistration's drop
    would fence the rescale's own writes)."""
    if assigner.rescaling.get(name) == COPYING:
        raise PreconditionError(f"{what} of {name[:200]!r}: a rescale of {name[:200]!r} is under way (its data "
                                "is being copied); nothing changed: send this again once it is done (the "
                                "rescale's call returns then; the console shows it meanwhile)")


def read_keyed(store: StateStore, name: str, read: Callable[[str], T]) -> T:
    """``read(node)`` of computation ``name``'s keyed data (state, timers, keys) whole,
    also while a rescale's step 4 clears and refills it: while the journal says
    ``commit`` the staging node, whole from then until the journal moves on, is read
    instead. Kept when the journal said the same before and after the read (the data
    read was not being rewritten meanwhile), else read again; a standby answers the
    same way (the journal is in the store)."""
    before = _phase(store, name)
    for _ in range(8):  # a rescale moves through four phases; eight reads outlast two
        value = read(STAGE + name if before == "commit" else name)
        after = _phase(store, name)
        if after == before:
            return value
        before = after
    return value


def _phase(store: StateStore, name: str) -> str | None:
    raw = store.get_meta(JOURNAL + name)
    if raw is None:
        return None
    try:
        return str(json.loads(raw).get("phase"))
    except (ValueError, AttributeError):
        return None


def tokens(store: StateStore, known: dict[tuple[str, int], int]) -> Callable[[str, int], int]:
    """A token per range, acquired once (fencing whoever wrote there before)."""
    def token(node: str, r: int) -> int:
        if (node, r) not in known:
            known[(node, r)] = store.acquire(node, r)
        return known[(node, r)]
    return token


def journal(store: StateStore, name: str, entry: dict[str, Any] | None) -> None:
    store.put_meta(JOURNAL + name, None if entry is None else json.dumps(entry).encode())


def resized(spec: ComputationSpec, n: int) -> ComputationSpec:
    return dataclasses.replace(spec, options=dataclasses.replace(spec.options, key_ranges=n))


def stage(store: StateStore, name: str, old: int, n: int, token: Callable[[str, int], int],
          at_us: int) -> tuple[repartition.Moved, int | None]:
    """Step 2: the old layout (only read) copied into the staging node by key, consumed
    IDs once; returns what moved and the least watermark of the old ranges (None while
    one has none)."""
    repartition.clear(store, STAGE + name, range(n), (n,), token, at_us)  # left by an earlier attempt
    staged = repartition.copy(store, name, old, STAGE + name, n, token, at_us, ids="once")
    hold("rescale_staged")
    wms = store.read_watermarks(name)
    floor = min(wms[r] for r in range(old)) if all(r in wms for r in range(old)) else None
    return staged, floor


def apply_data(store: StateStore, name: str, entry: dict[str, Any], token: Callable[[str, int], int]) -> int:
    """Step 4, from a committed journal ``entry``: the computation's ranges (old and new
    numbers) cleared, the staged data copied in, new range numbers given the old
    ranges' least watermark. Returns the consumed IDs written."""
    old, n, at_us = int(entry["from"]), int(entry["to"]), int(entry["at_us"])
    note_ranges(store, name, max(old, n))  # error counts stay where they were counted
    repartition.clear(store, name, range(max(old, n)), (old, n), token, at_us)
    once = entry.get("ids") == "once"
    moved = repartition.copy(store, STAGE + name, n, name, n, token, at_us, ids="none" if once else "same")
    if once:
        moved.ids += repartition.spread_ids(store, STAGE + name, 0, name, n, token, at_us)
    crash("rescale_copied")
    if entry.get("watermark") is not None:
        for r in range(old, n):
            store.report_watermark(name, r, token(name, r), int(entry["watermark"]))
    return moved.ids


def apply_registry(registry: Registry, name: str, n: int) -> None:
    """Step 5: the registry stored with ``key_ranges`` N and version + 1 (one write;
    nothing if it says N already: a redo)."""
    spec = registry.computation(name)
    if spec.options.key_ranges == n:
        return
    new = resized(spec, n)
    # Everything else of the topology as it is: injectors, log streams and connector sinks.
    topology = dataclasses.replace(registry.topology, computations=tuple(
        new if c.name == name else c for c in registry.topology.computations))
    prev = registry.previous.get(name)  # a rollback target keeps working: same ranges
    registry.replace_computation(new, topology, registry.version_of(name) + 1,
                                 None if prev is None else resized(prev, n))


def drop_stage(store: StateStore, name: str, entry: dict[str, Any], token: Callable[[str, int], int]) -> None:
    """The staging node deleted, then the journal entry (an undo before the commit, the
    cleanup after step 5)."""
    n = int(entry["to"])
    repartition.clear(store, STAGE + name, range(n), (n,), token, int(entry["at_us"]))
    journal(store, name, None)


def apply(store: StateStore, registry: Registry, name: str, entry: dict[str, Any],
          token: Callable[[str, int], int]) -> None:
    """Steps 4-5 and the cleanup from a committed (or cleaning up) journal ``entry``, in
    one go (redone whole by :func:`recover` after a crash: each step may run again)."""
    if entry["phase"] == "commit":
        apply_data(store, name, entry, token)
        apply_registry(registry, name, int(entry["to"]))
        entry = {**entry, "phase": "cleanup"}
        journal(store, name, entry)
    drop_stage(store, name, entry, token)


def recover(store: StateStore, registry: Registry, wms: Watermarks) -> None:
    """Finish or undo a rescale a dead controller left (before anything is assigned):
    a staged one is dropped (the old layout stands), a committed one is completed."""
    for key, raw in sorted(store.list_meta(JOURNAL).items()):
        name = key[len(JOURNAL):]
        entry = json.loads(raw)
        token = tokens(store, {})
        if entry.get("phase") == "staging":
            drop_stage(store, name, entry, token)
            log.warning("rescale of %r cut short before its commit: undone (it keeps %s key ranges)",
                        name, entry["from"])
        else:
            apply(store, registry, name, entry, token)
            if entry.get("watermark") is not None:
                wms.hold(name, int(entry["watermark"]), int(entry["to"]))
            log.warning("rescale of %r cut short after its commit: completed (%s -> %s key ranges)",
                        name, entry["from"], entry["to"])
