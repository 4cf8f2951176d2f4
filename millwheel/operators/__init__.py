"""Built-in operators and the one function that turns a CodeRef into a Computation."""

from __future__ import annotations

from typing import Any, Callable

from millwheel.computation import Computation
from millwheel.errors import InvalidSpecError, MissingDependencyError
from millwheel.importing import AllowList, import_object
from millwheel.operators.aggregate import WindowedAggregate
from millwheel.operators.schema import check_allowed, validate_spec
from millwheel.operators.transform import Filter, Map
from millwheel.spark import spark_aggregate
from millwheel.topology import ComputationSpec

BUILTINS: dict[str, Callable[..., Computation]] = {
    "window_aggregate": WindowedAggregate,
    "filter": Filter,
    "map": Map,
    "spark_aggregate": spark_aggregate,  # lazy: pyspark loads with the first Spark job
}


def build_computation(spec: ComputationSpec, allow: AllowList | None = None) -> Computation:
    """Instantiate the code of ``spec``; raise InvalidSpecError naming what is wrong.

    The spec is first checked from its data (:func:`schema.validate_spec`, the checks
    the controller makes), then, with ``allow``, every import path in it against the
    deployment's allow-list, and only then is anything imported."""
    where = f"computation {spec.name!r}"
    validate_spec(spec)
    if allow is not None:
        check_allowed(spec, allow)
    name = spec.code.name
    params: dict[str, Any] = dict(spec.code.params)
    if spec.code.is_builtin:
        factory = BUILTINS[name]
        if name in ("window_aggregate", "spark_aggregate"):
            params.setdefault("allowed_lateness_us", spec.options.allowed_lateness_us)
    else:
        factory = import_object(name, what=f"{where} code", allow=allow)
        if not callable(factory):
            raise InvalidSpecError(f"{where}: code {name!r} is not a class or factory")
    try:
        code = factory(**params)
    except InvalidSpecError as exc:
        raise InvalidSpecError(f"{where}: {exc}") from None
    except MissingDependencyError as exc:  # a Spark stage where pyspark is not installed
        raise MissingDependencyError(f"{where}: {exc}") from None
    except TypeError as exc:
        raise InvalidSpecError(f"{where}: bad parameters for {name!r}: {exc}") from None
    if not hasattr(code, "process_record") or not hasattr(code, "process_timer"):
        raise InvalidSpecError(f"{where}: {name!r} does not have process_record/process_timer")
    bind = getattr(code, "bind_outputs", None)
    if bind is not None:
        try:
            bind(spec.all_outputs() if not spec.options.late_stream else spec.outputs)
        except InvalidSpecError as exc:
            raise InvalidSpecError(f"{where}: {exc}") from None
    return code
