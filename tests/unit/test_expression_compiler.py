"""Filter and map expressions compiled to Python functions give simpleeval's answers and
errors, record by record, and what leaves the compiled subset (or what simpleeval
refuses) is not compiled but left to simpleeval, which refuses it as before."""

from __future__ import annotations

import ast
import json
from typing import Any

import pytest

from millwheel.operators.transform import Filter, Map, _Expression
from millwheel.record import Record

RECORDS = [
    Record("user-7", json.dumps({"price": 120, "name": "Ann", "tags": ["a", "b"], "n": {"x": 2.5},
                                 "dateTime": 1_000, "expires": 2_000, "flag": True}).encode(), 1_500, "r1"),
    Record("k/3", b'{"price": 0, "name": "", "tags": [], "n": {}, "dateTime": 5, "expires": 1}', 7, "r2"),
    Record("plain", b"not json at all", -3, "r3"),
    Record("unicode", "{\"name\": \"\u00e9t\u00e9\", \"price\": -4}".encode(), 0, "r4"),
    Record("bad-utf8", b"\xff\xfe{", 12, "r5"),
]

#: Inside the compiled subset: each must compile and agree with simpleeval.
COMPILED = [
    "key", "value", "json", "ts", "ts + 1", "ts - 3 * 2", "ts / 2", "ts // 3", "ts % 7", "-ts", "+ts", "~ts",
    "not key", "ts ** 2", "2 ** 10", "ts << 3", "ts >> 1", "ts & 5 | 2 ^ 1",
    'json["price"]', 'json["price"] * 2 + 1', 'json["n"]["x"] * 1.5', 'json["tags"][0]', 'json["tags"][-1:]',
    'json["tags"][::2]', 'key[1:3]', 'key.split("/")[0]', 'key.upper()', 'key.startswith("user")',
    'key.replace("-", "_", 1)', 'json.get("price", 0)', 'json.get("missing") is None', 'json.price',
    'json.n.x', 'json.keys()', 'json["price"] > 100 and json["name"] != ""', 'json["price"] > 100 or ts < 0',
    '1 < ts <= 2000', 'ts in [7, 0]', 'key not in ("plain", "k/3")', 'json is None', 'json is not None',
    '"big" if json["price"] > 100 else "small"',
    '{"auction": json["price"], "who": json["name"], "t": ts}', '[key, ts, json["price"]]', '(key, ts)',
    '{key, "x"}', 'str(ts) + "/" + key', 'int(json["price"]) + float("1.5")', 'int("12", base=8)',
    'str(json["n"]["x"])', 'list(key)[0]', 'dict(a=1)["a"]', 'tuple(json["tags"])', 'set(key) == set(key)',
    '"ab" * 3', 'key * 2', 'value.strip()', 'value[:5]', '"x" in value', 'json["dateTime"] <= json["expires"]',
    'key.split("/")[0] + "/" + str(json["price"])', 'json["missing"]', '1 / 0', 'json["price"] / ts',
    'key.nope', 'json.nope', 'int(key)', 'key + 1', 'json["tags"][9]', '2 ** 5000', '"a" * 20000',
    '[1] * 20000', 'key.split', 'str', 'int', '7 << 20000', ' + '.join(['"a" * 10000'] * 11),
]

#: What simpleeval refuses on every record: never compiled, still refused.
REFUSED = [
    "key.__class__", "().__class__.__bases__", 'key.format("x")', "str.mro()", "key.func_globals",
    "len(key)", "open('/etc/passwd')", "undefined_name + 1", "__import__('os')", "key()", "print(key)",
    "key.gi_frame", "eval('1')", "_h0", "__builtins__",
]
#: Allowed, but outside the compiled subset: simpleeval evaluates them, as before.
UNSUPPORTED = ["[c for c in key]", 'f"{key}!"', "{**json}", "[*key]", "dict(**json)", "str(*key)"]


def _simpleeval(e: _Expression) -> _Expression:
    e.compiled = None
    return e


def _outcome(fn: Any, record: Record) -> tuple[str, Any]:
    try:
        return "ok", fn(record)
    except Exception as exc:  # noqa: BLE001 - the class and message are what is compared
        return type(exc).__name__, str(exc)


@pytest.mark.parametrize("source", COMPILED)
def test_a_compiled_expression_answers_and_fails_as_simpleeval_does(source: str) -> None:
    compiled = _Expression(source, "map value")
    assert compiled.compiled is not None, f"{source!r} left the compiled subset"
    reference = _simpleeval(_Expression(source, "map value"))
    for record in RECORDS:
        got, want = _outcome(compiled, record), _outcome(reference, record)
        assert got == want, f"{source!r} on {record.record_id}: compiled {got}, simpleeval {want}"


@pytest.mark.parametrize("source", REFUSED)
def test_what_simpleeval_refuses_is_not_compiled_and_still_refused(source: str) -> None:
    e = _Expression(source, "filter expr")
    assert e.compiled is None
    for record in RECORDS[:2]:
        kind, message = _outcome(e, record)
        assert kind in ("InvalidSpecError", "TypeError"), (source, kind, message)


@pytest.mark.parametrize("source", UNSUPPORTED)
def test_what_the_subset_lacks_is_left_to_simpleeval(source: str) -> None:
    e = _Expression(source, "map value")
    assert e.compiled is None
    assert _outcome(e, RECORDS[0]) == _outcome(_simpleeval(_Expression(source, "map value")), RECORDS[0])


def test_a_compiled_expression_has_no_builtins() -> None:
    e = _Expression("key.upper()", "map value")
    assert e.compiled is not None and e.compiled.__globals__["__builtins__"] == {}


