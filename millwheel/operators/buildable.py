"""Built-in operators built at registration, exactly as a worker builds them.

The parameter schema (:mod:`millwheel.operators.schema`) checks each parameter alone.
What only building the operator finds (an operator that writes nowhere: ``outputs:
[]`` and no ``output`` parameter; an ``output`` naming a stream the computation does
not write; parameters its constructor refuses) used to be found by every worker, on
every heartbeat, after the controller had accepted the spec. Building the operator
here, with the worker's own calls, makes "registered" mean "a worker can build it".

Only built-ins are built, and never with their ``function`` parameter: that would
import user code, which validation never does. Such a spec gets the output checks
alone; the function itself is checked by the worker that imports it, object and all
(:meth:`millwheel.importing.AllowList.check_object`).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from millwheel.computation import Computation
from millwheel.errors import InvalidSpecError
from millwheel.operators.holistic_window import window_aggregate
from millwheel.operators.join import IntervalJoin, StreamJoin
from millwheel.operators.session_window import SessionWindow
from millwheel.operators.transform import Filter, Map
from millwheel.operators.window_join import WindowJoin
from millwheel.operators.window_top import WindowTop
from millwheel.spark import spark_aggregate
from millwheel.topology import ComputationSpec

BUILTINS: dict[str, Callable[..., Computation]] = {
    "window_aggregate": window_aggregate,  # incremental, or buffered for holistic aggregations
    "filter": Filter,
    "map": Map,
    "spark_aggregate": spark_aggregate,  # lazy: pyspark loads with the first Spark job
    "session_window": SessionWindow,
    "interval_join": IntervalJoin,
    "window_top": WindowTop,
    "window_join": WindowJoin,
    "stream_join": StreamJoin,
}
#: Built-ins that join two input streams, ``left`` and ``right`` (millwheel.input_tag).
JOINS = ("interval_join", "window_join", "stream_join")
#: Built-ins whose ``allowed_lateness_us`` defaults to the computation's option.
LATENESS_DEFAULTED = ("window_aggregate", "spark_aggregate", "session_window", *JOINS, "window_top")


def with_defaults(spec: ComputationSpec, params: Mapping[str, Any]) -> dict[str, Any]:
    """The parameters a built-in is built with: ``params`` plus what the spec implies
    (``allowed_lateness_us`` from the options; a join's ``left`` and ``right`` from its
    first and second input). The controller validates exactly these."""
    out = dict(params)
    name = spec.code.name
    if name in LATENESS_DEFAULTED:
        out.setdefault("allowed_lateness_us", spec.options.allowed_lateness_us)
    if name in JOINS and len(spec.inputs) == 2:
        streams = [inp.stream for inp in spec.inputs]
        left, right = out.get("left"), out.get("right")
        if left is None:  # the input right is not, else the first
            left = out["left"] = streams[1] if right == streams[0] else streams[0]
        if right is None:
            out["right"] = streams[1] if left == streams[0] else streams[0]
    return out


def bound_outputs(spec: ComputationSpec) -> tuple[str, ...]:
    """The streams a built-in's ``bind_outputs`` is given: its default output is the
    first of them (the late stream is one only when it is not the late policy's)."""
    return spec.outputs if spec.options.late_stream else spec.all_outputs()


def check_buildable(spec: ComputationSpec, params: Mapping[str, Any]) -> None:
    """InvalidSpecError naming the computation and field unless the built-in operator
    of ``spec`` (with ``params``, defaults filled in) can be built and has a stream
    to write to. Nothing named in the spec is imported."""
    where = f"computation {spec.name!r}"
    name = spec.code.name
    writable = spec.all_outputs()
    output = params.get("output")
    if output is not None and output not in writable:
        raise InvalidSpecError(f"{where}.code.params.output: stream {output!r} is not one of its outputs "
                               f"{list(writable)}")
    if output is None and not bound_outputs(spec):
        raise InvalidSpecError(
            f"{where}.outputs: {name!r} writes its results to a stream, and none is given: list at "
            "least one in outputs (the first is written unless code.params.output names another)")
    if params.get("function") is not None:
        return
    try:
        code = BUILTINS[name](**params)
        bind = getattr(code, "bind_outputs", None)
        if bind is not None:
            bind(bound_outputs(spec))
    except InvalidSpecError as exc:
        raise InvalidSpecError(f"{where}.code: {exc}") from None
    except (TypeError, ValueError, ArithmeticError) as exc:
        raise InvalidSpecError(f"{where}.code: {name!r} cannot be built with these parameters: "
                               f"{exc.__class__.__name__}: {exc}") from None
