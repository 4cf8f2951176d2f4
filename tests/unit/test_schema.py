"""The data-only validation of specs: parameter schemas, import-path shapes, the code
allow-list, expression limits and name limits. Nothing named in a spec is imported
while validating: a module that writes a proof file when imported proves it."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from millwheel.errors import InvalidSpecError, PermissionDeniedError
from millwheel.importing import AllowList
from millwheel.operators import build_computation
from millwheel.operators.schema import SCHEMAS, check_allowed, validate_spec
from millwheel.operators.transform import Filter, Map
from millwheel.record import Record
from millwheel.spec import computation_from_dict

BASE = {"name": "c", "inputs": ["in"], "outputs": ["out"]}


def spec(code: str = "filter", extractor: str = "key", **params: Any) -> Any:
    return computation_from_dict({**BASE, "inputs": [{"stream": "in", "key": extractor}],
                                  "code": {"name": code, "params": params}})


@pytest.mark.parametrize("code,params,message", [
    ("window_aggregate", {}, r"computation 'c'\.code\.params\.size_us: required"),
    ("window_aggregate", {"size_us": "abc"},
     r"params\.size_us: expected an integer, got string 'abc'"),
    ("window_aggregate", {"size_us": True}, r"params\.size_us: expected an integer, got boolean"),
    ("window_aggregate", {"size_us": 0}, r"params\.size_us: must be >= 1, got 0"),
    ("window_aggregate", {"size_us": 10, "period_us": 20}, r"params\.period_us: must be <= size_us"),
    ("window_aggregate", {"size_us": 10, "aggregation": "mode"}, r"params\.aggregation: 'mode' is not one of"),
    ("window_aggregate", {"size_us": 10, "aggregation": "percentile"},
     r"computation 'c'\.code\.params\.p: required by aggregation 'percentile'"),
    ("spark_aggregate", {"size_us": 10, "aggregation": "percentile", "p": 0},
     r"computation 'c'\.code\.params\.p: must be a number with 0 < p <= 100, got 0"),
    ("window_aggregate", {"size_us": 10, "aggregation": "percentile", "p": 100.5},
     r"computation 'c'\.code\.params\.p: must be <= 100, got 100\.5"),
    ("window_aggregate", {"size_us": 10, "aggregation": "mean", "p": 50},
     r"computation 'c'\.code\.params\.p: only for aggregation 'percentile', not 'mean'"),
    ("spark_aggregate", {"size_us": 10, "aggregation": "top_k"},
     r"computation 'c'\.code\.params\.k: required by aggregation 'top_k'"),
    ("window_aggregate", {"size_us": 10, "aggregation": "top_k", "k": 0}, r"params\.k: must be >= 1, got 0"),
    ("spark_aggregate", {"size_us": 10, "aggregation": "count_distinct", "by": "x"},
     r"computation 'c'\.code\.params\.by: only for aggregation 'top_k', not 'count_distinct'"),
    ("spark_aggregate", {"size_us": 10, "aggregation": "top_k", "k": 2.5}, r"params\.k: expected an integer"),
    ("window_aggregate", {"size_us": 10, "field": 3}, r"params\.field: expected a string, got number 3"),
    ("window_aggregate", {"size_us": 10, "colour": 1}, r"params: unknown parameters \['colour'\]"),
    ("filter", {}, "give exactly one of 'expr' or 'function'"),
    ("filter", {"expr": "True", "function": "a:b"}, "give exactly one of 'expr' or 'function'"),
    ("filter", {"expr": 5}, r"params\.expr: expected an expression string, got number 5"),
    ("filter", {"expr": "json[["}, "syntax error"),
    ("filter", {"function": "os.system"}, r"params\.function 'os\.system': expected 'pkg\.module:attribute'"),
    ("map", {}, "give 'function' or at least one of key/value/ts"),
    ("map", {"key": "key", "function": "a:b"}, r"give 'function' or expressions \['key'\], not both"),
    ("spark_aggregate", {"size_us": 10, "percentile": 1.5}, r"params\.percentile: must be <= 1, got 1\.5"),
    ("spark_aggregate", {"size_us": 10, "max_attempts": 0}, r"params\.max_attempts: must be >= 1"),
    ("spark_aggregate", {"size_us": 10, "spark_conf": []}, r"params\.spark_conf: expected a mapping, got list"),
    ("window_aggregate", {"size_us": 10**30}, r"params\.size_us: must be <= 3153600000000000, got 10{30}"),
    ("window_aggregate", {"size_us": 1e30}, r"params\.size_us: must be <= 3153600000000000, got 1e\+30"),
    ("window_aggregate", {"size_us": 10, "allowed_lateness_us": 2**63 - 1},
     r"params\.allowed_lateness_us: must be <= 3153600000000000"),
    ("spark_aggregate", {"size_us": 2**62}, r"params\.size_us: must be <= 3153600000000000"),
    ("window_aggregate", {"size_us": 10, "output": "elsewhere"},
     r"computation 'c'\.code\.params\.output: stream 'elsewhere' is not one of its outputs \['out'\]"),
    ("windw", {}, r"code\.name: unknown built-in operator 'windw'"),
    ("no/such:Thing", {}, r"code\.name 'no/such:Thing': expected 'pkg\.module:attribute'"),
])
def test_bad_parameters_are_invalid_naming_computation_and_field(code: str, params: dict[str, Any],
                                                                  message: str) -> None:
    with pytest.raises(InvalidSpecError, match=message):
        validate_spec(spec(code, **params))
    with pytest.raises(InvalidSpecError, match=message):  # `millwheel run` says the same
        build_computation(spec(code, **params))


def test_every_builtin_parameter_is_in_its_schema() -> None:
    """The schemas follow the constructors: a parameter a constructor takes and the
    schema does not know would be refused although valid."""
    import inspect

    from millwheel.operators.aggregate import WindowedAggregate
    from millwheel.operators.holistic_window import HolisticWindowAggregate
    from millwheel.spark.stage import SparkAggregate

    def taken(cls: Any) -> set[str]:
        return set(inspect.signature(cls.__init__).parameters) - {"self"}

    for name, classes in [("window_aggregate", (WindowedAggregate, HolisticWindowAggregate)),
                          ("filter", (Filter,)), ("map", (Map,)), ("spark_aggregate", (SparkAggregate,))]:
        assert set().union(*(taken(cls) for cls in classes)) == set(SCHEMAS[name]), name


def test_good_specs_pass_and_build() -> None:
    for s in [spec("window_aggregate", size_us=10, period_us=5, aggregation="sum", field="x"),
              spec("window_aggregate", size_us=10.0), spec("filter", expr="json['x'] > 1"),
              spec("map", key="key + '!'", ts="ts + 1"), spec("spark_aggregate", size_us=10, percentile=1)]:
        validate_spec(s)
        build_computation(s)


@pytest.fixture
def proof_module(tmp_path: Path) -> Iterator[Path]:
    """A module ``proofmod`` that writes ``tmp_path/proof`` when imported."""
    proof = tmp_path / "proof"
    (tmp_path / "proofmod.py").write_text(
        f"from pathlib import Path\nPath({str(proof)!r}).write_text('imported')\n"
        "def fn(record):\n    return True\n"
        "class Code:\n    def process_record(self, ctx, r): pass\n    def process_timer(self, ctx, t): pass\n")
    sys.path.insert(0, str(tmp_path))
    try:
        yield proof
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("proofmod", None)


def test_validation_never_imports_and_the_allow_list_is_checked_first(proof_module: Path) -> None:
    specs = [spec("proofmod:Code"), spec("filter", function="proofmod:fn"),
             spec("filter", extractor="import:proofmod:fn", expr="True")]
    for s in specs:
        validate_spec(s)
        with pytest.raises(PermissionDeniedError, match=r"module 'proofmod' is not in this deployment's code "
                           r"allow-list \(--allow-code: none: built-in operators only\)"):
            check_allowed(s, AllowList())
        with pytest.raises(PermissionDeniedError, match=r"--allow-code: other\.\*"):
            build_computation(s, AllowList.parse("other.*"))
    assert not proof_module.exists()
    build_computation(specs[0], AllowList.parse("proofmod"))
    assert proof_module.exists()


@pytest.mark.parametrize("code,params", [
    ("filter", {"expr": "True"}), ("map", {"key": "key"}), ("window_aggregate", {"size_us": 10}),
    ("spark_aggregate", {"size_us": 10}), ("filter", {"function": "proofmod:fn"}),
])
def test_a_builtin_that_would_write_nowhere_is_refused_without_importing(
        code: str, params: dict[str, Any], proof_module: Path) -> None:
    """Found by building the operator as a worker would (every worker used to fail on
    it, on every heartbeat); a ``function`` parameter is not imported to find it."""
    no_outputs = computation_from_dict({**BASE, "outputs": [], "code": {"name": code, "params": params}})
    with pytest.raises(InvalidSpecError, match=rf"computation 'c'\.outputs: '{code}' writes its results "
                                               "to a stream, and none is given"):
        validate_spec(no_outputs)
    assert not proof_module.exists()
    validate_spec(computation_from_dict({**BASE, "code": {"name": code, "params": {**params, "output": "out"}}}))
    assert not proof_module.exists()


def test_allow_list_patterns() -> None:
    allow = AllowList.parse("mypkg.*, otherpkg.mod")
    assert allow.allows("mypkg") and allow.allows("mypkg.a.b") and allow.allows("otherpkg.mod")
    assert not allow.allows("mypkgx") and not allow.allows("otherpkg") and not allow.allows("otherpkg.mod.sub")
    assert AllowList.parse("*").allows("os")
    assert not AllowList.parse("").allows("os")
    with pytest.raises(InvalidSpecError, match="allow-code pattern 'my pkg'"):
        AllowList.parse("my pkg")


def record(value: bytes = b'{"x": 3}') -> Record:
    return Record("k", value, 7, "r1")


def test_expression_limits_are_checked_when_parsing() -> None:
    with pytest.raises(InvalidSpecError, match="expression of 600001 characters, over the limit of 4096"):
        Filter(expr="1" + "+1" * 300_000)
    with pytest.raises(InvalidSpecError, match="nested deeper than the limit of 64"):
        Filter(expr="-" * 100 + "1")
    with pytest.raises(InvalidSpecError, match="nested deeper than the limit of 64"):
        Filter(expr="[" * 70 + "]" * 70)
    Filter(expr="1" + "+1" * 60)  # deep enough for real use


@pytest.mark.parametrize("expr,message", [
    ("2 ** 100000", "would exceed 4096 bits"),
    ("(10 ** 1000) ** 5", "would exceed 4096 bits"),
    ("'x' * 20000", "repetition to 20000 items, over 10000"),
    ("[1, 2] * 6000", "repetition to 12000 items, over 10000"),
    ("value * 5000", "repetition to 40000 items"),
])
def test_one_evaluation_is_bounded(expr: str, message: str) -> None:
    f = Filter(expr=expr)
    with pytest.raises(InvalidSpecError, match=f"failed on record r1: .*{message}"):
        f.predicate(record(b'{"x": 3}'))


def test_bounded_operators_still_compute() -> None:
    m = Map(value="2 ** 100 + json['x']", key="('ab' * 100) + key")
    assert m.value_expr is not None and m.value_expr(record()) == 2**100 + 3
    assert m.key_expr is not None and m.key_expr(record()) == "ab" * 100 + "k"


@pytest.mark.parametrize("change,message", [
    ({"name": "x" * 201}, "name of 201 characters, over the limit of 200"),
    ({"name": "has space"}, "names may hold only letters, digits and _ . - :"),
    ({"outputs": ["ok", "bad/slash"]}, r"outputs\[1\] stream 'bad/slash': names may hold only"),
    ({"options": {"key_ranges": 4097}}, r"key_ranges: must be 1\.\.4096"),
    ({"inputs": [{"stream": "in", "key": "json:" + "f" * 300}]}, "key extractor of 305 characters"),
])
def test_names_and_sizes_are_bounded(change: dict[str, Any], message: str) -> None:
    from millwheel.spec import topology_from_dict

    comp = {**BASE, "code": {"name": "filter", "params": {"expr": "True"}}, **change}
    with pytest.raises(InvalidSpecError, match=message):
        topology_from_dict({"computations": [comp], "injectors": [{"name": "in", "stream": "in"}]})


def test_names_the_code_creates_are_valid() -> None:
    """``injector:NAME`` nodes and ``<computation>.dead_letters`` streams fit the charset."""
    from millwheel.limits import check_name

    check_name("injector:events", "node")
    check_name("counts.dead_letters", "stream")
    check_name("a-b_C.9:x", "stream")
