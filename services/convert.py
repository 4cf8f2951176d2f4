"""The only place protobuf messages and millwheel core types meet.

Specs go proto -> plain dict -> :func:`millwheel.spec.computation_from_dict`, so the
service validates a registration with exactly the rules a YAML file gets, and every
error names the field at fault.
"""

from __future__ import annotations

import json
from typing import Any, Iterable, Mapping

from millwheel.errors import InvalidSpecError, ResourceLimitError
from millwheel.record import MAX_TIMESTAMP, MIN_TIMESTAMP, Record, Timer
from millwheel.spec import computation_from_dict, computation_to_dict, topology_from_dict
from millwheel.topology import ComputationSpec, InjectorSpec, Topology
from services.generated import millwheel_pb2 as pb


# -- computation specs ---------------------------------------------------------------
def spec_from_proto(msg: pb.ComputationSpec) -> ComputationSpec:
    return computation_from_dict(spec_dict_from_proto(msg))


def spec_dict_from_proto(msg: pb.ComputationSpec) -> dict[str, Any]:
    where = f"computation {msg.name!r}"
    try:
        params = json.loads(msg.code.params_json) if msg.code.params_json else {}
    except ValueError as exc:
        raise InvalidSpecError(f"{where}.code.params_json: not valid JSON: {exc}") from None
    options: dict[str, Any] = {}
    o = msg.options
    if o.HasField("exactly_once"):
        options["exactly_once"] = o.exactly_once
    for name in ("productions", "late_policy", "late_stream"):
        if getattr(o, name):
            options[name] = getattr(o, name)
    for name in ("allowed_lateness_us", "key_ranges", "record_id_retention_us", "max_batch_seconds"):
        if o.HasField(name):
            options[name] = getattr(o, name)
    return {
        "name": msg.name,
        "inputs": [
            {"stream": i.stream, "key": i.key_extractor or "key"} for i in msg.inputs
        ],
        "outputs": list(msg.outputs),
        "code": {"name": msg.code.name, "params": params},
        "options": options,
    }


def spec_to_proto(spec: ComputationSpec) -> pb.ComputationSpec:
    d = computation_to_dict(spec)
    opts = d["options"]
    return pb.ComputationSpec(
        name=spec.name,
        inputs=[pb.InputStream(stream=i["stream"], key_extractor=i["key"]) for i in d["inputs"]],
        outputs=d["outputs"],
        code=pb.Code(name=d["code"]["name"], params_json=json.dumps(d["code"]["params"])),
        options=pb.Options(
            exactly_once=opts["exactly_once"], productions=opts["productions"],
            late_policy=opts["late_policy"], late_stream=opts["late_stream"] or "",
            allowed_lateness_us=opts["allowed_lateness_us"], key_ranges=opts["key_ranges"],
            record_id_retention_us=opts["record_id_retention_us"],
            max_batch_seconds=opts["max_batch_seconds"],
        ),
    )


def spec_dict_to_proto(data: Mapping[str, Any]) -> pb.ComputationSpec:
    """A YAML/JSON computation mapping (as in a spec file) to its wire form, validated."""
    return spec_to_proto(computation_from_dict(data))


def injector_to_proto(spec: InjectorSpec) -> pb.InjectorSpec:
    return pb.InjectorSpec(name=spec.name, stream=spec.stream)


# -- the topology workers receive ------------------------------------------------------
def topology_to_json(topology: Topology) -> str:
    return json.dumps({
        "log_streams": list(topology.log_streams),
        "computations": [computation_to_dict(c) for c in topology.computations],
        "injectors": [{"name": i.name, "stream": i.stream} for i in topology.injectors],
    })


def topology_from_json(text: str) -> Topology:
    return topology_from_dict(json.loads(text))


# -- records ---------------------------------------------------------------------------
def _check_wire_record(msg: pb.Record, where: str, max_value_bytes: int) -> None:
    """The checks a wire record needs beyond :meth:`Record.validate`: a key and a size."""
    if not msg.key:
        raise InvalidSpecError(f"{where}: key must not be empty")
    if len(msg.value) > max_value_bytes:
        raise ResourceLimitError(
            f"{where}: value of key {msg.key!r} is {len(msg.value)} bytes, over the "
            f"limit of {max_value_bytes} bytes"
        )


def record_from_proto(msg: pb.Record, where: str, max_value_bytes: int) -> Record:
    _check_wire_record(msg, where, max_value_bytes)
    record = Record(msg.key, bytes(msg.value), int(msg.timestamp), msg.id or "-")
    record.validate(where)
    return record


def check_records(msgs: Iterable[pb.Record], where: str, max_value_bytes: int) -> list[int]:
    """Validate wire records in place, as :func:`record_from_proto` does one by one but
    without building core records (the controller only forwards them). Returns the
    indexes of records without an ID."""
    missing = []
    for j, m in enumerate(msgs):
        _check_wire_record(m, f"{where} record {j}", max_value_bytes)
        if not MIN_TIMESTAMP <= m.timestamp <= MAX_TIMESTAMP:
            raise InvalidSpecError(f"{where} record {j}: timestamp {m.timestamp} is out of range")
        if not m.id:
            missing.append(j)
    return missing


def records_from_proto(msgs: Iterable[pb.Record]) -> list[Record]:
    """Records between workers: already validated at the edge, taken as they are."""
    return [Record(m.key, bytes(m.value), int(m.timestamp), m.id) for m in msgs]


def record_to_proto(record: Record) -> pb.Record:
    return pb.Record(key=record.key, value=record.value, timestamp=record.timestamp,
                     id=record.record_id)


def timer_to_proto(timer: Timer) -> pb.TimerInfo:
    return pb.TimerInfo(tag=timer.tag, time=timer.time, domain=timer.domain.value, hold=timer.hold)
