"""Built-in operators and the one function that turns a CodeRef into a Computation."""

from __future__ import annotations

from typing import Any

from millwheel.computation import Computation
from millwheel.errors import InvalidSpecError, MissingDependencyError
from millwheel.importing import AllowList, import_object
from millwheel.operators.buildable import BUILTINS, bound_outputs, with_defaults
from millwheel.operators.schema import check_allowed, import_paths, validate_spec
from millwheel.topology import ComputationSpec

__all__ = ["BUILTINS", "build_computation"]


def build_computation(spec: ComputationSpec, allow: AllowList | None = None) -> Computation:
    """Instantiate the code of ``spec``; raise InvalidSpecError naming what is wrong.

    The spec is first checked from its data (:func:`schema.validate_spec`, the checks
    the controller makes), then, with ``allow``, every import path in it against the
    deployment's allow-list; only then is anything imported, and every object named
    (code, ``function``, key extractors) is checked against the allow-list too
    (:meth:`AllowList.check_object`) before anything is called."""
    where = f"computation {spec.name!r}"
    validate_spec(spec)
    if allow is not None:
        check_allowed(spec, allow)
        for what, path in import_paths(spec):
            import_object(path, what=what, allow=allow)
    name = spec.code.name
    params: dict[str, Any] = dict(spec.code.params)
    if spec.code.is_builtin:
        factory = BUILTINS[name]
        params = with_defaults(spec, params)
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
            bind(bound_outputs(spec))
        except InvalidSpecError as exc:
            raise InvalidSpecError(f"{where}: {exc}") from None
    return code
