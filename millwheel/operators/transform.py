"""Built-in stateless filter and map, by expression or by import path.

Expressions are evaluated with simpleeval (no attribute access to internals, no
imports, bounded power), over the names ``key`` (str), ``value`` (the value as
text), ``json`` (the value parsed as JSON, or None) and ``ts`` (µs).
"""

from __future__ import annotations

import json
from typing import Any, Callable

from simpleeval import EvalWithCompoundTypes, InvalidExpression

from millwheel.computation import Computation, Context
from millwheel.errors import InvalidSpecError
from millwheel.importing import import_object
from millwheel.record import Record


class _Expression:
    def __init__(self, source: str, what: str) -> None:
        self.source = source
        self.what = what
        self._evaluator = EvalWithCompoundTypes()
        try:
            self._parsed = self._evaluator.parse(source)
        except SyntaxError as exc:
            raise InvalidSpecError(f"{what} {source!r}: syntax error: {exc.msg}") from None

    def __call__(self, record: Record) -> Any:
        try:
            parsed: Any = json.loads(record.value)
        except ValueError:
            parsed = None
        self._evaluator.names = {
            "key": record.key, "value": record.value.decode("utf-8", "replace"),
            "json": parsed, "ts": record.timestamp,
        }
        try:
            return self._evaluator.eval(self.source, previously_parsed=self._parsed)
        except (InvalidExpression, ArithmeticError, LookupError, TypeError, ValueError) as exc:
            raise InvalidSpecError(
                f"{self.what} {self.source!r} failed on record {record.record_id}: "
                f"{exc.__class__.__name__}: {exc}"
            ) from None


def _function(path: str, what: str) -> Callable[[Record], Any]:
    fn = import_object(path, what=what)
    if not callable(fn):
        raise InvalidSpecError(f"{what} {path!r} is not callable")
    return fn  # type: ignore[no-any-return]


def _to_bytes(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    return json.dumps(value).encode()


class _Stateless(Computation):
    output: str | None = None

    def bind_outputs(self, outputs: tuple[str, ...]) -> None:
        if self.output is None:
            if not outputs:
                raise InvalidSpecError(f"{type(self).__name__.lower()} needs an output stream")
            self.output = outputs[0]


class Filter(_Stateless):
    """Pass through records for which ``expr`` (or ``function``) is true."""

    def __init__(self, *, expr: str | None = None, function: str | None = None,
                 output: str | None = None) -> None:
        if (expr is None) == (function is None):
            raise InvalidSpecError("filter: give exactly one of 'expr' or 'function'")
        self.predicate = _Expression(expr, "filter expr") if expr else _function(str(function), "filter function")
        self.output = output

    def process_record(self, ctx: Context, record: Record) -> None:
        if self.predicate(record):
            assert self.output is not None
            ctx.produce(self.output, record.key, record.value, record.timestamp)


class Map(_Stateless):
    """Rewrite key, value and timestamp by expressions, or by a function returning a
    ``Record``-like ``(key, value, timestamp)`` tuple (or None to drop)."""

    def __init__(self, *, key: str | None = None, value: str | None = None, ts: str | None = None,
                 function: str | None = None, output: str | None = None) -> None:
        if function is not None and (key or value or ts):
            raise InvalidSpecError("map: give 'function' or expressions, not both")
        if function is None and not (key or value or ts):
            raise InvalidSpecError("map: give 'function' or at least one of key/value/ts")
        self.function = _function(function, "map function") if function else None
        self.key_expr = _Expression(key, "map key") if key else None
        self.value_expr = _Expression(value, "map value") if value else None
        self.ts_expr = _Expression(ts, "map ts") if ts else None
        self.output = output

    def process_record(self, ctx: Context, record: Record) -> None:
        assert self.output is not None
        if self.function is not None:
            result = self.function(record)
            if result is None:
                return
            k, v, t = result
        else:
            k = str(self.key_expr(record)) if self.key_expr else record.key
            v = _to_bytes(self.value_expr(record)) if self.value_expr else record.value
            t = int(self.ts_expr(record)) if self.ts_expr else record.timestamp
        ctx.produce(self.output, k, _to_bytes(v), int(t))
