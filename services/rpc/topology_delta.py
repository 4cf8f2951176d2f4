"""The registry as changes: what a heartbeat answer carries to a worker that holds an
earlier version (``HeartbeatResponse.topology_delta_json``). Both sides of the contract:
the controller encodes (:func:`encode`), the worker applies (:func:`apply`), and
``apply(base, encode(..., base, ..., new, ...)) == new``, exactly the topology
:func:`~services.rpc.convert.topology_from_json` reads from the whole registry's JSON.

Why: the whole registry's JSON at the documented cap (1,000 computations of 64 KiB
parameters) is 64 MB, encoded by the controller per registry version and parsed by every
worker after every registration; the encoding held the leader's GIL long enough to starve
its lease renewals (docs/bench.md, "The leader's lease at the caps"; issue 34 item 9). A
delta costs what changed: registering 50 computations sends those 50.

The delta is one JSON object::

    {"base": 7, "version": 9,            # the versions it goes from and to
     "order": ["a", "b", ...],           # the computation names of the new version, in order
     "removed": ["old"],                 # names of the base the new version no longer has
     "computations": [{...}, ...],       # each computation added or changed, whole, as the
                                         # registry's JSON encodes it (computation_to_dict)
     "log_streams": [...], "injectors": [...], "sinks": [...]}   # small parts: whole

A computation named in ``order`` and not in ``computations`` is the base's, unchanged
(the worker keeps its own object). Changes are found by object identity first (the
registry's specs are frozen: a change is a new object), equality as the fallback.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Callable, Iterable

from millwheel import spec as spec_module
from millwheel.errors import InvalidSpecError, MillWheelError
from millwheel.spec import ComputationTexts, computation_from_dict, json_object, spec_parts, topology_parts_to_dict
from millwheel.topology import ComputationSpec, Topology

from . import convert

log = logging.getLogger(__name__)


class DeltaMismatch(MillWheelError, ValueError):
    """A delta that does not apply to the topology it was given (another base, or not a
    delta at all): the worker asks for the whole registry instead."""


def changes(base: Topology, new: Topology) -> tuple[list[ComputationSpec], list[str]]:
    """(the computations of ``new`` added or changed since ``base``, in ``new``'s order;
    the names of ``base`` that ``new`` no longer has)."""
    old = {c.name: c for c in base.computations}
    changed = []
    for spec in new.computations:
        was = old.pop(spec.name, None)
        if was is spec or (was is not None and was == spec):  # identity first, equality as fallback
            continue
        changed.append(spec)
    return changed, list(old)


def encode(base_version: int, base: Topology, version: int, new: Topology,
           text: Callable[[ComputationSpec], str] | None = None) -> str:
    """The delta from ``base`` (at ``base_version``) to ``new`` (at ``version``); ``text``
    gives a computation's JSON (default: encoded here; the controller passes a
    :class:`SpecTexts`, so each spec is encoded once whatever the number of deltas)."""
    changed, removed = changes(base, new)
    encoded = text or SpecTexts().text
    return json_object({"base": base_version, "version": version,
                        "order": [c.name for c in new.computations], "removed": removed,
                        "computations": None, "log_streams": list(new.log_streams),
                        **topology_parts_to_dict(new)},
                       {"computations": "[" + ", ".join(encoded(c) for c in changed) + "]"})


def apply(base: Topology, delta_json: str) -> Topology:
    """The topology ``delta_json`` makes of ``base`` (validated as the whole registry's JSON
    is when read); DeltaMismatch if the delta was not made from ``base``'s computations."""
    try:
        data = json.loads(delta_json)
        if not isinstance(data, dict):
            raise DeltaMismatch("topology delta: not a JSON object")
        order, removed = data["order"], data["removed"]
        if not isinstance(order, list) or not isinstance(removed, list):
            raise DeltaMismatch("topology delta: 'order' and 'removed' must be lists")
        changed = {c.name: c for c in (computation_from_dict(d) for d in _list(data["computations"]))}
        have = {c.name: c for c in base.computations}
        if set(have).difference(order) != set(removed) or not set(removed) <= set(have):
            raise DeltaMismatch(f"topology delta from version {data.get('base')}: its removed computations "
                                "are not what the held topology has beyond the new order")
        comps = []
        for name in order:
            spec = changed.get(name) or have.get(name)
            if spec is None:
                raise DeltaMismatch(f"topology delta from version {data.get('base')}: computation {name!r} "
                                    "is neither sent nor held")
            comps.append(spec)
        _c, injectors, log_streams, sinks = spec_parts({"injectors": data["injectors"],
                                                        "log_streams": data["log_streams"], "sinks": data["sinks"]})
        topology = Topology(tuple(comps), injectors, log_streams, sinks)
        topology.validate()
    except DeltaMismatch:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, InvalidSpecError) as exc:
        raise DeltaMismatch(f"topology delta: cannot be applied: {exc}") from None
    return topology


def _list(value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise DeltaMismatch("topology delta: 'computations' is not a list")
    return value


def received(held: Topology, held_version: int, resp: Any) -> Topology | None:
    """The worker's side: the topology a heartbeat answer brings (``resp`` has
    ``topology_json`` or ``topology_delta_json``), or None for a delta the worker cannot
    apply to what it holds (it then asks for the whole registry at its next heartbeat)."""
    if resp.topology_json:
        return convert.topology_from_json(resp.topology_json)
    if resp.topology_base_version != held_version:
        log.warning("registry version %d came as changes to version %d, not to the version %d held here: "
                    "asking for the whole registry", resp.topology_version, resp.topology_base_version,
                    held_version)
        return None
    try:
        topology = apply(held, resp.topology_delta_json)
    except DeltaMismatch as exc:
        log.warning("registry version %d: %s; asking for the whole registry", resp.topology_version, exc)
        return None
    log.info("registry version %d from the changes to version %d", resp.topology_version, held_version)
    return topology


class SpecTexts(ComputationTexts):
    """Computation specs as JSON text (as :class:`~millwheel.spec.ComputationTexts`
    encodes them), each encoded once per spec object and kept until :meth:`keep` is
    given specs without it: what the controller's whole registry JSON and its deltas
    share. Not thread-safe: one per serializing owner."""

    def __init__(self) -> None:
        super().__init__()
        self._by_id: dict[int, tuple[ComputationSpec, str]] = {}

    def text(self, spec: ComputationSpec) -> str:
        hit = self._by_id.get(id(spec))
        if hit is None or hit[0] is not spec:
            hit = self._by_id[id(spec)] = (spec, json.dumps(spec_module.computation_to_dict(spec)))
        return hit[1]

    def of(self, specs: Iterable[ComputationSpec]) -> list[str]:
        """The texts of ``specs``, in order (kept: :meth:`keep` forgets)."""
        return [self.text(s) for s in specs]

    def keep(self, specs: Iterable[ComputationSpec]) -> None:
        """Forget every text but those of ``specs`` (the registry's current version)."""
        alive = {id(s): s for s in specs}
        self._by_id = {k: hit for k, hit in self._by_id.items() if alive.get(k) is hit[0]}


def whole(topology: Topology, texts: SpecTexts) -> str:
    """The whole registry's JSON (``topology_json``), its computations from ``texts``."""
    return convert.topology_to_json(topology, texts)
