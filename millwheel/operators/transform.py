"""Built-in stateless filter and map, by expression or by import path.

Expressions are evaluated with simpleeval (no attribute access to internals, no
imports), over the names ``key`` (str), ``value`` (the value as text), ``json`` (the
value parsed as JSON, or None) and ``ts`` (µs). What one evaluation may cost is
bounded: an expression is at most ``MAX_EXPRESSION_CHARS`` long and
``MAX_EXPRESSION_DEPTH`` deep (checked when the spec is validated, by parsing only),
``**`` may not make an integer over ``MAX_POWER_BITS`` bits and ``*`` may not make a
string or sequence over ``MAX_REPEAT`` items (a failed evaluation names the record).
"""

from __future__ import annotations

import ast
import json
from typing import Any, Callable

import simpleeval
from simpleeval import EvalWithCompoundTypes, InvalidExpression

from millwheel import jsonvalue
from millwheel.computation import Computation, Context
from millwheel.errors import InvalidSpecError
from millwheel.importing import import_object
from millwheel.operators.expression_compiler import compile_expression, names_used
from millwheel.operators.outputs import default_output
from millwheel.record import Record

MAX_EXPRESSION_CHARS = 4096
MAX_EXPRESSION_DEPTH = 64  # nesting of the syntax tree (simpleeval evaluates recursively)
MAX_POWER_BITS = 4096
MAX_REPEAT = 10_000


def check_expression(source: object, what: str) -> ast.expr:
    """Parse (never evaluate) an expression within the length and depth limits; an
    InvalidSpecError names ``what`` and the limit or the syntax error."""
    if not isinstance(source, str):
        raise InvalidSpecError(f"{what}: expected an expression string, got {type(source).__name__}")
    if len(source) > MAX_EXPRESSION_CHARS:
        raise InvalidSpecError(f"{what}: expression of {len(source)} characters, over the limit "
                               f"of {MAX_EXPRESSION_CHARS}")
    try:
        tree = ast.parse(source.strip(), mode="eval")
    except SyntaxError as exc:
        raise InvalidSpecError(f"{what} {source!r}: syntax error: {exc.msg}") from None
    except (RecursionError, MemoryError, ValueError) as exc:
        raise InvalidSpecError(f"{what}: expression cannot be parsed: {exc.__class__.__name__}") from None
    stack: list[tuple[ast.AST, int]] = [(tree.body, 1)]
    while stack:  # iteratively: a deep tree must not overflow this check either
        node, depth = stack.pop()
        if depth > MAX_EXPRESSION_DEPTH:
            raise InvalidSpecError(f"{what}: expression nested deeper than the limit of "
                                   f"{MAX_EXPRESSION_DEPTH}")
        stack.extend((child, depth + 1) for child in ast.iter_child_nodes(node))
    return tree.body


def _power(a: Any, b: Any) -> Any:
    if isinstance(a, int) and isinstance(b, int) and b > 0 and abs(a) > 1 \
            and a.bit_length() * b > MAX_POWER_BITS:
        raise simpleeval.NumberTooHigh(f"{a} ** {b} would exceed {MAX_POWER_BITS} bits")
    return simpleeval.safe_power(a, b)


def _mult(a: Any, b: Any) -> Any:
    for seq, n in ((a, b), (b, a)):
        if hasattr(seq, "__len__") and isinstance(n, int) and len(seq) * n > MAX_REPEAT:
            raise simpleeval.IterableTooLong(f"repetition to {len(seq) * n} items, over {MAX_REPEAT}")
    return simpleeval.safe_mult(a, b)


def parse_json(record: Record) -> Any:
    """The record's value as JSON, or None (the expressions' name ``json``)."""
    try:
        return _JSON(record.value)
    except ValueError:
        return None


_JSON = jsonvalue.loads
#: An expression's ``parsed`` argument when its caller did not parse the record.
UNPARSED: Any = object()


class _Expression:
    """One expression of a filter or map: compiled to a Python function where it stays
    inside simpleeval's common subset (millwheel/operators/expression_compiler.py),
    evaluated by simpleeval otherwise; the same answers and errors either way."""

    def __init__(self, source: str, what: str) -> None:
        self.source = source
        self.what = what
        self._parsed = check_expression(source, what)
        operators = dict(simpleeval.DEFAULT_OPERATORS)
        operators.update({ast.Pow: _power, ast.Mult: _mult})
        self._evaluator = EvalWithCompoundTypes(operators=operators)
        self.compiled = compile_expression(self._parsed, source, operators, self._evaluator.functions)
        used = names_used(self._parsed)
        self.needs_json, self._needs_value = "json" in used, "value" in used

    def __call__(self, record: Record, parsed: Any = UNPARSED) -> Any:
        """The expression on ``record``; ``parsed`` is its JSON when the caller parsed it
        already (a map's several expressions parse a record once, None included)."""
        if parsed is UNPARSED:
            parsed = parse_json(record) if self.needs_json else None
        try:
            if self.compiled is not None:
                return self.compiled(record.key, record.value.decode("utf-8", "replace")
                                     if self._needs_value else None, parsed, record.timestamp)
            self._evaluator.names = {
                "key": record.key, "value": record.value.decode("utf-8", "replace"),
                "json": parsed, "ts": record.timestamp,
            }
            return self._evaluator.eval(self.source, previously_parsed=self._parsed)
        except InvalidExpression as exc:  # what the expression may not do: a spec error
            raise InvalidSpecError(
                f"{self.what} {self.source!r} failed on record {record.record_id}: "
                f"{exc.__class__.__name__}: {exc}"
            ) from None
        except (ArithmeticError, LookupError, TypeError, ValueError) as exc:
            # The expression is the user's code and this is its error (1 / 0 on this
            # record's data): the error policy records it under its own class, with the
            # expression and the record in the message.
            raise _same_class(exc, f"{self.what} {self.source!r} failed on record {record.record_id}: "
                                   f"{exc}") from None


class _KeyError(KeyError):
    """A KeyError whose message reads as text (KeyError's own str() is its key's repr);
    named KeyError, which is what the error policy records."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


_KeyError.__name__ = _KeyError.__qualname__ = "KeyError"


def _same_class(exc: Exception, message: str) -> Exception:
    """``exc``'s class with ``message`` (built-in errors take one argument), else ``exc``."""
    if type(exc) is KeyError:
        return _KeyError(message)
    if type(exc).__module__ != "builtins":
        return exc
    try:
        return type(exc)(message)
    except Exception:
        return exc


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
        self.output = default_output(type(self).__name__.lower(), self.output, outputs)


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
        # several expressions reading ``json`` share one parse of the record's value
        self._needs_json = sum(1 for e in (self.key_expr, self.value_expr, self.ts_expr)
                               if e is not None and e.needs_json) > 1
        self.output = output

    def process_record(self, ctx: Context, record: Record) -> None:
        assert self.output is not None
        if self.function is not None:
            result = self.function(record)
            if result is None:
                return
            k, v, t = result
        else:
            parsed = parse_json(record) if self._needs_json else UNPARSED
            k = str(self.key_expr(record, parsed)) if self.key_expr else record.key
            v = _to_bytes(self.value_expr(record, parsed)) if self.value_expr else record.value
            t = int(self.ts_expr(record, parsed)) if self.ts_expr else record.timestamp
        ctx.produce(self.output, k, _to_bytes(v), int(t))
