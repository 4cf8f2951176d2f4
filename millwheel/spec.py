"""Topologies and computation specs as plain data (YAML/JSON), both directions.

The same dictionaries are what ``millwheel run``/``register`` read from files and
what the service stores in its registry, so a spec round-trips exactly.

    computations:
      - name: counts
        inputs: [{stream: queries, key: key}]
        outputs: [counts]
        code: {name: window_aggregate, params: {size_us: 60000000}}
        options: {exactly_once: true, late_policy: drop}
    injectors:
      - {name: queries, stream: queries}
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Iterable, Mapping

from millwheel.connectors.spec import ConnectorSpec, SinkSpec, sink_to_dict, sinks_from_list, source_from_dict
from millwheel.errors import InvalidSpecError
from millwheel.keys import KeyExtractor
from millwheel.limits import MAX_DURATION_US, MAX_PARAMS_DEPTH, check_name, check_params_depth
from millwheel.topology import (
    CodeRef,
    ComputationSpec,
    ErrorPolicy,
    InjectorSpec,
    InputSpec,
    LatePolicy,
    Options,
    Productions,
    Topology,
)

_OPTION_FIELDS = {f.name for f in dataclasses.fields(Options)}


def computation_from_dict(data: Mapping[str, Any]) -> ComputationSpec:
    name = data.get("name")
    check_name(name, "computation")
    assert isinstance(name, str)
    where = f"computation {name!r}"
    unknown = set(data) - {"name", "inputs", "outputs", "code", "options"}
    if unknown:
        raise InvalidSpecError(f"{where}: unknown fields {sorted(unknown)}")
    inputs = []
    for i, inp in enumerate(_list(data.get("inputs"), f"{where}.inputs")):
        if isinstance(inp, str):
            inp = {"stream": inp}
        if not isinstance(inp, Mapping) or not isinstance(inp.get("stream"), str) or not inp["stream"]:
            raise InvalidSpecError(f"{where}.inputs[{i}]: needs a 'stream' name")
        inputs.append(InputSpec(inp["stream"], KeyExtractor(str(inp.get("key", "key")))))
    outputs = _list(data.get("outputs", []), f"{where}.outputs")
    if not all(isinstance(o, str) and o for o in outputs):
        raise InvalidSpecError(f"{where}.outputs: stream names must be non-empty strings")
    code = data.get("code")
    if isinstance(code, str):
        code = {"name": code}
    if not isinstance(code, Mapping) or not isinstance(code.get("name"), str):
        raise InvalidSpecError(f"{where}.code: needs a 'name' (built-in or pkg.module:Class)")
    params = code.get("params", {})
    if not isinstance(params, Mapping):
        raise InvalidSpecError(f"{where}.code.params: must be a mapping")
    check_params_depth(params, f"{where}.code.params")
    return ComputationSpec(
        name, tuple(inputs), tuple(outputs), CodeRef(code["name"], dict(params)),
        _options(data.get("options", {}), where),
    )


def _options(data: Any, where: str) -> Options:
    if not isinstance(data, Mapping):
        raise InvalidSpecError(f"{where}.options: must be a mapping")
    unknown = set(data) - _OPTION_FIELDS
    if unknown:
        raise InvalidSpecError(f"{where}.options: unknown options {sorted(unknown)}")
    values = dict(data)
    try:
        if "productions" in values:
            values["productions"] = Productions(values["productions"])
        if "late_policy" in values:
            values["late_policy"] = LatePolicy(values["late_policy"])
        if "on_error" in values:
            values["on_error"] = ErrorPolicy(values["on_error"])
    except ValueError as exc:
        raise InvalidSpecError(f"{where}.options: {exc}") from None
    for field in ("key_ranges", "allowed_lateness_us", "record_id_retention_us", "max_attempts",
                  "state_ttl_us", "log_retention_us", "log_retention_bytes"):
        value = values.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise InvalidSpecError(f"{where}.options.{field}: must be an integer")
    seconds = values.get("max_batch_seconds")
    if seconds is not None:
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
            raise InvalidSpecError(f"{where}.options.max_batch_seconds: must be a number of seconds")
        values["max_batch_seconds"] = float(seconds)
    options = Options(**values)
    options.validate(where)
    return options


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise InvalidSpecError(f"{where}: must be a list")
    return value


def computation_to_dict(spec: ComputationSpec) -> dict[str, Any]:
    opts = dataclasses.asdict(spec.options)
    opts["productions"] = spec.options.productions.value
    opts["late_policy"] = spec.options.late_policy.value
    opts["on_error"] = spec.options.on_error.value
    return {
        "name": spec.name,
        "inputs": [{"stream": i.stream, "key": i.key_extractor.spec} for i in spec.inputs],
        "outputs": list(spec.outputs),
        "code": {"name": spec.code.name, "params": dict(spec.code.params)},
        "options": opts,
    }


#: The fields of a spec file's top level and of one of its injectors.
SPEC_FIELDS = ("computations", "injectors", "log_streams", "sinks")
INJECTOR_FIELDS = ("name", "stream", "file", "max_disorder_us", "source", "key_ranges")


def spec_parts(data: Mapping[str, Any]) -> tuple[tuple[ComputationSpec, ...], tuple[InjectorSpec, ...],
                                                 tuple[str, ...], tuple[SinkSpec, ...]]:
    """A spec file's computations, injectors, log streams and sinks, every field checked.

    ``millwheel run`` (through :func:`topology_from_dict`) and ``millwheel register``
    both read a spec file through here, so a field one refuses the other refuses too:
    a typo must not register something other than what the user wrote. (Whether the
    parts form a whole topology is checked by ``run`` and by the controller, which
    also knows what is already registered.)"""
    if not isinstance(data, Mapping):
        raise InvalidSpecError("topology: expected a mapping with 'computations'")
    unknown = set(data) - set(SPEC_FIELDS)
    if unknown:
        raise InvalidSpecError(f"topology: unknown fields {sorted(unknown)} (a spec file has "
                               f"{', '.join(SPEC_FIELDS)})")
    comps = tuple(computation_from_dict(c) for c in _list(data.get("computations", []), "computations"))
    injectors = []
    for i, inj in enumerate(_list(data.get("injectors", []), "injectors")):
        if not isinstance(inj, Mapping) or not inj.get("name") or not inj.get("stream"):
            raise InvalidSpecError(f"injectors[{i}]: needs 'name' and 'stream'")
        unknown = set(inj) - set(INJECTOR_FIELDS)
        if unknown:
            raise InvalidSpecError(f"injectors[{i}]: unknown fields {sorted(unknown)}")
        disorder = inj.get("max_disorder_us", 0)  # the watermark is the newest time minus it
        if isinstance(disorder, bool) or not isinstance(disorder, int) or not 0 <= disorder <= MAX_DURATION_US:
            raise InvalidSpecError(f"injectors[{i}].max_disorder_us: must be an integer 0..{MAX_DURATION_US} "
                                   f"(microseconds: at most a century), got {disorder!r}")
        source: ConnectorSpec | None = None
        if "source" in inj:
            if "file" in inj:
                raise InvalidSpecError(f"injectors[{i}]: 'file' or 'source', not both")
            source = source_from_dict(inj["source"], f"injectors[{i}].source", disorder)
        ranges = inj.get("key_ranges", 1)
        if isinstance(ranges, bool) or not isinstance(ranges, int):
            raise InvalidSpecError(f"injectors[{i}].key_ranges: must be an integer, got {ranges!r}")
        injectors.append(InjectorSpec(str(inj["name"]), str(inj["stream"]), source, ranges))
    log_streams = tuple(str(s) for s in _list(data.get("log_streams", []), "log_streams"))
    return comps, tuple(injectors), log_streams, sinks_from_list(data.get("sinks", []))


def injector_to_dict(spec: InjectorSpec) -> dict[str, Any]:
    """An injector as a spec file (and the registry) writes it."""
    out: dict[str, Any] = {"name": spec.name, "stream": spec.stream}
    if spec.source is not None:
        out["source"] = spec.source.settings
    if spec.key_ranges != 1:
        out["key_ranges"] = spec.key_ranges
    return out


class ComputationTexts:
    """Computation specs as JSON text (:func:`computation_to_dict`), each encoded once per
    spec object and kept while it is passed again (specs are frozen: a change is a new
    object). The service serializes its whole registry at every change (the store's copy
    and the workers'); encoded whole, 1,000 computations of 64 KiB parameters were one
    ``json.dumps`` of 64 MB holding the GIL for most of a second, twice per registration,
    and the leader's lease renewals waited behind it (issue 34 item 9). Now a change
    encodes what changed and joins the rest. Not thread-safe: one per serializing owner."""

    def __init__(self) -> None:
        self._texts: dict[int, tuple[ComputationSpec, str]] = {}

    def of(self, specs: Iterable[ComputationSpec]) -> list[str]:
        """The texts of ``specs``, in order; the cache keeps only these afterwards."""
        old, new, out = self._texts, {}, []
        for spec in specs:
            hit = old.get(id(spec))
            if hit is None or hit[0] is not spec:
                hit = (spec, json.dumps(computation_to_dict(spec)))
            new[id(spec)] = hit
            out.append(hit[1])
        self._texts = new
        return out


def json_object(fields: Mapping[str, Any], encoded: Mapping[str, str]) -> str:
    """``json.dumps(fields)``, except that the values of ``encoded`` are JSON text already
    (spliced in as they are: the same document, and no second encoding of them)."""
    items = [f"{json.dumps(k)}: {encoded[k] if k in encoded else json.dumps(v)}" for k, v in fields.items()]
    return "{" + ", ".join(items) + "}"


def topology_parts_to_dict(topology: Topology) -> dict[str, Any]:
    """Injectors and sinks of a topology as spec-file fields (with their secrets: for the
    registry and the workers, never for display)."""
    return {"injectors": [injector_to_dict(i) for i in topology.injectors],
            "sinks": [sink_to_dict(s) for s in topology.sinks]}


def topology_from_dict(data: Mapping[str, Any]) -> Topology:
    topology = Topology(*spec_parts(data))
    topology.validate()
    return topology


def sources_from_dict(data: Mapping[str, Any], base: Path) -> dict[str, Any]:
    """Sources of a spec's injectors: JSON-lines files (``file``, ``max_disorder_us``)
    and connectors (``source``, millwheel.connectors.pulled)."""
    from millwheel.clock import SystemClock
    from millwheel.connectors.pulled import open_source
    from millwheel.sources import JsonLinesSource

    sources: dict[str, Any] = {}
    for spec in spec_parts(data)[1]:
        if spec.source is not None:
            sources[spec.name] = open_source(spec.name, spec.source.settings, SystemClock(), str(base))
    for inj in data.get("injectors", []):
        if "file" in inj:
            given = Path(inj["file"])
            path = given if given.is_absolute() else base / given
            if not path.is_file():
                what = "is not a file" if path.exists() else "does not exist"
                raise InvalidSpecError(
                    f"injector {inj['name']!r}: file {str(given)!r} {what} ({path.resolve()}"
                    + (", relative to the spec file's directory)" if not given.is_absolute() else ")"))
            sources[inj["name"]] = JsonLinesSource(path, int(inj.get("max_disorder_us", 0)))
    return sources


def load_spec_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML or JSON file into a mapping, naming the file on any error."""
    import yaml

    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except OSError as exc:
        raise InvalidSpecError(f"{p}: cannot read: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise InvalidSpecError(f"{p}: not valid YAML/JSON: {exc}") from None
    except RecursionError:  # the YAML reader's own limit (about 1,000 levels)
        raise InvalidSpecError(f"{p}: nested too deep to read (code params may nest "
                               f"{MAX_PARAMS_DEPTH} levels)") from None
    if not isinstance(data, dict):
        raise InvalidSpecError(f"{p}: expected a mapping at top level")
    return data
