"""A filter's or map's expression made into one Python function, with simpleeval's rules.

simpleeval walks the syntax tree for every record: a method call and a result check per
node, 14% of Nexmark q0 in local mode and more on queries with several expressions. For
the common subset of the language (names, literals, arithmetic, comparisons, ``and`` /
``or`` / ``if``, subscripts and slices, dict/list/tuple/set displays, calls of the
evaluator's functions and of methods) the tree is rewritten so that everything simpleeval
checks while walking is checked by a helper at the same point, then compiled once into
``lambda key, value, json, ts: ...``:

* a name is one of the four record names or one of the evaluator's functions (anything
  else is not compiled: simpleeval raises ``NameNotDefined`` for it per record);
* an attribute is never one simpleeval refuses by name (``_`` or ``func_`` prefixes,
  ``format``, ``mro``, ...); at run time :func:`_attr` does simpleeval's lookup (falling
  back to an index, ``json.price`` as ``json["price"]``) and refuses a module or a
  forbidden function as its result;
* a call is of an evaluator's function by name or of an attribute; :func:`_call` checks
  what it returns as simpleeval checks every node's result (forbidden functions and
  modules, in containers too);
* an operator runs as the evaluator's own function where that is not the plain
  ``operator`` one (``+``, ``*``, ``**``, ``<<``, ``>>``: their length and size limits);
* a string literal over simpleeval's length limit, ``**`` in a dict, ``*`` in a list,
  f-strings, comprehensions, lambdas and every other construct are not compiled.

What is not compiled is evaluated by simpleeval as before, so a construct outside the
subset changes speed only, never meaning. No user code is imported or run to decide
this: the decision reads the syntax tree only, and the compiled function sees only the
record's names, the evaluator's functions and the helpers below (no builtins).
"""

from __future__ import annotations

import ast
import operator
import types
import warnings
from typing import Any, Callable

import simpleeval

#: The names an expression is evaluated over, in the compiled function's argument order.
RECORD_NAMES = ("key", "value", "json", "ts")

#: Each operator whose Python syntax does exactly what the evaluator's function for it
#: does: the plain ``operator`` function, or simpleeval's own lambda for ``in``/``is``.
_NATIVE: dict[type, Callable[..., Any]] = {
    ast.Sub: operator.sub, ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
    ast.BitXor: operator.xor, ast.BitOr: operator.or_, ast.BitAnd: operator.and_, ast.Not: operator.not_,
    ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Invert: operator.invert, ast.Eq: operator.eq,
    ast.NotEq: operator.ne, ast.Gt: operator.gt, ast.Lt: operator.lt, ast.GtE: operator.ge,
    ast.LtE: operator.le,
    **{op: simpleeval.DEFAULT_OPERATORS[op] for op in (ast.In, ast.NotIn, ast.Is, ast.IsNot)},
}
_SAFE_TYPES = frozenset({int, float, str, bool, type(None), bytes, complex})


def _singleton(node: ast.expr) -> bool:
    """A literal None, True or False: one object whoever evaluates it."""
    return isinstance(node, ast.Constant) and (node.value is None or node.value is True or node.value is False)


def _check(item: Any) -> Any:
    """simpleeval's ``_check_disallowed_items``: no module, no forbidden function,
    in a container either."""
    if type(item) in _SAFE_TYPES:
        return item
    if isinstance(item, types.ModuleType):
        raise simpleeval.FeatureNotAvailable("Sorry, modules are not allowed")
    if isinstance(item, (list, tuple, set, frozenset)):
        for element in item:
            _check(element)
    elif isinstance(item, dict):
        for element in item.values():
            _check(element)
    elif callable(item) and item in simpleeval.DISALLOW_FUNCTIONS:
        raise simpleeval.FeatureNotAvailable("This function is forbidden")
    return item


_MISSING = object()


def _attr(obj: Any, name: str, source: str) -> Any:
    """simpleeval's attribute access (the name was checked when compiling)."""
    item = _MISSING
    try:
        item = getattr(obj, name)
    except (AttributeError, TypeError):
        try:
            item = obj[name]
        except (KeyError, TypeError):
            pass
    if item is _MISSING:
        raise simpleeval.AttributeDoesNotExist(name, source)
    if isinstance(item, types.ModuleType):
        raise simpleeval.FeatureNotAvailable("Sorry, modules are not allowed in attribute access")
    if callable(item) and item in simpleeval.DISALLOW_FUNCTIONS:
        raise simpleeval.FeatureNotAvailable("This function is forbidden")
    return _check(item)


