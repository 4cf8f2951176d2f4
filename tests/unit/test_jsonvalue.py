"""``millwheel.jsonvalue.loads`` gives ``json.loads``'s answer, and its error for what
is not JSON, on every input: orjson where it accepts the text, the standard library
for the rest (NaN, huge integers, lone surrogates, other encodings, a BOM)."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from millwheel import jsonvalue
from millwheel.errors import InvalidSpecError
from millwheel.sources import parse_json_record

EDGES: list[bytes | str] = [
    b'{"a": 1, "a": 2}', b"NaN", b"[Infinity, -Infinity]", b"1e400", b"-0.0", b"123456789012345678901234567890",
    b'"\\ud800"', b'"\\u00e9\\u0000"', "\ufeff{}".encode(), '{"k": "\u00e9t\u00e9"}'.encode("utf-16"),
    b"", b"   ", b"{", b"[1,]", b"1 2", b"\xff\xfe", b'{"a":1}\n', b" [ ] ", b"null", b"true", b"0.1",
    b"1E5", b"-12", "{\"x\": [1, 2.5, \"s\"]}", b"17.000000000000001", b"2.2250738585072014e-308",
    b'{"nested": {"deep": [[[{}]]]}}', b"9223372036854775808", b"-9223372036854775809",
]


def _outcome(fn: Any, raw: Any) -> tuple[str, Any]:
    try:
        v = fn(raw)
    except Exception as exc:  # noqa: BLE001 - class and message compared
        return type(exc).__name__, str(exc)
    return "ok", json.dumps(v, sort_keys=True) if not (isinstance(v, float) and math.isnan(v)) else "nan"


@pytest.mark.parametrize("raw", EDGES)
def test_edge_cases_answer_as_json_loads(raw: bytes | str) -> None:
    assert _outcome(jsonvalue.loads, raw) == _outcome(json.loads, raw)


_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=12)


@settings(max_examples=400, deadline=None, derandomize=True)
@given(_VALUES, st.booleans())
def test_any_json_text_answers_as_json_loads(value: Any, ascii_only: bool) -> None:
    text = json.dumps(value, ensure_ascii=ascii_only)
    for raw in (text, text.encode()):
        got = jsonvalue.loads(raw)
        assert got == json.loads(raw) and type(got) is type(json.loads(raw))


def test_a_source_line_parses_as_before_and_fails_naming_the_line() -> None:
    rec = parse_json_record('\ufeff{"key": "k", "value": {"p": 1}, "timestamp": 5}'.encode(), "f.jsonl:1")
    assert (rec.key, rec.value, rec.timestamp) == ("k", b'{"p": 1}', 5)
    rec = parse_json_record(b'{"key": "k", "value": NaN, "timestamp": 5}', "f.jsonl:2")
    assert rec.value == b"NaN"
    with pytest.raises(InvalidSpecError, match=r"f\.jsonl:3: not valid JSON: Expecting value"):
        parse_json_record(b'{"key": "k", "timestamp": }', "f.jsonl:3")
