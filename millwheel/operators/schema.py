"""The parameters of every built-in operator, checked from the data alone.

The controller validates a registration with :func:`validate_spec` and never imports
or calls anything named in it; :func:`~millwheel.operators.build_computation` runs the
same checks first, so ``millwheel run`` and the service give the same messages. A
message names the computation and the field: ``computation 'x'.code.params.size_us:
required``, ``... expected an integer, got string 'abc'``.

Code given by import path (``pkg.module:Class``), ``import:`` key extractors and the
``function`` parameter of filter, map and spark_aggregate are checked by shape only
(dotted identifiers), and against the deployment's code allow-list by
:func:`check_allowed` (PERMISSION_DENIED outside it).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Mapping

from millwheel.errors import InvalidSpecError
from millwheel.holistic import HOLISTIC, MAX_TOP_K, check_params
from millwheel.importing import AllowList, check_import_path
from millwheel.limits import MAX_DURATION_US, MAX_PARAMS_BYTES, MAX_WINDOWS_PER_RECORD, check_params_depth
from millwheel.operators.aggregate import AGGREGATIONS
from millwheel.operators.buildable import JOINS, check_buildable, with_defaults
from millwheel.operators.transform import check_expression
from millwheel.operators.window_join import MODES as WINDOW_JOIN_MODES
from millwheel.spark.aggregations import BUILTIN as SPARK_AGGREGATIONS
from millwheel.topology import ComputationSpec

_TYPE_NAMES = {"int": "an integer", "number": "a number", "str": "a string",
               "bool": "a boolean", "mapping": "a mapping", "expr": "an expression string",
               "import": "an import path 'pkg.module:function'"}


@dataclass(frozen=True)
class Param:
    kind: str  # int, number, str, bool, mapping, expr (simpleeval), import (pkg.module:fn)
    required: bool = False
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[str, ...] = ()


# Durations are bounded (MAX_DURATION_US, a century) so that a window's end plus its
# lateness fits in an int64 and in the stores for any event time.
_WINDOW = {
    "size_us": Param("int", required=True, minimum=1, maximum=MAX_DURATION_US),
    "period_us": Param("int", minimum=1, maximum=MAX_DURATION_US),
    "field": Param("str"),
    "output": Param("str"),
    "allowed_lateness_us": Param("int", minimum=0, maximum=MAX_DURATION_US),
}

# Parameters of the holistic aggregations (millwheel.holistic); which one needs which
# is a cross-check (check_params).
_HOLISTIC = {
    "p": Param("number", minimum=0.0, maximum=100.0),
    "k": Param("int", minimum=1, maximum=MAX_TOP_K),
    "by": Param("str"),
}

SCHEMAS: dict[str, dict[str, Param]] = {
    "window_aggregate": {**_WINDOW, "aggregation": Param("str", choices=AGGREGATIONS + HOLISTIC),
                         **_HOLISTIC},
    "filter": {"expr": Param("expr"), "function": Param("import"), "output": Param("str")},
    "map": {"key": Param("expr"), "value": Param("expr"), "ts": Param("expr"),
            "function": Param("import"), "output": Param("str")},
    "session_window": {
        "gap_us": Param("int", required=True, minimum=1, maximum=MAX_DURATION_US),
        "aggregation": Param("str", choices=AGGREGATIONS),
        "field": Param("str"),
        "output": Param("str"),
        "allowed_lateness_us": Param("int", minimum=0, maximum=MAX_DURATION_US),
    },
    "interval_join": {
        "left": Param("str", required=True),
        "right": Param("str", required=True),
        "lower_us": Param("int", required=True, minimum=-MAX_DURATION_US, maximum=MAX_DURATION_US),
        "upper_us": Param("int", required=True, minimum=-MAX_DURATION_US, maximum=MAX_DURATION_US),
        "output": Param("str"),
        "allowed_lateness_us": Param("int", minimum=0, maximum=MAX_DURATION_US),
    },
    "window_top": {
        "size_us": Param("int", required=True, minimum=1, maximum=MAX_DURATION_US),
        "offset_us": Param("int", minimum=0, maximum=MAX_DURATION_US),
        "field": Param("str"),
        "output": Param("str"),
        "allowed_lateness_us": Param("int", minimum=0, maximum=MAX_DURATION_US),
    },
    "window_join": {
        "left": Param("str", required=True),
        "right": Param("str", required=True),
        "size_us": Param("int", required=True, minimum=1, maximum=MAX_DURATION_US),
        "offset_us": Param("int", minimum=0, maximum=MAX_DURATION_US),
        "mode": Param("str", choices=WINDOW_JOIN_MODES),
        "output": Param("str"),
        "allowed_lateness_us": Param("int", minimum=0, maximum=MAX_DURATION_US),
    },
    "stream_join": {
        "left": Param("str", required=True),
        "right": Param("str", required=True),
        "retention_us": Param("int", minimum=0, maximum=MAX_DURATION_US),
        "output": Param("str"),
        "allowed_lateness_us": Param("int", minimum=0, maximum=MAX_DURATION_US),
    },
    "spark_aggregate": {
        **_WINDOW,
        "aggregation": Param("str", choices=SPARK_AGGREGATIONS),
        "percentile": Param("number", minimum=0.0, maximum=1.0),
        **_HOLISTIC,
        "function": Param("import"),
        "master": Param("str"),
        "spark_conf": Param("mapping"),
        "max_attempts": Param("int", minimum=1, maximum=100),
        "retry_backoff_s": Param("number", minimum=0.0, maximum=3600.0),
    },
}


def validate_spec(spec: ComputationSpec) -> None:
    """Every check of a computation's code that needs no import: InvalidSpecError
    naming the computation and field at fault. A built-in operator is also built, as
    a worker would build it (:func:`check_buildable`; nothing is imported)."""
    where = f"computation {spec.name!r}.code"
    name = spec.code.name
    params = dict(spec.code.params)
    check_params_depth(params, f"{where}.params")  # before anything walks them
    try:
        size = len(json.dumps(params))
    except (TypeError, ValueError) as exc:
        raise InvalidSpecError(f"{where}.params: not JSON data: {exc}") from None
    if size > MAX_PARAMS_BYTES:
        raise InvalidSpecError(f"{where}.params: {size} bytes of JSON, over the limit of "
                               f"{MAX_PARAMS_BYTES} bytes")
    if not spec.code.is_builtin:
        check_import_path(name, f"{where}.name")
        return
    schema = SCHEMAS.get(name)
    if schema is None:
        raise InvalidSpecError(
            f"{where}.name: unknown built-in operator {name!r}; built-ins are {sorted(SCHEMAS)} "
            "(or give 'pkg.module:Class')")
    params = with_defaults(spec, params)
    if name in JOINS:
        _check_join_inputs(spec, params, f"{where}.params", types_checked=False)
    validate_params(name, params, f"{where}.params")
    if name in JOINS:
        _check_join_inputs(spec, params, f"{where}.params", types_checked=True)
    check_buildable(spec, params)


def validate_params(operator: str, params: Mapping[str, Any], where: str) -> None:
    schema = SCHEMAS[operator]
    unknown = sorted(set(params) - set(schema))
    if unknown:
        raise InvalidSpecError(f"{where}: unknown parameters {unknown} for {operator!r} "
                               f"(known: {sorted(schema)})")
    for field, param in schema.items():
        value = params.get(field)
        if value is None:
            if param.required:
                raise InvalidSpecError(f"{where}.{field}: required")
            continue
        _check_value(value, param, f"{where}.{field}")
    _cross_checks(operator, params, where)


def _check_value(value: Any, param: Param, where: str) -> None:
    kind = param.kind
    ok = {
        "int": lambda v: (isinstance(v, int) and not isinstance(v, bool))
        or (isinstance(v, float) and v.is_integer()),
        "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
        and math.isfinite(v),
        "bool": lambda v: isinstance(v, bool),
        "mapping": lambda v: isinstance(v, Mapping),
    }.get(kind, lambda v: isinstance(v, str))(value)
    if not ok:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:40] + "..."
        raise InvalidSpecError(
            f"{where}: expected {_TYPE_NAMES[kind]}, got {_json_type(value)} {shown}")
    if kind in ("int", "number"):
        if param.minimum is not None and value < param.minimum:
            raise InvalidSpecError(f"{where}: must be >= {_num(param.minimum)}, got {_num(value)}")
        if param.maximum is not None and value > param.maximum:
            raise InvalidSpecError(f"{where}: must be <= {_num(param.maximum)}, got {_num(value)}")
    if param.choices and value not in param.choices:
        raise InvalidSpecError(f"{where}: {value!r} is not one of {list(param.choices)}")
    if kind == "expr":
        check_expression(value, where)
    elif kind == "import":
        check_import_path(value, where)


def _cross_checks(operator: str, params: Mapping[str, Any], where: str) -> None:
    if operator in ("window_aggregate", "spark_aggregate"):
        if params.get("function") is None:
            _check_holistic(str(params.get("aggregation", "count")), params, where)
        size, period = params["size_us"], params.get("period_us")
        if period is not None:
            if period > size:
                raise InvalidSpecError(f"{where}.period_us: must be <= size_us ({size}), got {period}")
            if size / period > MAX_WINDOWS_PER_RECORD:
                raise InvalidSpecError(
                    f"{where}.period_us: size_us / period_us = {size // period} windows per "
                    f"record, over the limit of {MAX_WINDOWS_PER_RECORD}")
    elif operator == "interval_join":
        lower, upper = params["lower_us"], params["upper_us"]
        if lower > upper:
            raise InvalidSpecError(f"{where}.upper_us: must be >= lower_us ({lower}), got {upper}")
    elif operator in ("window_top", "window_join"):
        size, offset = params["size_us"], params.get("offset_us")
        if offset is not None and offset >= size:
            raise InvalidSpecError(f"{where}.offset_us: must be < size_us ({size}), got {offset}")
    elif operator == "filter":
        if (params.get("expr") is None) == (params.get("function") is None):
            raise InvalidSpecError(f"{where}: give exactly one of 'expr' or 'function'")
    elif operator == "map":
        exprs = [f for f in ("key", "value", "ts") if params.get(f) is not None]
        if params.get("function") is not None and exprs:
            raise InvalidSpecError(f"{where}: give 'function' or expressions {exprs}, not both")
        if params.get("function") is None and not exprs:
            raise InvalidSpecError(f"{where}: give 'function' or at least one of key/value/ts")


def _check_holistic(aggregation: str, params: Mapping[str, Any], where: str) -> None:
    """``p``/``k``/``by`` as the aggregation needs them, the message naming the field
    (``...params.p: must be a number with 0 < p <= 100, got 0``)."""
    try:
        check_params("", aggregation, params)
    except InvalidSpecError as exc:
        field, _, why = str(exc).removeprefix(": ").partition(": ")
        raise InvalidSpecError(f"{where}.{field}: {why}") from None


def _check_join_inputs(spec: ComputationSpec, params: Mapping[str, Any], where: str,
                       types_checked: bool) -> None:
    """A join reads exactly two distinct streams (checked first, so one input is not
    reported as a missing ``right``), and, once the parameters' types are checked,
    ``left`` and ``right`` name them, one each."""
    streams = [inp.stream for inp in spec.inputs]
    if len(streams) != 2 or streams[0] == streams[1]:
        raise InvalidSpecError(
            f"computation {spec.name!r}.inputs: {spec.code.name!r} joins exactly two different streams, "
            f"got {streams}")
    if not types_checked:
        return
    for field in ("left", "right"):
        value = params.get(field)
        if isinstance(value, str) and value not in streams:
            raise InvalidSpecError(f"{where}.{field}: stream {value!r} is not one of its inputs {streams}")
    if params.get("left") == params.get("right"):
        raise InvalidSpecError(f"{where}.right: must differ from left ({params.get('left')!r})")


def import_paths(spec: ComputationSpec) -> list[tuple[str, str]]:
    """Every ``(what, pkg.module:attr)`` the spec would import when it runs."""
    where = f"computation {spec.name!r}"
    paths = []
    if not spec.code.is_builtin:
        paths.append((f"{where}.code.name", spec.code.name))
    elif isinstance(spec.code.params.get("function"), str):
        paths.append((f"{where}.code.params.function", spec.code.params["function"]))
    for i, inp in enumerate(spec.inputs):
        paths += [(f"{where}.inputs[{i}].key", p) for p in inp.key_extractor.import_paths()]
    return paths


def check_allowed(spec: ComputationSpec, allow: AllowList) -> None:
    """PermissionDeniedError naming the path and the allow-list for any code of
    ``spec`` outside ``allow`` (nothing is imported)."""
    for what, path in import_paths(spec):
        allow.check(path, what)


def _num(x: float) -> str:
    """A bound or value as written: integers exactly, floats short."""
    return str(x) if isinstance(x, int) else f"{x:g}"


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, Mapping):
        return "mapping"
    if isinstance(value, list):
        return "list"
    return type(value).__name__