def _call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    return _check(fn(*args, **kwargs))


class _NotCompiled(Exception):
    """The expression leaves the compiled subset: simpleeval evaluates it."""


class _Rewrite:
    """The checked tree rebuilt with the helpers' calls in it; raises _NotCompiled."""

    def __init__(self, operators: dict[type, Callable[..., Any]], functions: dict[str, Any],
                 source: str) -> None:
        self.operators = operators
        self.functions = functions
        self.source = source  # named by AttributeDoesNotExist, as simpleeval does
        self.helpers: dict[str, Any] = {}  # name in the compiled code -> object

    def helper(self, obj: Any) -> ast.Name:
        name = f"_h{len(self.helpers)}"
        self.helpers[name] = obj
        return ast.Name(id=name, ctx=ast.Load())

    def call(self, fn: ast.expr, *args: ast.expr, keywords: list[ast.keyword] | None = None) -> ast.Call:
        return ast.Call(func=fn, args=list(args), keywords=keywords or [])

    def expr(self, node: ast.expr) -> ast.expr:
        method = getattr(self, f"_{type(node).__name__}", None)
        if method is None:
            raise _NotCompiled(type(node).__name__)
        return method(node)  # type: ignore[no-any-return]

    def _Constant(self, node: ast.Constant) -> ast.expr:
        if isinstance(node.value, (str, bytes)) and len(node.value) > simpleeval.MAX_STRING_LENGTH:
            raise _NotCompiled("long literal")
        return ast.Constant(value=node.value)

    def _Name(self, node: ast.Name) -> ast.expr:
        if node.id in RECORD_NAMES:
            return ast.Name(id=node.id, ctx=ast.Load())
        if node.id in self.functions:  # simpleeval's fallback for a name: its function
            return self.helper(self.functions[node.id])
        raise _NotCompiled(f"name {node.id}")

    def _native(self, op: ast.AST) -> bool:
        """Whether ``op`` may be written as Python syntax: the evaluator's function for it
        is the one that syntax runs (else it is called, with its limits)."""
        return _NATIVE.get(type(op)) is self._op(op)

    def _op(self, op: ast.AST) -> Callable[..., Any]:
        fn = self.operators.get(type(op))
        if fn is None:
            raise _NotCompiled(f"operator {type(op).__name__}")
        return fn

    def _BinOp(self, node: ast.BinOp) -> ast.expr:
        left, right = self.expr(node.left), self.expr(node.right)
        if self._native(node.op):
            return ast.BinOp(left=left, op=type(node.op)(), right=right)
        return self.call(self.helper(self._op(node.op)), left, right)

    def _UnaryOp(self, node: ast.UnaryOp) -> ast.expr:
        operand = self.expr(node.operand)
        if self._native(node.op):
            return ast.UnaryOp(op=type(node.op)(), operand=operand)
        return self.call(self.helper(self._op(node.op)), operand)

    def _BoolOp(self, node: ast.BoolOp) -> ast.expr:
        return ast.BoolOp(op=type(node.op)(), values=[self.expr(v) for v in node.values])

    def _Compare(self, node: ast.Compare) -> ast.expr:
        operands = [node.left, *node.comparators]
        for i, op in enumerate(node.ops):
            if not self._native(op):  # simpleeval's comparisons are all plain: never seen
                raise _NotCompiled(f"comparison {type(op).__name__}")
            if isinstance(op, (ast.Is, ast.IsNot)) and not (_singleton(operands[i]) or _singleton(operands[i + 1])):
                # identity of other values can differ: a code object shares equal
                # constants ("ab" is "ab" is True), simpleeval's walk makes one per node
                raise _NotCompiled("identity comparison of values other than None, True and False")
        return ast.Compare(left=self.expr(node.left), ops=[type(op)() for op in node.ops],
                           comparators=[self.expr(c) for c in node.comparators])

    def _IfExp(self, node: ast.IfExp) -> ast.expr:
        return ast.IfExp(test=self.expr(node.test), body=self.expr(node.body), orelse=self.expr(node.orelse))

    def _Subscript(self, node: ast.Subscript) -> ast.expr:
        return ast.Subscript(value=self.expr(node.value), slice=self.expr(node.slice), ctx=ast.Load())

    def _Slice(self, node: ast.Slice) -> ast.expr:
        def part(p: ast.expr | None) -> ast.expr | None:
            return None if p is None else self.expr(p)

        return ast.Slice(lower=part(node.lower), upper=part(node.upper), step=part(node.step))

    def _Attribute(self, node: ast.Attribute) -> ast.expr:
        if any(node.attr.startswith(p) for p in simpleeval.DISALLOW_PREFIXES) \
                or node.attr in simpleeval.DISALLOW_METHODS:
            raise _NotCompiled(f"attribute {node.attr}")  # simpleeval refuses it per record
        return self.call(self.helper(_attr), self.expr(node.value), ast.Constant(value=node.attr),
                         ast.Constant(value=self.source))

    def _Call(self, node: ast.Call) -> ast.expr:
        if isinstance(node.func, ast.Attribute):
            fn = self.expr(node.func)
        elif isinstance(node.func, ast.Name) and node.func.id in self.functions:
            target = self.functions[node.func.id]
            if target in simpleeval.DISALLOW_FUNCTIONS:
                raise _NotCompiled("forbidden function")
            fn = self.helper(target)
        else:
            raise _NotCompiled("call")
        if any(k.arg is None for k in node.keywords) or any(isinstance(a, ast.Starred) for a in node.args):
            raise _NotCompiled("unpacking in a call")
        keywords = [ast.keyword(arg=k.arg, value=self.expr(k.value)) for k in node.keywords]
        return self.call(self.helper(_call), fn, *(self.expr(a) for a in node.args), keywords=keywords)

    def _Dict(self, node: ast.Dict) -> ast.expr:
        if any(k is None for k in node.keys):
            raise _NotCompiled("** in a dict")
        return ast.Dict(keys=[self.expr(k) for k in node.keys if k is not None],
                        values=[self.expr(v) for v in node.values])

    def _elts(self, elts: list[ast.expr]) -> list[ast.expr]:
        if any(isinstance(e, ast.Starred) for e in elts):
            raise _NotCompiled("* in a display")
        return [self.expr(e) for e in elts]

    def _List(self, node: ast.List) -> ast.expr:
        return ast.List(elts=self._elts(node.elts), ctx=ast.Load())

    def _Tuple(self, node: ast.Tuple) -> ast.expr:
        return ast.Tuple(elts=self._elts(node.elts), ctx=ast.Load())

    def _Set(self, node: ast.Set) -> ast.expr:
        return ast.Set(elts=self._elts(node.elts))