def test_the_helpers_refuse_what_simpleeval_refuses() -> None:
    """A call's result and an attribute's are checked as simpleeval checks every node's:
    no forbidden function, no module, in containers too."""
    import simpleeval

    from millwheel.operators import expression_compiler as ec

    with pytest.raises(simpleeval.FeatureNotAvailable):
        ec._call(lambda: eval)
    with pytest.raises(simpleeval.FeatureNotAvailable):
        ec._attr(type("T", (), {"f": staticmethod(getattr)}), "f", "t.f")
    with pytest.raises(simpleeval.FeatureNotAvailable):
        ec._attr(type("T", (), {"m": json}), "m", "t.m")
    with pytest.raises(simpleeval.FeatureNotAvailable):
        ec._check({"a": [json]})
    assert ec._check({"a": [1, "x", None]}) == {"a": [1, "x", None]}


def test_a_map_of_several_expressions_parses_each_record_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from millwheel.operators import transform

    calls = []
    real = transform._JSON
    monkeypatch.setattr(transform, "_JSON", lambda raw: calls.append(raw) or real(raw))
    m = Map(key='str(json["price"])', value='json["name"]', ts='json["dateTime"]', output="out")
    produced: list[tuple[str, bytes, int]] = []

    class Ctx:
        def produce(self, stream: str, key: str, value: bytes, ts: int) -> None:
            produced.append((key, value, ts))

    m.process_record(Ctx(), RECORDS[0])  # type: ignore[arg-type]
    assert produced == [("120", b"Ann", 1_000)] and len(calls) == 1
    calls.clear()
    lenient = Map(key='str(json)', value='str(json is None)', output="out")
    lenient.process_record(Ctx(), RECORDS[2])  # type: ignore[arg-type]  # not JSON: json is None
    assert produced[-1] == ("None", b"True", RECORDS[2].timestamp) and len(calls) == 1
    calls.clear()
    f = Filter(expr="ts > 5", output="out")
    produced.clear()
    f.process_record(Ctx(), RECORDS[1])  # type: ignore[arg-type]
    assert produced == [("k/3", RECORDS[1].value, 7)] and not calls  # no json read: none parsed


def _trees() -> Any:
    from hypothesis import strategies as st

    leaves = st.sampled_from(['ts', 'json["price"]', 'key', '"ab"', '3', '-2', '0', '1.5', 'None', 'True',
                              'json["tags"]', 'json.name', 'value[:3]'])
    binary = st.sampled_from(["+", "-", "*", "/", "//", "%", "**", "<<", ">>", "&", "|", "^", "<", "<=", "==",
                              "!=", "in", "not in", "is", "and", "or"])

    def extend(inner: Any) -> Any:
        return st.one_of(
            st.tuples(inner, binary, inner).map(lambda t: f"({t[0]} {t[1]} {t[2]})"),
            st.tuples(st.sampled_from(["-", "not ", "~"]), inner).map(lambda t: f"({t[0]}{t[1]})"),
            st.tuples(inner, inner, inner).map(lambda t: f"({t[0]} if {t[1]} else {t[2]})"),
            st.tuples(inner, inner).map(lambda t: f"[{t[0]}, {t[1]}][0]"),
            inner.map(lambda t: f"str({t})"),
        )

    return st.recursive(leaves, extend, max_leaves=8)


def _identity_of_non_singletons(source: str) -> bool:
    """Whether ``source`` compares by ``is`` two operands neither of which is a literal
    None, True or False: left to simpleeval (its answer may differ from compiled code's)."""
    def singleton(node: ast.expr) -> bool:
        return isinstance(node, ast.Constant) and type(node.value) in (bool, type(None))
    for node in ast.walk(ast.parse(source, mode="eval")):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for i, op in enumerate(node.ops):
                if isinstance(op, (ast.Is, ast.IsNot)) and not (singleton(operands[i]) or singleton(operands[i + 1])):
                    return True
    return False


@pytest.mark.parametrize("source", ['"ab" is "ab"', '"ab" is not "ab"', 'json["name"] is "Ann"', '3 is 3',
                                    '(1.5 is 1.5) and True'])
def test_identity_of_literals_is_simpleevals_answer(source: str) -> None:
    """A code object shares equal constants, so compiled ``"ab" is "ab"`` was True where
    simpleeval (one object per node) says False: such comparisons are not compiled."""
    compiled = _Expression(source, "map value")
    assert compiled.compiled is None
    reference = _simpleeval(_Expression(source, "map value"))
    for record in RECORDS:
        assert _outcome(compiled, record) == _outcome(reference, record)


@pytest.mark.parametrize("source", ["json is None", "None is not json", "(ts > 3) is True", "False is (key == 'k')"])
def test_identity_with_none_true_or_false_is_compiled(source: str) -> None:
    compiled = _Expression(source, "map value")
    assert compiled.compiled is not None
    reference = _simpleeval(_Expression(source, "map value"))
    for record in RECORDS:
        assert _outcome(compiled, record) == _outcome(reference, record)


def test_random_expressions_agree_with_simpleeval() -> None:
    from hypothesis import given, settings

    @settings(max_examples=300, deadline=None, derandomize=True)
    @given(_trees())
    def check(source: str) -> None:
        compiled = _Expression(source, "map value")
        assert (compiled.compiled is None) == _identity_of_non_singletons(source), source
        reference = _simpleeval(_Expression(source, "map value"))
        for record in RECORDS:
            assert _outcome(compiled, record) == _outcome(reference, record), (source, record.record_id)

    check()
