"""Code parameters are bounded in depth as in size (issue 21, item 8): every way a spec
comes in (a YAML/JSON file, a dict, the Python API, the proto) refuses params nested
deeper than MAX_PARAMS_DEPTH with InvalidSpecError naming the field, never a
RecursionError (the gRPC path is tests/integration/test_service_params_depth.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from millwheel.errors import InvalidSpecError
from millwheel.keys import KeyExtractor
from millwheel.limits import MAX_PARAMS_DEPTH, nesting_depth
from millwheel.operators.schema import validate_spec
from millwheel.spec import computation_from_dict, load_spec_file
from millwheel.topology import CodeRef, ComputationSpec, InputSpec


def nested(depth: int) -> dict[str, Any]:
    """A params mapping ``depth`` levels deep (itself the first), built without recursion."""
    value: Any = []
    for _ in range(depth - 2):
        value = [value]
    return {"conf": value} if depth > 1 else {}


def as_dict(params: dict[str, Any]) -> dict[str, Any]:
    return {"name": "c", "inputs": ["events"], "outputs": ["out"],
            "code": {"name": "tests.support.pipelines:Doubler", "params": params}}


def test_depth_is_counted_without_recursion() -> None:
    assert [nesting_depth(nested(d)) for d in (1, 2, 3, MAX_PARAMS_DEPTH)] == [1, 2, 3, MAX_PARAMS_DEPTH]
    assert nesting_depth(nested(100_000)) == MAX_PARAMS_DEPTH + 1  # stops there, no RecursionError
    assert nesting_depth({"a": 1, "b": [1, {"c": "x"}]}) == 3 and nesting_depth(5) == 0
    shared: list[Any] = [1]
    shared.append(shared)  # a cycle (YAML can make one): walked once
    assert nesting_depth({"a": shared}) == 2


@pytest.mark.parametrize("depth", [MAX_PARAMS_DEPTH + 1, 900, 100_000])
def test_a_dict_spec_nested_too_deep_is_refused_by_name(depth: int) -> None:
    with pytest.raises(InvalidSpecError, match=rf"computation 'c'\.code\.params: .* limit of {MAX_PARAMS_DEPTH}"):
        computation_from_dict(as_dict(nested(depth)))
    assert computation_from_dict(as_dict(nested(MAX_PARAMS_DEPTH))).code.params == nested(MAX_PARAMS_DEPTH)


def test_the_python_api_is_held_to_the_same_limit() -> None:
    """A ComputationSpec made in Python: checked where every spec's code is (before a
    worker builds it, and by the controller's registry)."""
    spec = ComputationSpec("c", (InputSpec("events", KeyExtractor("key")),), ("out",),
                           CodeRef("tests.support.pipelines:Doubler", nested(5_000)))
    with pytest.raises(InvalidSpecError, match=rf"computation 'c'\.code\.params: .* limit of {MAX_PARAMS_DEPTH}"):
        validate_spec(spec)


def test_a_spec_file_nested_past_the_yaml_reader_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "deep.yaml"
    f.write_text("computations: [{name: c, code: {name: map, params: {a: " + "[" * 30_000 + "]" * 30_000 + "}}}]\n")
    with pytest.raises(InvalidSpecError, match="nested too deep to read"):
        load_spec_file(f)