def compile_expression(tree: ast.expr, source: str, operators: dict[type, Callable[..., Any]],
                       functions: dict[str, Any]) -> Callable[[Any, Any, Any, Any], Any] | None:
    """``tree`` (parsed and checked by ``check_expression``) as a function of
    ``(key, value, json, ts)`` that evaluates it as simpleeval would with these
    ``operators`` and ``functions``; None when it leaves the compiled subset."""
    rewrite = _Rewrite(operators, functions, source)
    try:
        body = rewrite.expr(tree)
    except _NotCompiled:
        return None
    args = ast.arguments(posonlyargs=[], args=[ast.arg(arg=n) for n in RECORD_NAMES], kwonlyargs=[],
                         kw_defaults=[], defaults=[])
    # the result is checked as simpleeval checks every node's (names and literals are data)
    code = ast.Expression(body=ast.Lambda(args=args, body=rewrite.call(rewrite.helper(_check), body)))
    ast.fix_missing_locations(code)
    namespace: dict[str, Any] = {"__builtins__": {}, **rewrite.helpers}
    with warnings.catch_warnings():  # "is" with a literal: simpleeval evaluates it silently too
        warnings.simplefilter("ignore", SyntaxWarning)
        fn = eval(compile(code, "<expression>", "eval"), namespace)  # noqa: S307 - the rewritten tree above
    return fn  # type: ignore[no-any-return]


def names_used(tree: ast.expr) -> frozenset[str]:
    """The record names ``tree`` reads: ``json`` is parsed and ``value`` decoded per
    record only for an expression that reads them."""
    return frozenset(n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id in RECORD_NAMES)
