"""How the controller describes what it runs, as the RPCs answer it: a node's watermark,
its key ranges, a computation's whole description. Read from the plane's copies (the
assignment, the watermarks kept by services/controller/watermarks.py): no store call
but the error counts of :func:`info`. The caller holds the plane's lock."""

from __future__ import annotations

from millwheel.nodes import NodeKind, kind_of, name_of
from millwheel.record import MAX_TIMESTAMP, MIN_TIMESTAMP
from millwheel.topology import CodeRef, ComputationSpec, Options

from ..generated import millwheel_pb2 as pb
from ..rpc import convert
from .errors import error_info
from .held_by import LeastWriter, held_by
from .plane import ControlPlane

Watermarks = tuple[dict[str, int], dict[str, int]]  # (every node's output, every computation's input)


def node_watermark(plane: ControlPlane, node: str, out: dict[str, int], inputs: dict[str, int],
                   least_writer: LeastWriter | None = None) -> pb.NodeWatermark:
    wm = out[node]
    now = plane.clock.now_us()
    lag = 0 if wm <= MIN_TIMESTAMP or wm >= MAX_TIMESTAMP else max(0, now - wm)
    return pb.NodeWatermark(node=node, low_watermark=wm,
                            input_low_watermark=inputs.get(node, out[node]), lag_us=lag,
                            held_by=held_by(plane, node, out, inputs, least_writer))


def ranges(plane: ControlPlane, node: str | None = None) -> list[pb.RangeInfo]:
    """Every key range (of ``node``, if given): owner, token, watermark, pending, failure."""
    out = []
    wms: dict[str, dict[int, int]] = {}
    assigner = plane.assigner
    for (n, r), owner in sorted(assigner.units.items()):
        if node is not None and n != node:
            continue
        if n not in wms:
            wms[n] = plane.wms.of(n)
        w = assigner.workers.get(owner.worker_id or "")
        out.append(pb.RangeInfo(
            node=n, range_id=r, worker_id=owner.worker_id or "",
            worker_address=w.address if w else "", token=owner.token,
            watermark=wms[n].get(r, MIN_TIMESTAMP), pending=plane.pending.get((n, r), 0),
            failure=plane.failing.of((n, r), owner)))
    return out


def info(plane: ControlPlane, name: str, wms: Watermarks | None = None) -> pb.ComputationInfo:
    """A computation's (or an injector node's) description. ``wms``: the watermarks, read
    once for a whole list."""
    registry = plane.registry
    inj = registry.injector(name_of(name)) if kind_of(name) is NodeKind.INJECTOR else None
    # An injector pulling a source is described as a one-range node whose dead letters
    # are the entries that were not records (`millwheel errors injector:NAME`).
    spec = registry.computation(name) if inj is None else ComputationSpec(
        name, (), (inj.stream,), CodeRef("source"),
        Options(key_ranges=1, dead_letter_stream=inj.dead_letter_stream))
    out, inputs = wms or plane.watermarks()
    return pb.ComputationInfo(spec=convert.spec_to_proto(spec), low_watermark=out[name],
                              input_low_watermark=inputs.get(name, out[name]), ranges=ranges(plane, name),
                              version=registry.version_of(name),
                              has_previous=name in registry.previous,
                              **error_info(plane.store, spec, plane.failing.of_node(name, plane.assigner.units)))
